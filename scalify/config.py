"""Load experiment YAML files into validated, frozen specs; every error names its file and field."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from scalify.dtensor_plan import DTensorPlan, PlanError, parse_plan
from scalify.errors import ConfigError
from scalify.frameworks.megatron_core_plan import MegatronCorePlan, parse_megatron_core
from scalify.frameworks.torchtitan_plan import TorchtitanPlan, parse_torchtitan
from scalify.models.presets import PRESETS
from scalify.placements import Placement, parse_placement

MAX_FILE_BYTES = 1 << 20
REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PLAN_STYLES = ("megatron", "dtensor", "megatron_core", "torchtitan")
# Styles that run a framework's own model, stated in its own names under a key of the style's name.
FRAMEWORK_STYLES = ("megatron_core", "torchtitan")
EXPERT_DISPATCHES = ("all_reduce", "all_to_all")
LOGITS_MODES = ("gathered", "vocab_parallel")
HARDWARE_TARGETS = ("gpu", "neuron")
ENGINE_KINDS = ("auto", "inline", "ray")
FAMILIES = tuple(sorted({preset.family for preset in PRESETS.values()}))
_FUNCTION_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class ModelSpec:
    """A model family plus its full HuggingFace config (preset fields, then the file's, then overrides)."""

    family: str
    preset: str | None
    config: dict


@dataclass(frozen=True)
class PlanSpec:
    """How the model is parallelised; `planted_bug` names a deliberate fault for demos and tests.

    Style "megatron" uses Scalify's Megatron-style rank models; style "dtensor" applies
    `dtensor_plan` to the HuggingFace model with torch's `parallelize_module` (its logits follow
    the plan's lm_head entry, so `logits` is not used). `fused` uses fused qkv/gate_up layouts
    (llama); `shard_fn` ("module.path:function") is a checkpoint sharding function that states
    the parameters' relations. `expert_parallel` shards a MoE model's experts over that many
    ranks (mixtral, megatron style), tokens dispatched by `expert_dispatch`: "all_reduce" (each
    rank's experts on every token, partial outputs summed) or "all_to_all".
    `context_parallel` shards the sequence over that many ranks (llama, megatron style): each
    rank's attention merges the ranks' key blocks by log-sum-exp; `context_load_balance` cuts
    the sequence into twice as many chunks and gives rank r chunks r and 2N-1-r (causal balance).
    Style "megatron_core" runs Megatron-Core's own GPTModel, as `megatron_core` (Megatron's
    field names) states it, against the HuggingFace llama. Style "torchtitan" runs torchtitan's
    Llama 3 parallelised by its own `parallelize`, as `torchtitan` (the names of torchtitan's
    parallelism section) states it, against the same model on one device. `patches`: unified diffs against
    installed packages (a framework's fix to check, or a fault to plant), applied to their
    source while the programs are captured.
    """

    style: str = "megatron"
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    data_parallel: int = 1
    pipeline_parallel: int = 1
    micro_batches: int = 1
    zero_stage: int = 0
    logits: str = "gathered"
    planted_bug: str | None = None
    dtensor_plan: DTensorPlan | None = None
    fused: bool = False
    shard_fn: str | None = None
    expert_parallel: int = 1
    expert_dispatch: str = "all_reduce"
    context_parallel: int = 1
    context_load_balance: bool = False
    megatron_core: MegatronCorePlan | None = None
    torchtitan: TorchtitanPlan | None = None
    patches: tuple[str, ...] = ()


@dataclass(frozen=True)
class HardwareSpec:
    """The devices the plan targets: `devices` of them when given (the plan's world size must
    match), on nodes of `cores_per_node` accelerator cores when given (a tensor-parallel group
    stays in one node: its degree must divide the cores per node)."""

    name: str
    target: str
    devices: int | None = None
    cores_per_node: int | None = None

    def tensor_parallel_degrees(self) -> tuple[int, ...] | None:
        """The TP degrees this hardware allows (None: any)."""
        if self.cores_per_node is None:
            return None
        return tuple(d for d in range(1, self.cores_per_node + 1) if self.cores_per_node % d == 0)


@dataclass(frozen=True)
class HloSpec:
    """HLO programs to verify, in place of a model and a plan: `reference` and `distributed`
    HLO files (paths relative to the repository, the folder holding configs/), or a `jax`
    builder ("module.path:function" returning a JaxProgram, dumped when verified), or a
    `torch_neuronx` one (needs the AWS Neuron SDK). `world_size` devices run the distributed
    program; `outputs` state the first outputs' placements (default: inferred from shapes)."""

    world_size: int
    reference: str | None = None
    distributed: str | None = None
    jax: str | None = None
    torch_neuronx: str | None = None
    outputs: tuple[Placement, ...] | None = None


@dataclass(frozen=True)
class InputSpec:
    """Shape of the token batch fed to the model."""

    batch: int = 1
    seq: int = 16


@dataclass(frozen=True)
class VerifyOptions:
    """Verifier switches: numeric cross-check, proof memoisation (and its persistent SQLite store,
    shared by runs), e-graph window depth; `backward` verifies one training step (the loss and
    every parameter's gradient) instead of the forward logits; `loss` verifies the forward up to
    the loss (no gradients). A window past `window_nodes` e-nodes or `window_seconds` gives no
    answer, and the verdict is "unknown" rather than a guess; past `window_settle_nodes` e-nodes
    a window stops once it relates the op, and a context-parallel window stops searching past
    `window_search_nodes` e-nodes and keeps what it related by then; a window that escalates to
    the inverses of its reshapes grows to four times its e-nodes or `window_escalate_nodes`,
    whichever is more. Past `time_budget_s` seconds from the run's start (capture included),
    the ops not yet proved are left unknown and the run reports what it found."""

    backward: bool = False
    loss: bool = False
    numeric: bool = False
    memo: bool = True
    memo_store: str | None = None
    window_depth: int = 4
    rank_symmetry: bool = True
    window_nodes: int = 5_000_000
    window_seconds: int = 600
    window_search_nodes: int = 300_000
    window_settle_nodes: int = 20_000
    window_escalate_nodes: int = 50_000
    time_budget_s: int | None = None


@dataclass(frozen=True)
class TrackingSpec:
    """Where MLflow runs are recorded, if at all."""

    enabled: bool = False
    uri: str = "sqlite:///mlruns.db"
    experiment: str = "scalify"


@dataclass(frozen=True)
class EngineSpec:
    """Where segments are proved: in this process (inline), on Ray actors (ray), or on Ray when
    RAY_ADDRESS is set and inline otherwise (auto). `address` is the cluster to join (default:
    RAY_ADDRESS, else a local instance); `actors` the number of verification actors;
    `checkpoint` a folder where a Ray job keeps finished segments, to resume after a failure."""

    kind: str = "auto"
    address: str | None = None
    actors: int = 2
    checkpoint: str | None = None


@dataclass(frozen=True)
class Experiment:
    """One validated experiment; `source` is the file it came from or "<dict>"."""

    name: str
    model: ModelSpec | None  # None (and plan None) for HLO experiments
    plan: PlanSpec | None
    hardware: HardwareSpec
    inputs: InputSpec
    verify: VerifyOptions
    tracking: TrackingSpec
    engine: EngineSpec
    source: str
    hlo: HloSpec | None = None

    def world_size(self) -> int:
        """Number of ranks the plan (or the HLO program) runs on."""
        if self.hlo is not None:
            return self.hlo.world_size
        return _plan_world_size(self.plan)

    def to_dict(self) -> dict:
        """Plain nested data, for reports."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Where:
    """Where a value lives: a file and a dotted field path."""

    file: str
    path: str = ""

    def child(self, key: object) -> _Where:
        return _Where(self.file, f"{self.path}.{key}" if self.path else str(key))

    def error(self, problem: str) -> ConfigError:
        prefix = f"{self.file}: {self.path}" if self.path else self.file
        return ConfigError(f"{prefix}: {problem}")


@dataclass(frozen=True)
class _Origin:
    """The experiment being loaded: how to show it and where its references resolve."""

    file: str
    directory: Path
    configs_dirs: tuple[Path, ...]
    default_name: str


Located = dict[Any, tuple[Any, _Where]]
Checker = Callable[[Any, _Where], Any]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` as a float (YAML 1.1 needs `1.0e-5`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = _SHORT_REPR.maxlist = _SHORT_REPR.maxdict = 3
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60


def _show(value: Any) -> str:
    """A short repr, safe for huge or deeply shared values."""
    return _SHORT_REPR.repr(value)


def _display(path: Path) -> str:
    """`path` relative to the working directory when it lies below it, else absolute."""
    absolute = path.resolve()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def _read_yaml(path: Path) -> Any:
    """Parse one YAML file of at most MAX_FILE_BYTES."""
    shown = _display(path)
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{shown}: cannot read file: {err.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{shown}: file is larger than {MAX_FILE_BYTES} bytes")
    try:
        return yaml.load(data.decode("utf-8"), Loader=_Loader)
    except UnicodeDecodeError:
        raise ConfigError(f"{shown}: not UTF-8 text") from None
    except yaml.MarkedYAMLError as err:
        line = err.problem_mark.line + 1 if err.problem_mark else "?"
        raise ConfigError(f"{shown}:{line}: malformed YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{shown}: malformed YAML: {str(err).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{shown}: malformed YAML: nested too deeply") from None


def _located(mapping: Any, where: _Where) -> Located:
    """Pair each value of a mapping with its location."""
    if not isinstance(mapping, dict):
        raise where.error(f"expected a mapping, got {_show(mapping)}")
    return {key: (value, where.child(key)) for key, value in mapping.items()}


def _check_keys(fields: Located, allowed: Any, what: str = "key") -> None:
    """Reject the first key not in `allowed`, listing the allowed ones."""
    for key, (_, where) in fields.items():
        if key not in allowed:
            raise where.error(f"unknown {what} (expected one of: {', '.join(sorted(allowed))})")


def _positive_int(value: Any, where: _Where) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise where.error(f"expected a positive integer, got {_show(value)}")
    return value


def _positive_number(value: Any, where: _Where) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise where.error(f"expected a positive number, got {_show(value)}")
    return float(value)


def _boolean(value: Any, where: _Where) -> bool:
    if not isinstance(value, bool):
        raise where.error(f"expected true or false, got {_show(value)}")
    return value


def _text(value: Any, where: _Where) -> str:
    if not isinstance(value, str) or not value:
        raise where.error(f"expected a non-empty string, got {_show(value)}")
    return value


def _optional_text(value: Any, where: _Where) -> str | None:
    return None if value is None else _text(value, where)


def _function_path(value: Any, where: _Where) -> str:
    if not isinstance(value, str) or not _FUNCTION_PATH.match(value):
        raise where.error(f"expected 'module.path:function', got {_show(value)}")
    return value


def _choice(*options: str) -> Checker:
    """A checker that accepts exactly one of `options`."""

    def check(value: Any, where: _Where) -> str:
        if value not in options:
            raise where.error(f"expected one of: {', '.join(options)}, got {_show(value)}")
        return value

    return check


def _int_choice(*options: int) -> Checker:
    """A checker that accepts exactly one of the integers `options`."""

    def check(value: Any, where: _Where) -> int:
        if isinstance(value, bool) or value not in options:
            raise where.error(f"expected one of: {', '.join(map(str, options))}, got {_show(value)}")
        return value

    return check


def _plan_section(parse: Callable[[Any], Any]) -> Checker:
    """A checker of a mapping `parse` reads, its PlanError located below the field."""

    def check(value: Any, where: _Where) -> Any:
        try:
            return parse(value)
        except PlanError as error:
            for key in error.path:
                where = where.child(key)
            raise where.error(error.problem) from None

    return check


# The plan fields a framework style states in the framework's own names, under its key.
_FRAMEWORK_ELSEWHERE = ("tensor_parallel", "sequence_parallel", "data_parallel",
                            "pipeline_parallel", "expert_parallel", "context_parallel", "fused",
                            "shard_fn", "logits", "planted_bug")


def _check_plan_style(plan: PlanSpec, fields: Located, where: _Where) -> None:
    """The fields a plan needs, or must not have, for its style."""
    for style, example in (("megatron_core", "{tensor_model_parallel_size: 2}"),
                           ("torchtitan", "{tensor_parallel_degree: 2}")):
        if plan.style == style and getattr(plan, style) is None:
            raise where.child(style).error(f"missing required key for style {style} (a mapping of "
                                           f"the framework's own fields, e.g. {example})")
        if plan.style != style and style in fields:
            raise fields[style][1].error(f"only used with style {style}, not {plan.style!r}")
    for key in _FRAMEWORK_ELSEWHERE:
        if plan.style in FRAMEWORK_STYLES and key in fields:
            raise fields[key][1].error(f"not used with style {plan.style}: give the framework's "
                                       f"own fields under plan.{plan.style}")
    if plan.style == "dtensor" and plan.dtensor_plan is None:
        raise where.child("dtensor_plan").error(
            "missing required key for style dtensor ('hf' or a mapping from module glob to style)")
    if plan.style != "dtensor" and "dtensor_plan" in fields:
        raise fields["dtensor_plan"][1].error(f"only used with style dtensor, not {plan.style!r}")
    if plan.style == "dtensor" and "sequence_parallel" in fields:
        raise fields["sequence_parallel"][1].error("not used with style dtensor: give the norms "
                                                   "SequenceParallel styles in the dtensor_plan")
    if plan.style == "dtensor" and "logits" in fields:
        raise fields["logits"][1].error("not used with style dtensor: the dtensor_plan's lm_head "
                                        "entry decides whether logits are gathered")


def _check_expert_parallel(plan: PlanSpec, model: ModelSpec, fields: Located) -> None:
    """Expert parallelism: a megatron-style plan of a MoE model, with no other parallelism."""
    if plan.expert_parallel == 1:
        if "expert_dispatch" in fields:
            raise fields["expert_dispatch"][1].error("only used with expert_parallel > 1")
        return
    at = fields["expert_parallel"][1]
    if model.family != "mixtral":
        raise at.error(f"expert parallelism needs a MoE model (mixtral), not {model.family!r}")
    if plan.style != "megatron":
        raise at.error(f"expert parallelism is built for style megatron, not {plan.style!r}")
    if plan.tensor_parallel > 1 or plan.data_parallel > 1:
        raise at.error("expert parallelism combined with tensor or data parallelism is not "
                       "supported yet: set tensor_parallel and data_parallel to 1")
    experts = model.config["num_local_experts"]
    if experts % plan.expert_parallel:
        raise at.error(f"{experts} experts (num_local_experts) do not split evenly over "
                       f"{plan.expert_parallel} ranks")
def _check_pipeline(plan: PlanSpec, model: ModelSpec, fields: Located, where: _Where) -> None:
    """Pipeline parallelism runs alone (no TP or DP), megatron style, on llama, with at least
    one decoder layer per stage."""
    if plan.pipeline_parallel == 1:
        return
    field = fields["pipeline_parallel"][1]
    if plan.tensor_parallel > 1 or plan.data_parallel > 1 or plan.expert_parallel > 1:
        raise field.error("pipeline parallelism combined with tensor, data or expert parallelism "
                          "is not supported yet: set the other degrees to 1")
    if plan.style != "megatron" or model.family != "llama":
        raise field.error(f"pipeline parallelism exists for megatron-style llama, not "
                          f"{plan.style} {model.family}")
    layers = int(model.config.get("num_hidden_layers", 0))
    if layers < plan.pipeline_parallel:
        raise field.error(f"{plan.pipeline_parallel} stages need at least as many decoder layers "
                          f"(the model has {layers})")


def _check_context(plan: PlanSpec, model: ModelSpec, fields: Located) -> None:
    """Context parallelism runs alone (no TP, DP, PP or EP), megatron style, on llama."""
    if plan.context_parallel == 1:
        if plan.context_load_balance:
            raise fields["context_load_balance"][1].error(
                "load balancing needs context parallelism: set plan.context_parallel > 1")
        return
    field = fields["context_parallel"][1]
    if plan.tensor_parallel * plan.data_parallel * plan.pipeline_parallel * plan.expert_parallel > 1:
        raise field.error("context parallelism combined with tensor, data, pipeline or expert "
                          "parallelism is not supported yet: set the other degrees to 1")
    if plan.style != "megatron" or model.family != "llama":
        raise field.error(f"context parallelism exists for megatron-style llama, not "
                          f"{plan.style} {model.family}")


def _check_devices(hardware: HardwareSpec, world: int, fields: Located, what: str,
                   detail: str = "") -> None:
    """`hardware.devices`, when given, must be the world size (`what` names its source)."""
    if hardware.devices is not None and hardware.devices != world:
        raise fields["devices"][1].error(
            f"{hardware.devices} devices do not match {what}'s world size {world}{detail}")


def framework_plan(plan: PlanSpec) -> MegatronCorePlan | TorchtitanPlan | None:
    """The framework's own plan of a framework style (None for Scalify's own styles)."""
    return getattr(plan, plan.style) if plan.style in FRAMEWORK_STYLES else None


def _plan_world_size(plan: PlanSpec) -> int:
    if framework_plan(plan) is not None:
        return framework_plan(plan).world_size()
    return (plan.tensor_parallel * plan.data_parallel * plan.expert_parallel
            * plan.pipeline_parallel * plan.context_parallel)


def _degrees(plan: PlanSpec) -> str:
    """The plan's parallel degrees, as shown in messages."""
    optional = ("expert_parallel", "pipeline_parallel", "context_parallel")
    names = ("tensor_parallel", "data_parallel",
             *(name for name in optional if getattr(plan, name) > 1))
    return "(" + ", ".join(f"{name}={getattr(plan, name)}" for name in names) + ")"


