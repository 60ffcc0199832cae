"""A persistent proof store (SQLite): window and layer results keyed by their canonical text.

Runs and sweeps that share the store reuse each other's proofs. Keys include a hash of the rule
program, so changing a rule invalidates every stored proof. Writes are transactions: a run that
dies mid-way leaves every committed entry readable and no torn one.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any, Protocol

from ..rules import prelude

_SCHEMA = "CREATE TABLE IF NOT EXISTS proofs (key TEXT PRIMARY KEY, value TEXT NOT NULL)"


class MemoStore(Protocol):
    """Where proofs are kept: this SQLite store, or a proxy to one (the Ray memo actor)."""

    def get(self, kind: str, key: str) -> Any | None: ...

    def put(self, kind: str, key: str, value: Any) -> None: ...

    def commit(self) -> None: ...


class ProofStore:
    """Maps a (kind, key) to a JSON value; kind separates windows from layers."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path))
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._db.commit()
        self._rules = hashlib.sha256(prelude().encode()).hexdigest()[:16]
        self._pending = 0

    def _key(self, kind: str, key: str) -> str:
        return f"{self._rules}:{kind}:{hashlib.sha256(key.encode()).hexdigest()}"

    def get(self, kind: str, key: str) -> Any | None:
        row = self._db.execute("SELECT value FROM proofs WHERE key = ?",
                               (self._key(kind, key),)).fetchone()
        return json.loads(row[0]) if row else None

    def put(self, kind: str, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO proofs (key, value) VALUES (?, ?)",
                         (self._key(kind, key), json.dumps(value)))
        self._pending += 1
        if self._pending >= 64:
            self.commit()

    def commit(self) -> None:
        self._db.commit()
        self._pending = 0

    def close(self) -> None:
        self.commit()
        self._db.close()
