"""The corpus's numeric check on real gloo processes: a correct case's ranks give the reference's
numbers, a buggy case's do not.

    python -m tests.corpus.gloo_check [CASE ...]     # exit 1 when a case is not what it says

Each case runs on WORLD_SIZE forked processes in a gloo process group: the reference (seeded
weights, perturbed so no parameter is trivial) on its whole inputs, each rank on its module
with its part of the weights and inputs; rank outputs are assembled by OUTPUT_PLACEMENTS and
compared with the reference's in float64.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cases import Case, case_paths, load, local_part

TOLERANCE = 1e-6
SEED = 1234


@dataclass(frozen=True)
class Checked:
    """One case's numbers: the largest relative error over its outputs, or why it did not run."""

    name: str
    buggy: bool
    error: float | None
    failure: str = ""

    @property
    def agrees(self) -> bool:
        return self.error is not None and self.error <= TOLERANCE

    @property
    def as_stated(self) -> bool:
        """Correct cases agree with the reference; buggy ones differ."""
        return self.error is not None and self.agrees != self.buggy


def _reference(case: Case) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(SEED)
    model = case.module.reference()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model, case.example_inputs()


def _outputs(value: object) -> list[torch.Tensor]:
    """The output tensors, waited for (a functional collective's result may still be in flight)."""
    tensors = value if isinstance(value, (tuple, list)) else [value]
    return [(t.wait() if hasattr(t, "wait") else t).detach() for t in tensors]


def _assemble(parts: list[torch.Tensor], placement: object) -> torch.Tensor:
    """The reference-shaped tensor the ranks' `parts` stand for under `placement`."""
    kind = type(placement).__name__
    if kind == "Shard":
        return torch.cat(parts, placement.dim)
    if kind == "Partial":
        return torch.stack(parts).sum(0)
    return parts[0]


def _relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    if found.shape != expected.shape:
        return float("inf")
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    return (found.double() - expected.double()).abs().max().item() / max(scale, 1e-12) \
        if expected.numel() else 0.0


def _worker(rank: int, path: str, address: str, results: str) -> None:
    torch.set_default_dtype(torch.float64)
    case = load(Path(path))
    world = case.world_size
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        reference, inputs = _reference(case)
        expected = _outputs(reference(**inputs))
        state = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
        local = case.local_state({k: v.detach() for k, v in state.items()}, rank)
        module = case.module.rank_module(rank, world)
        module.load_state_dict(local, strict=False)
        placements = case.attr("INPUT_PLACEMENTS", {})
        local_inputs = {k: local_part(v, placements.get(k), rank, world) for k, v in inputs.items()}
        found = _outputs(module(**local_inputs))
        gathered: list = [None] * world
        dist.all_gather_object(gathered, found)
        if rank == 0:
            if len(found) != len(expected):
                raise ValueError(f"{len(found)} rank outputs for {len(expected)} reference outputs")
            errors = [_relative_error(_assemble([g[k] for g in gathered], placement), expected[k])
                      for k, placement in enumerate(case.module.OUTPUT_PLACEMENTS)]
            Path(results).write_text(repr(max(errors)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check(path: Path) -> Checked:
    """Run one case on gloo processes."""
    case = load(path)
    with tempfile.TemporaryDirectory() as folder:
        results = os.path.join(folder, "error")
        try:
            mp.start_processes(_worker, args=(str(path), f"tcp://127.0.0.1:{_free_port()}", results),
                               nprocs=case.world_size, start_method="fork")
            return Checked(case.name, case.buggy, float(Path(results).read_text()))
        except Exception as failure:  # a case that does not run is reported, not raised
            lines = str(failure).strip().splitlines() or [traceback.format_exc()]
            return Checked(case.name, case.buggy, None, lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="cases (style/name or part of it); default all")
    args = parser.parse_args(argv)
    wrong = 0
    for path in case_paths(args.cases):
        checked = check(path)
        wrong += not checked.as_stated
        numbers = (f"max relative error {checked.error:.2e}" if checked.error is not None
                   else f"did not run: {checked.failure}")
        state = "ok" if checked.as_stated else "WRONG"
        print(f"{state:5} {'bug    ' if checked.buggy else 'correct'} {checked.name}: {numbers}",
              flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