def _check_tensor_parallel(hardware: HardwareSpec, degree: int, at: _Where) -> None:
    """A TP group stays within one node: its degree must divide the node's cores."""
    allowed = hardware.tensor_parallel_degrees()
    if allowed is not None and degree not in allowed:
        raise at.error(f"TP degree {degree} is not allowed on {hardware.name} (its "
                       f"{hardware.cores_per_node} cores per node allow "
                       f"{', '.join(map(str, allowed))})")


def _repo_file(value: Any, where: _Where, root: Path, what: str) -> str:
    path = root / _text(value, where)
    if not path.is_file():
        raise where.error(f"no such {what} {_display(path)!r} (paths are relative to the "
                          f"repository, {root.resolve()})")
    return str(path.resolve())


def _patch_files(value: Any, where: _Where, root: Path) -> tuple[str, ...]:
    """plan.patches: unified diff files, relative to the repository."""
    if not isinstance(value, list):
        raise where.error(f"expected a list of unified diff files, got {_show(value)}")
    return tuple(_repo_file(item, where.child(i), root, "patch file")
                 for i, item in enumerate(value))


def _output_placements(value: Any, where: _Where) -> tuple[Placement, ...]:
    if not isinstance(value, list) or not value:
        raise where.error(f"expected a list of placements like [Shard(0)], got {_show(value)}")
    placements = []
    for position, text in enumerate(value):
        try:
            placements.append(parse_placement(_text(text, where.child(position))))
        except ValueError as error:
            raise where.child(position).error(str(error)) from None
    return tuple(placements)


