"""Dumps a JAX program's HLO: the single-device reference and the per-device SPMD program.

XLA reads its flags (host device count, dump folder) once, when JAX first initialises, so the
dump runs in a child process (`write_dumps`) and never disturbs the caller's JAX or torch. A
builder is `module.path:function`, a function of no arguments returning a `JaxProgram`
(scalify/jax_models/llama.py). For each builder the child writes:

- `reference.hlo`: `jit(reference)` lowered on one device, with its stack-frame tables;
- `distributed.hlo`: `jit(distributed)` with the program's shardings, after XLA's SPMD
  partitioner (one program every device runs, its collectives explicit);
- `placements.json`: each input's and the output's placement, read from the shardings.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import CaptureError
from ..placements import Placement, Replicate, Shard

HOST_DEVICES = 8
PARTITIONED = "after_spmd-partitioning"
_CHILD = ("import sys, pathlib; from scalify.capture.jax_dump import write_dumps; "
          "write_dumps(pathlib.Path(sys.argv[1]), sys.argv[2:])")


@dataclass(frozen=True)
class JaxDump:
    """The files a dump wrote, the number of devices and the placements the shardings state."""

    reference: Path
    distributed: Path
    world_size: int
    inputs: list[Placement]
    outputs: list[Placement]


def placement_json(indices: list[tuple[slice, ...]], shape: tuple[int, ...]) -> dict:
    """A sharding as {"dim", "chunks"}: the one dim the devices' index slices cut (None when
    none is cut) and the chunk each device, in partition order, holds along it."""
    cut = sorted({d for index in indices for d, s in enumerate(index)
                  if (s.start or 0, shape[d] if s.stop is None else s.stop) != (0, shape[d])})
    if len(cut) > 1:
        raise CaptureError(f"a sharding over several dims {cut} has no placement yet")
    if not cut:
        return {"dim": None, "chunks": []}
    dim = cut[0]
    size = (indices[0][dim].stop or shape[dim]) - (indices[0][dim].start or 0)
    return {"dim": dim, "chunks": [(index[dim].start or 0) // size for index in indices]}


def placement_of(entry: dict, where: str) -> Placement:
    """The placement `placement_json` describes, declared at `where`."""
    if entry["dim"] is None:
        return Replicate(declared_at=where)
    chunks = tuple(entry["chunks"])
    by_rank = chunks != tuple(range(len(chunks)))  # else the default: rank r holds chunk r
    return Shard(entry["dim"], chunk_of_rank=chunks if by_rank else None, declared_at=where)


def dump_jax(builders: list[str], out: str | os.PathLike) -> list[JaxDump]:
    """Run the builders in one child process (JAX starts once) and read back what each dumped
    into its folder `out/<position>`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this scalify
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"--xla_force_host_platform_device_count={HOST_DEVICES} --xla_dump_to={out / 'xla'} "
        "--xla_dump_hlo_pass_re=spmd-partitioning"),
        PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(out), *builders], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise CaptureError(f"dumping the HLO of {', '.join(builders)} failed:\n"
                           f"{done.stderr.strip()[-2000:]}")
    return [_read_dump(builder, out / str(position)) for position, builder in enumerate(builders)]


def _read_dump(builder: str, folder: Path) -> JaxDump:
    stated = json.loads((folder / "placements.json").read_text())
    where = stated["specs_at"] or f"the shardings of {builder}"
    return JaxDump(folder / "reference.hlo", folder / "distributed.hlo", stated["world_size"],
                   [placement_of(entry, where) for entry in stated["inputs"]],
                   [placement_of(entry, where) for entry in stated["outputs"]])


def _function(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _write_dump(builder: str, out: Path, xla_dumps: Path) -> None:
    """The child's work for one builder (JAX is imported here, after the parent set XLA_FLAGS)."""
    import jax
    from jax.sharding import NamedSharding

    out.mkdir()
    program = _function(builder)()
    mesh = program.mesh
    lowered = jax.jit(program.reference).lower(*program.inputs)
    (out / "reference.hlo").write_text(lowered.as_text(dialect="hlo", debug_info=True))
    in_shardings = tuple(NamedSharding(mesh, spec) for spec in program.in_specs)
    out_sharding = NamedSharding(mesh, program.out_specs)
    before = set(xla_dumps.glob(f"*{PARTITIONED}*.txt"))
    jax.jit(program.distributed, in_shardings=in_shardings,
            out_shardings=out_sharding).lower(*program.inputs).compile()
    dumped = sorted(set(xla_dumps.glob(f"*{PARTITIONED}*.txt")) - before)
    if not dumped:
        raise CaptureError(f"XLA wrote no {PARTITIONED} dump for {builder}")
    (out / "distributed.hlo").write_text(dumped[-1].read_text())
    devices = list(mesh.devices.flat)

    def stated(sharding: NamedSharding, shape: tuple[int, ...]) -> dict:
        by_device = sharding.devices_indices_map(shape)
        return placement_json([by_device[device] for device in devices], shape)

    output_shape = jax.eval_shape(program.reference, *program.inputs).shape
    (out / "placements.json").write_text(json.dumps({
        "world_size": len(devices), "specs_at": program.specs_at,
        "inputs": [stated(s, x.shape) for s, x in zip(in_shardings, program.inputs)],
        "outputs": [stated(out_sharding, output_shape)]}))


def write_dumps(folder: Path, builders: list[str]) -> None:
    """The child's entry point: each builder's dump into `folder/<position>`."""
    for position, name in enumerate(builders):
        _write_dump(name, folder / str(position), folder / "xla")
