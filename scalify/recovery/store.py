"""A crash-safe checkpoint store: numbered blocks, each with the iteration it was last saved.

Every file is written to a temporary name, fsync'd, renamed into place, and the directory is
fsync'd. A save writes its blocks under new versioned names first and then replaces the
manifest, which names the current version of every block with its checksum. A save that dies
part-way leaves the previous manifest, and so the previous checkpoint, in force; a torn or
corrupted file fails its checksum and is refused, never loaded.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..errors import ScalifyError

MANIFEST = "manifest.json"
READ_ATTEMPTS = 3


class CorruptCheckpoint(ScalifyError):
    """A checkpoint file does not match its checksum (a torn or damaged write)."""


@dataclass(frozen=True)
class Saved:
    """One block as last saved: its bytes and the iteration it was saved at."""

    data: bytes
    iteration: int


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_directory(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` all at once: temp file, fsync, rename, fsync the directory."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)


class CheckpointStore:
    """Blocks keyed by integer id in the folder `root`; `save` replaces some of them at once."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def manifest(self) -> dict[int, dict]:
        """Each saved block's entry: iteration, file and sha256 (empty before the first save)."""
        path = self.root / MANIFEST
        if not path.exists():
            return {}
        text = path.read_bytes()
        try:
            body = json.loads(text)
            entries, digest = body["blocks"], body["sha256"]
        except (ValueError, KeyError, TypeError) as error:
            raise CorruptCheckpoint(f"{path} is not a whole manifest: {error}") from None
        if _digest(json.dumps(entries, sort_keys=True).encode()) != digest:
            raise CorruptCheckpoint(f"{path} does not match its checksum")
        return {int(block): entry for block, entry in entries.items()}

    def iterations(self) -> dict[int, int]:
        """The iteration each saved block was last saved at."""
        return {block: entry["iteration"] for block, entry in self.manifest().items()}

    def save(self, blocks: Mapping[int, bytes], iteration: int) -> None:
        """Save `blocks` as of `iteration`; the others keep their earlier saves."""
        entries = {str(block): entry for block, entry in self.manifest().items()}
        for block, data in blocks.items():
            name = f"block-{block}.{iteration}"
            write_atomic(self.root / name, data)
            entries[str(block)] = {"iteration": iteration, "file": name, "sha256": _digest(data)}
        body = {"blocks": entries, "sha256": _digest(json.dumps(entries, sort_keys=True).encode())}
        write_atomic(self.root / MANIFEST, json.dumps(body).encode())
        self._drop_stale({entry["file"] for entry in entries.values()})

    def load(self, blocks: Iterable[int] | None = None) -> dict[int, Saved]:
        """The saved blocks (all of them by default), each checked against its checksum. A save
        that replaces a block while it is read makes the read start again."""
        wanted = None if blocks is None else list(blocks)
        for _ in range(READ_ATTEMPTS - 1):
            try:
                return self._read(wanted)
            except FileNotFoundError:
                continue
        return self._read(wanted)

    def _read(self, blocks: list[int] | None) -> dict[int, Saved]:
        manifest = self.manifest()
        wanted = manifest if blocks is None else {b: manifest[b] for b in blocks if b in manifest}
        saved = {}
        for block, entry in wanted.items():
            data = (self.root / entry["file"]).read_bytes()
            if _digest(data) != entry["sha256"]:
                raise CorruptCheckpoint(f"block {block} ({entry['file']}) fails its checksum")
            saved[block] = Saved(data, entry["iteration"])
        return saved

    def _drop_stale(self, current: set[str]) -> None:
        """Remove block versions the manifest no longer names."""
        for path in self.root.glob("block-*"):
            if path.name not in current:
                path.unlink(missing_ok=True)


def array_bytes(values: np.ndarray) -> bytes:
    """A block's values as bytes for the store (NumPy's .npy format, no pickles)."""
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    return buffer.getvalue()


def bytes_array(data: bytes) -> np.ndarray:
    """The inverse of `array_bytes`."""
    return np.load(io.BytesIO(data), allow_pickle=False)