def _torch_neuronx(value: Any, where: _Where) -> str:
    """A torch_neuronx builder: refused with the reason (not installed, or not supported yet)."""
    _function_path(value, where)
    if importlib.util.find_spec("torch_neuronx") is None:
        raise where.error("needs the torch_neuronx package (AWS Neuron SDK), which is not "
                          "installed: dump the HLO on a Neuron machine and give hlo.reference "
                          "and hlo.distributed")
    raise where.error("dumping HLO through torch_neuronx is not supported yet: give the dumped "
                      "files as hlo.reference and hlo.distributed")


def _hlo_spec(fields: Located, where: _Where, root: Path) -> HloSpec:
    """The hlo section: one source (both files, or a builder), world_size, optional outputs."""
    _check_keys(fields, [f.name for f in dataclasses.fields(HloSpec)])
    if "world_size" not in fields:
        raise where.child("world_size").error("missing required key")
    files = [key for key in ("reference", "distributed") if key in fields]
    if len(files) == 1:
        other = "distributed" if files == ["reference"] else "reference"
        raise where.child(other).error(f"missing required key (hlo.{files[0]} is given)")
    if bool(files) + ("jax" in fields) + ("torch_neuronx" in fields) != 1:
        raise where.error("give one source: reference and distributed HLO files, a jax builder "
                          "or a torch_neuronx builder")
    checks: dict[str, Checker] = {
        "world_size": _positive_int, "jax": _function_path, "torch_neuronx": _torch_neuronx,
        "outputs": _output_placements, "reference": lambda v, w: _repo_file(v, w, root, "HLO file"),
        "distributed": lambda v, w: _repo_file(v, w, root, "HLO file")}
    return HloSpec(**{key: checks[key](value, at) for key, (value, at) in fields.items()})


