"""A memo actor holds the proofs that a job's driver, actors and tasks share."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from ..verify.store import ProofStore

_MemoActor = ray.remote(ProofStore)


@dataclass(frozen=True)
class RemoteStore:
    """A MemoStore kept by a memo actor: reads wait for it, writes do not (the actor runs one
    caller's calls in order, so a read sees that caller's earlier writes)."""

    actor: ActorHandle

    def get(self, kind: str, key: str) -> Any | None:
        return ray.get(self.actor.get.remote(kind, key))

    def put(self, kind: str, key: str, value: Any) -> None:
        self.actor.put.remote(kind, key, value)

    def commit(self) -> None:
        ray.get(self.actor.commit.remote())


def memo_store(path: str | None) -> RemoteStore:
    """The job's memo actor for `path` (a ProofStore there, persisted; in memory when None),
    started on first use and restarted if it dies. It lives while a handle to it does."""
    where = str(Path(path).resolve()) if path else ":memory:"
    actor = _MemoActor.options(name=f"scalify-memo:{where}", get_if_exists=True, num_cpus=0,
                               max_restarts=-1, max_task_retries=-1).remote(where)
    return RemoteStore(actor)
