"""Checkpoint schedules (what is saved when) and recoveries (what a lost shard costs)."""
import numpy as np

from scalify.recovery.layout import Layout
from scalify.recovery.store import CheckpointStore
from scalify.recovery.strategies import (Checkpointer, Schedule, every_block, full_rollback,
                                         largest_change, partial_recovery, random_blocks,
                                         round_robin, strategies)

LAYOUT = Layout(size=8, blocks=4, shards=2)  # blocks of 2; shard 0 holds blocks 0 and 2


def test_layout_deals_blocks_to_shards_round_robin():
    assert LAYOUT.slices == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert LAYOUT.shard_blocks(0) == [0, 2] and LAYOUT.shard_blocks(1) == [1, 3]


def test_selectors():
    changes = np.array([0.1, 3.0, 0.2, 2.0])
    assert every_block(changes, 2, 0) == [0, 1, 2, 3]
    assert largest_change(changes, 2, 0) == [1, 3]
    assert [round_robin(changes, 2, turn) for turn in range(3)] == [[0, 1], [2, 3], [0, 1]]
    pick = random_blocks(seed=4)
    assert pick(changes, 2, 7) == pick(changes, 2, 7) and len(set(pick(changes, 2, 7))) == 2


def test_prioritized_checkpoints_save_the_most_changed_blocks(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpointer = Checkpointer(store, LAYOUT, Schedule("prioritized", 2, 0.5, largest_change))
    checkpointer.start(np.zeros(8))
    moved = np.array([0, 0, 5, 5, 0, 1, 9, 9.0])
    assert checkpointer.after(moved, 1) == []  # not due
    assert checkpointer.after(moved, 2) == [1, 3]
    assert store.iterations() == {0: 0, 1: 2, 2: 0, 3: 2}
    assert checkpointer.after(moved, 4) == [0, 2]  # block 2 moved by 1 since; ties go in order
    assert store.iterations() == {0: 4, 1: 2, 2: 4, 3: 2}


def test_traditional_rolls_everything_back_partial_only_the_lost_shard(tmp_path):
    store = CheckpointStore(tmp_path)
    Checkpointer(store, LAYOUT, Schedule("all", 4, 1.0, every_block)).start(np.zeros(8))
    live = np.arange(1.0, 9.0)
    assert np.array_equal(full_rollback(live, store, LAYOUT, lost_shard=1), np.zeros(8))
    assert np.array_equal(partial_recovery(live, store, LAYOUT, lost_shard=1),
                          [1, 2, 0, 0, 5, 6, 0, 0])


def test_strategies_share_one_io_budget():
    compared = {s.name: s.schedule for s in strategies(period=8, fraction=0.25)}
    assert compared["traditional"] == compared["partial"]
    for name in ("partial + prioritized", "partial + round-robin", "partial + random"):
        schedule = compared[name]
        assert schedule.period == 2 and schedule.fraction / schedule.period == 1.0 / 8