_SCHEMAS: dict[type, dict[str, Checker]] = {
    PlanSpec: {
        "style": _choice(*PLAN_STYLES),
        "tensor_parallel": _positive_int,
        "sequence_parallel": _boolean,
        "data_parallel": _positive_int,
        "pipeline_parallel": _positive_int,
        "micro_batches": _positive_int,
        "zero_stage": _int_choice(0, 1, 2),
        "logits": _choice(*LOGITS_MODES),
        "planted_bug": _optional_text,
        "dtensor_plan": _plan_section(parse_plan),
        "fused": _boolean,
        "shard_fn": lambda value, where: None if value is None else _function_path(value, where),
        "expert_parallel": _positive_int,
        "expert_dispatch": _choice(*EXPERT_DISPATCHES),
        "context_parallel": _positive_int,
        "context_load_balance": _boolean,
        "megatron_core": _plan_section(parse_megatron_core),
        "torchtitan": _plan_section(parse_torchtitan),
        "patches": lambda value, where: value,  # (checked with the repository at hand)
    },
    HardwareSpec: {"name": _text, "target": _choice(*HARDWARE_TARGETS), "devices": _positive_int,
                   "cores_per_node": _positive_int},
    InputSpec: {"batch": _positive_int, "seq": _positive_int},
    VerifyOptions: {"backward": _boolean, "loss": _boolean, "numeric": _boolean, "memo": _boolean, "memo_store": _optional_text,
                    "window_depth": _positive_int, "rank_symmetry": _boolean,
                    "window_nodes": _positive_int, "window_seconds": _positive_int,
                    "window_search_nodes": _positive_int, "window_settle_nodes": _positive_int,
                    "window_escalate_nodes": _positive_int,
                    "time_budget_s": lambda value, where: None if value is None else _positive_int(
                        value, where)},
    TrackingSpec: {"enabled": _boolean, "uri": _text, "experiment": _text},
    EngineSpec: {"kind": _choice(*ENGINE_KINDS), "address": _optional_text, "actors": _positive_int,
                 "checkpoint": _optional_text},
}
_HF_CHECKERS: dict[type, Checker] = {bool: _boolean, int: _positive_int, float: _positive_number, str: _text}
_REFERENCE_DIRS = {"model": "models", "plan": "plans", "hardware": "hardware"}
_SECTIONS = ("model", "plan", "hardware", "inputs", "verify", "tracking", "engine")
_TOP_KEYS = ("name", "overrides", "hlo", *_SECTIONS)
_HLO_SOURCES = ("files", "jax", "torch_neuronx")


