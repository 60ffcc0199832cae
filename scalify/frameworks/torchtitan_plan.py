"""A torchtitan plan as a config states it, in the names of torchtitan's `parallelism` section.
Only validated and held here (no torch or torchtitan import); scalify/frameworks/torchtitan.py
builds it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scalify.dtensor_plan import PlanError
from scalify.frameworks.plan_fields import flag, parallel_degree

# torchtitan's parallel degrees (`ParallelismConfig`'s names) and the ones verified so far.
PARALLEL_DEGREES = ("tensor_parallel_degree", "data_parallel_replicate_degree",
                    "data_parallel_shard_degree", "context_parallel_degree",
                    "pipeline_parallel_degree", "expert_parallel_degree")
SUPPORTED_DEGREES = ("tensor_parallel_degree",)
SPMD_BACKENDS = ("partial_dtensor", "full_dtensor", "spmd_types")
SUPPORTED_BACKENDS = ("partial_dtensor", "spmd_types")


@dataclass(frozen=True)
class TorchtitanPlan:
    """The parallel degrees, `enable_sequence_parallel` (on by default, as in torchtitan) and
    `spmd_backend` (partial_dtensor by default here; torchtitan's default, spmd_types, is
    verified without sequence parallelism)."""

    tensor_parallel_degree: int = 1
    enable_sequence_parallel: bool = True
    spmd_backend: str = "partial_dtensor"

    def world_size(self) -> int:
        return self.tensor_parallel_degree


def parse_torchtitan(value: Any) -> TorchtitanPlan:
    """`{tensor_parallel_degree: N, enable_sequence_parallel: bool, spmd_backend: name}`; the
    other degrees of torchtitan's parallelism section may be given as 1 (or -1 for
    data_parallel_shard_degree, torchtitan's "the rest", which is 1 here)."""
    if not isinstance(value, dict):
        raise PlanError((), f"expected a mapping of torchtitan parallelism fields, got {value!r}")
    fields: dict[str, Any] = {}
    for key, item in value.items():
        if key in PARALLEL_DEGREES:
            unset = -1 if key == "data_parallel_shard_degree" else None  # torchtitan's "the rest"
            parallel_degree(key, item, SUPPORTED_DEGREES, "torchtitan", unset)
            if key in SUPPORTED_DEGREES:
                fields[key] = item
        elif key == "enable_sequence_parallel":
            fields[key] = flag(key, item)
        elif key == "spmd_backend":
            if item not in SPMD_BACKENDS:
                raise PlanError((key,), f"expected one of {', '.join(SPMD_BACKENDS)}, got {item!r}")
            if item not in SUPPORTED_BACKENDS:
                raise PlanError((key,), f"{item} is not verified yet: use "
                                        f"{', '.join(SUPPORTED_BACKENDS)}")
            fields[key] = item
        else:
            raise PlanError((str(key),), "unknown torchtitan parallelism field (expected one of: "
                            f"{', '.join((*PARALLEL_DEGREES, 'enable_sequence_parallel', 'spmd_backend'))})")
    plan = TorchtitanPlan(**fields)
    if plan.spmd_backend == "spmd_types" and plan.enable_sequence_parallel:
        raise PlanError(("enable_sequence_parallel",), "not verified yet with spmd_backend "
                        "spmd_types (its reduce-scatter over the sequence is not followed yet): "
                        "set it to false, or use partial_dtensor")
    return plan
