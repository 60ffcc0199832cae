"""The checkpoint store: atomic saves, a manifest that names each block's iteration, and torn
writes that never load."""
import json
import os

import numpy as np
import pytest

from scalify.recovery import store as store_module
from scalify.recovery.store import (MANIFEST, CheckpointStore, CorruptCheckpoint, array_bytes,
                                    bytes_array, write_atomic)


def test_blocks_keep_the_iteration_each_was_last_saved(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({0: b"a0", 1: b"b0", 2: b"c0"}, iteration=0)
    store.save({1: b"b5"}, iteration=5)
    assert store.iterations() == {0: 0, 1: 5, 2: 0}
    loaded = store.load()
    assert {b: s.data for b, s in loaded.items()} == {0: b"a0", 1: b"b5", 2: b"c0"}
    assert store.load([1, 7]).keys() == {1}  # unknown blocks are simply absent
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "block-0.0", "block-1.5", "block-2.0", MANIFEST]  # stale versions are dropped


def test_arrays_round_trip_without_pickles():
    values = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(bytes_array(array_bytes(values)), values)


def test_an_atomic_write_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))
    write_atomic(tmp_path / "x", b"payload")
    assert (tmp_path / "x").read_bytes() == b"payload"
    assert synced == [str(tmp_path / ".x.tmp"), str(tmp_path)]
    assert not (tmp_path / ".x.tmp").exists()


def test_a_save_that_dies_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    store.save({0: b"old0", 1: b"old1"}, iteration=3)
    writes = []

    def dies_on_the_manifest(path, data):  # the blocks land, the manifest's rename never does
        if path.name == MANIFEST:
            path.with_name(f".{path.name}.tmp").write_bytes(data[: len(data) // 2])
            raise OSError("power cut")
        writes.append(path.name)
        write_atomic(path, data)

    monkeypatch.setattr(store_module, "write_atomic", dies_on_the_manifest)
    with pytest.raises(OSError):
        store.save({0: b"new0", 1: b"new1"}, iteration=9)
    monkeypatch.undo()
    assert writes == ["block-0.9", "block-1.9"]
    reopened = CheckpointStore(tmp_path)
    assert reopened.iterations() == {0: 3, 1: 3}
    assert {b: s.data for b, s in reopened.load().items()} == {0: b"old0", 1: b"old1"}


def test_a_torn_manifest_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({0: b"x"}, iteration=1)
    whole = (tmp_path / MANIFEST).read_bytes()
    (tmp_path / MANIFEST).write_bytes(whole[:-7])
    with pytest.raises(CorruptCheckpoint, match="not a whole manifest"):
        store.load()
    body = json.loads(whole)
    body["blocks"]["0"]["iteration"] = 2  # parses, but is not what was written
    (tmp_path / MANIFEST).write_text(json.dumps(body))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        store.iterations()


def test_a_torn_block_is_refused(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({0: array_bytes(np.ones(100))}, iteration=1)
    path = tmp_path / "block-0.1"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CorruptCheckpoint, match="block 0"):
        store.load()