def _build(cls: type, fields: Located, where: _Where) -> Any:
    """Check `fields` against the schema of `cls` and construct it."""
    schema = _SCHEMAS[cls]
    _check_keys(fields, schema)
    for spec_field in dataclasses.fields(cls):
        if spec_field.name not in fields and spec_field.default is dataclasses.MISSING:
            raise where.child(spec_field.name).error("missing required key")
    return cls(**{key: schema[key](value, at) for key, (value, at) in fields.items()})


def _resolve(entry: Any, where: _Where, origin: _Origin) -> tuple[Any, _Where, Path | None]:
    """The mapping a model/plan/hardware entry names (or is), where it lives, and its file if any."""
    if isinstance(entry, dict):
        return entry, where, None
    section = where.path
    if not isinstance(entry, str) or not entry:
        raise where.error(f"expected a {section} config name, a path or a mapping, got {_show(entry)}")
    if "/" in entry or entry.endswith((".yaml", ".yml")):
        path = origin.directory / entry
        if not path.is_file():
            raise where.error(f"no such file {_display(path)!r}")
    else:
        candidates = [folder / _REFERENCE_DIRS[section] / f"{entry}.yaml" for folder in origin.configs_dirs]
        path = next((candidate for candidate in candidates if candidate.is_file()), None)
        if path is None:
            looked = ", ".join(f"{_display(candidate.parent)}/" for candidate in candidates)
            raise where.error(f"no {section} config named {entry!r} (looked in {looked})")
    return _read_yaml(path), _Where(_display(path), section), path


