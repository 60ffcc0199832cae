"""Joining a Ray cluster, and reading results with the remote error as the error raised."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayTaskError

LOCAL_TEMP_DIR = Path(tempfile.gettempdir()) / "scalify-ray"


def connect(address: str | None = None) -> None:
    """Join the cluster at `address` (default: RAY_ADDRESS, as inside `ray job submit`); with
    neither, start a local instance on this machine's cores. Nothing happens when connected."""
    if ray.is_initialized():
        return
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, **quiet)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=str(LOCAL_TEMP_DIR),
                 **quiet)


def resolve(ref: ray.ObjectRef) -> Any:
    """The value of `ref`; a task's own error (a ConfigError, say) is raised as itself."""
    try:
        return ray.get(ref)
    except RayTaskError as error:
        if error.cause is None:
            raise
        raise error.cause from None
