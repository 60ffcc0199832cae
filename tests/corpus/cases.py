"""Loads corpus cases: one Python file per case under tests/corpus/<style>/."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).parent
STYLES = ("megatron_lm", "megatron_core", "torchtitan", "vllm", "deepspeed", "fairscale",
          "nanotron", "torch_distributed", "dtensor")
BUG_MARK = "# BUG"
INPUT_SEED = 1235  # the seed a case's example inputs are drawn with


@dataclass(frozen=True)
class Case:
    """A loaded case file and what it states."""

    path: Path
    module: ModuleType

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.stem}"

    @property
    def style(self) -> str:
        return self.module.STYLE

    @property
    def step(self) -> str:
        return self.module.STEP

    @property
    def world_size(self) -> int:
        return self.module.WORLD_SIZE

    @property
    def buggy(self) -> bool:
        return self.module.BUG is not None

    def bug_line(self) -> int | None:
        """The line that ends with `# BUG`, for a buggy case."""
        for number, text in enumerate(self.path.read_text().splitlines(), 1):
            if text.rstrip().endswith(BUG_MARK):
                return number
        return None

    def attr(self, name: str, default: Any = None) -> Any:
        return getattr(self.module, name, default)

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The case's inputs as the gloo check draws them (the same every time)."""
        torch.manual_seed(INPUT_SEED)
        return self.module.inputs()

    def example_ranges(self) -> dict[str, tuple[int, int]]:
        """Each integer input's range in the example the gloo check runs: what the harness lets
        Scalify assume of that input."""
        return {name: (int(value.min()), int(value.max()))
                for name, value in self.example_inputs().items()
                if not value.is_floating_point() and value.dtype != torch.bool and value.numel()}

    def local_state(self, state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s state dict from the reference's: the case's `shard`, or its
        `PARAM_PLACEMENTS` (chunks of sharded tensors, the rest whole)."""
        shard = self.attr("shard")
        if shard is not None:
            return shard(state, rank, self.world_size)
        return {name: local_part(tensor, self.attr("PARAM_PLACEMENTS", {}).get(name), rank,
                                 self.world_size) for name, tensor in state.items()}


def local_part(tensor: torch.Tensor, placement: Any, rank: int, world_size: int) -> torch.Tensor:
    """A rank's part of `tensor` under a Replicate or Shard placement (None: Replicate)."""
    dim = getattr(placement, "dim", None)
    if dim is None:
        return tensor.clone()
    return torch.chunk(tensor, world_size, dim)[rank].clone()


def load(path: Path) -> Case:
    spec = importlib.util.spec_from_file_location(f"corpus_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Case(path, module)


def case_paths(selected: list[str] | None = None) -> list[Path]:
    """Every case file (or those whose `style/name` contains one of `selected`, or that one
    names as a path); a selection that matches no case is an error, not an empty run."""
    paths = sorted(p for style in STYLES for p in (ROOT / style).glob("*.py")
                   if not p.name.startswith("_"))
    if not selected:
        return paths
    matches = lambda p, s: s in f"{p.parent.name}/{p.stem}" or Path(s).resolve() == p.resolve()
    unmatched = [s for s in selected if not any(matches(p, s) for p in paths)]
    if unmatched:
        raise SystemExit(f"no corpus case matches {', '.join(unmatched)}")
    return [p for p in paths if any(matches(p, s) for s in selected)]