def _overrides(fields: Located) -> dict[str, Located]:
    """Split `section.field` override keys by section."""
    by_section: dict[str, Located] = {section: {} for section in _SECTIONS}
    for key, (value, where) in fields.items():
        section, _, name = str(key).partition(".")
        if section not in by_section or not name:
            raise where.error(f"expected a key 'section.field' with section one of: {', '.join(_SECTIONS)}")
        by_section[section][name] = (value, where)
    return by_section


def _model_spec(fields: Located, where: _Where, hf_overrides: Located) -> ModelSpec:
    """Family, preset and merged HuggingFace config of the model section."""
    _check_keys(fields, ("config", "family", "preset"))
    preset = _choice(*PRESETS)(*fields["preset"]) if "preset" in fields else None
    if "family" in fields:
        family = _choice(*FAMILIES)(*fields["family"])
    elif preset is not None:
        family = PRESETS[preset].family
    else:
        raise where.child("family").error("missing required key (needed when no preset is given)")
    if preset is not None and family != PRESETS[preset].family:
        raise fields["family"][1].error(f"preset {preset!r} is a {PRESETS[preset].family!r} model, not {family!r}")
    base = PRESETS[preset].config if preset is not None else {}
    template = base or next(p.config for p in PRESETS.values() if p.family == family)
    hf_fields = _located(*fields["config"]) if "config" in fields else {}
    hf_fields |= hf_overrides
    _check_keys(hf_fields, template, what=f"{family} config field")
    config = dict(base)
    for key, (value, at) in hf_fields.items():
        config[key] = _HF_CHECKERS[type(template[key])](value, at)
    return ModelSpec(family, preset, config)


