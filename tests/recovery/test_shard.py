"""The plain classes behind the parameter server's actors, without Ray."""
import numpy as np

from scalify.recovery.layout import Layout
from scalify.recovery.shard import ParameterShard, UpdateWorker
from scalify.recovery.store import CheckpointStore, array_bytes
from scalify.recovery.workloads import LogisticRegression

LAYOUT = Layout(size=8, blocks=4, shards=2)


def test_a_restarted_shard_reloads_its_blocks_and_says_so_once(tmp_path):
    CheckpointStore(tmp_path).save({1: array_bytes(np.full(2, 7.0)),
                                    3: array_bytes(np.full(2, 9.0))}, iteration=4)
    initial = {1: np.zeros(2), 3: np.zeros(2)}
    fresh = ParameterShard(1, LAYOUT, initial, tmp_path)
    fresh.push({1: np.ones(2), 3: np.ones(2)})
    blocks, restarted = fresh.pull()
    assert not restarted and np.array_equal(blocks[1], [1, 1])
    again = ParameterShard(1, LAYOUT, initial, tmp_path, restarted=True)
    blocks, restarted = again.pull()
    assert restarted and np.array_equal(blocks[1], [7, 7]) and np.array_equal(blocks[3], [9, 9])
    assert again.pull()[1] is False


def test_the_worker_returns_one_iteration_as_an_update():
    workload = LogisticRegression()
    worker = UpdateWorker(LogisticRegression)
    params = worker.start()
    delta = worker.update(params, 0)
    assert np.allclose(params + delta, workload.step(workload.start(), 0).params)
    assert worker.loss(params + delta) < worker.loss(params)
