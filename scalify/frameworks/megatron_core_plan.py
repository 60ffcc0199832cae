"""A Megatron-Core plan as a config states it, in Megatron's own field names. Only validated
and held here (no torch or megatron import); scalify/frameworks/megatron_core.py builds it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scalify.dtensor_plan import PlanError
from scalify.frameworks.plan_fields import flag, parallel_degree

# Megatron's parallel sizes (`initialize_model_parallel`'s names) and the ones verified so far.
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "expert_model_parallel_size")
SUPPORTED_SIZES = ("tensor_model_parallel_size",)


@dataclass(frozen=True)
class MegatronCorePlan:
    """Parallel sizes, `sequence_parallel`, and further `TransformerConfig` fields (checked
    against the installed Megatron-Core when the model is built)."""

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    transformer_config: tuple[tuple[str, Any], ...] = ()
    # The loss's label smoothing, the argument of Megatron's vocab-parallel cross entropy
    # (Megatron-LM's and NeMo's `label_smoothing`); verified with `verify.loss`.
    label_smoothing: float = 0.0

    def world_size(self) -> int:
        return self.tensor_model_parallel_size


def parse_megatron_core(value: Any) -> MegatronCorePlan:
    """`{tensor_model_parallel_size: N, sequence_parallel: bool, label_smoothing: x,
    transformer_config: {...}}`."""
    if not isinstance(value, dict):
        raise PlanError((), f"expected a mapping of Megatron-Core fields, got {value!r}")
    fields: dict[str, Any] = {}
    for key, item in value.items():
        if key in PARALLEL_SIZES:
            parallel_degree(key, item, SUPPORTED_SIZES, "Megatron-Core")
            if key in SUPPORTED_SIZES:
                fields[key] = item
        elif key == "sequence_parallel":
            if flag(key, item):  # (WrappedTorchNorm asserts it is off)
                raise PlanError((key,), "not supported by Megatron-Core's local layer spec (its "
                                        "torch norms; Apex and Transformer Engine need a GPU)")
            fields[key] = item
        elif key == "label_smoothing":
            if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0 <= item < 1:
                raise PlanError((key,), f"expected a number in [0, 1), got {item!r}")
            fields[key] = float(item)
        elif key == "transformer_config":
            if not isinstance(item, dict) or not all(isinstance(k, str) for k in item):
                raise PlanError((key,), "expected a mapping of TransformerConfig field names "
                                        f"to values, got {item!r}")
            fields[key] = tuple(sorted(item.items()))
        else:
            raise PlanError((str(key),), "unknown Megatron-Core field (expected one of: "
                            f"{', '.join((*PARALLEL_SIZES, 'sequence_parallel', 'label_smoothing', 'transformer_config'))})")
    return MegatronCorePlan(**fields)