def _origin(source: str | os.PathLike) -> _Origin:
    """Names resolve in the configs/ dir holding the file's folder, then in the repository's."""
    path = Path(source)
    configs_dirs = tuple(dict.fromkeys((path.parent.parent.resolve(), REPO_CONFIGS)))
    return _Origin(_display(path), path.parent, configs_dirs, path.stem)


def load_experiment(source: str | os.PathLike | dict) -> Experiment:
    """Load and validate an experiment from a YAML file, or from a dict of the same shape."""
    if isinstance(source, dict):
        data, origin = source, _Origin("<dict>", Path.cwd(), (REPO_CONFIGS,), "experiment")
    else:
        data, origin = _read_yaml(Path(source)), _origin(source)
    top_where = _Where(origin.file)
    top = _located(data, top_where)
    _check_keys(top, _TOP_KEYS)
    is_hlo = "hlo" in top
    for section in _REFERENCE_DIRS:
        if is_hlo and section in ("model", "plan") and section in top:
            raise top[section][1].error("not used with hlo: the HLO programs stand for the model "
                                        "and its plan")
        if section not in top and not (is_hlo and section != "hardware"):
            raise top_where.child(section).error("missing required key")
    overrides = _overrides(_located(*top.get("overrides", ({}, top_where.child("overrides")))))

    sections: dict[str, tuple[Located, _Where]] = {}
    for section in _SECTIONS:
        if is_hlo and section in ("model", "plan"):
            continue
        entry, where = top.get(section, ({}, top_where.child(section)))
        path = None
        if section in _REFERENCE_DIRS:
            entry, where, path = _resolve(entry, where, origin)
        fields = _located(entry, where)
        if section == "hardware" and path is not None:
            fields.setdefault("name", (path.stem, where.child("name")))
        if section != "model":
            fields |= overrides[section]
        sections[section] = fields, where

    hardware = _build(HardwareSpec, *sections["hardware"])
    common = dict(
        name=_text(*top["name"]) if "name" in top else origin.default_name,
        hardware=hardware,
        inputs=_build(InputSpec, *sections["inputs"]),
        verify=_build(VerifyOptions, *sections["verify"]),
        tracking=_build(TrackingSpec, *sections["tracking"]),
        engine=_build(EngineSpec, *sections["engine"]),
        source=origin.file)
    if is_hlo:
        hlo_fields = _located(*top["hlo"])
        hlo = _hlo_spec(hlo_fields, top["hlo"][1], origin.configs_dirs[0].parent)
        _check_devices(hardware, hlo.world_size, sections["hardware"][0], "the HLO program")
        _check_tensor_parallel(hardware, hlo.world_size, hlo_fields["world_size"][1])
        verify_fields, verify_where = sections["verify"]
        for key in ("backward", "loss"):
            if getattr(common["verify"], key):
                where = verify_fields[key][1] if key in verify_fields else verify_where.child(key)
                raise where.error("not supported with hlo: HLO programs are verified as dumped "
                                  "(their outputs)")
        return Experiment(model=None, plan=None, hlo=hlo, **common)
    model = _model_spec(*sections["model"], overrides["model"])
    plan_fields, plan_where = sections["plan"]
    patches = plan_fields.pop("patches", None)  # (files relative to the repository)
    plan = _build(PlanSpec, plan_fields, plan_where)
    if patches is not None:
        plan = dataclasses.replace(plan, patches=_patch_files(
            *patches, origin.configs_dirs[0].parent))
    _check_plan_style(plan, *sections["plan"])
    world = _plan_world_size(plan)
    if plan.style in FRAMEWORK_STYLES and model.family != "llama":
        raise sections["plan"][0]["style"][1].error(
            f"style {plan.style} builds the framework's Llama from a llama config, not "
            f"{model.family!r}")
    _check_expert_parallel(plan, model, sections["plan"][0])
    _check_pipeline(plan, model, *sections["plan"])
    _check_context(plan, model, sections["plan"][0])
    if plan.tensor_parallel > 1 and plan.data_parallel > 1:
        raise sections["plan"][0]["data_parallel"][1].error(
            "data parallelism combined with tensor parallelism (a 2-D mesh) is not supported yet: "
            "set tensor_parallel or data_parallel to 1")
    if plan.fused and model.family != "llama":
        raise sections["plan"][0]["fused"][1].error(
            f"fused layouts exist for llama, not {model.family!r}")
    _check_devices(hardware, world, sections["hardware"][0], "the plan", f" {_degrees(plan)}")
    if plan.megatron_core is not None:
        degree = plan.megatron_core.tensor_model_parallel_size
        degree_at = plan_where.child("megatron_core").child("tensor_model_parallel_size")
    elif plan.torchtitan is not None:
        degree = plan.torchtitan.tensor_parallel_degree
        degree_at = plan_where.child("torchtitan").child("tensor_parallel_degree")
    else:
        degree = plan.tensor_parallel
        degree_at = plan_fields.get("tensor_parallel", (None, plan_where.child("tensor_parallel")))[1]
    _check_tensor_parallel(hardware, degree, degree_at)
    return Experiment(model=model, plan=plan, **common)
