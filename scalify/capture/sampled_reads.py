"""Values a program reads from its data, sampled on real numbers so that capture can go on.

An MoE layer routes tokens by their values: it reads token counts into Python (`.tolist()`
for the split sizes of an all_to_all), selects tokens with boolean masks, counts them with
`bincount`. The captured graph cannot hold such a read as a variable, and on meta tensors the
value does not exist. `sample_reads` runs the reference and every rank once on real numbers
(the ranks in forked processes over a gloo process group, their weights cut from the
reference's by the stated placements), and logs, by the user line that made them, every read
into Python and the outputs of the ops whose output shape depends on their input's values. A
capture given a program's log then replays them: the graph holds the sampled values as
literals, so what it proves holds for inputs that the programs route as the sample did, and
not beyond (the verdict says so; see `api.verify_modules`).
"""
from __future__ import annotations

import copy
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..errors import CaptureError
from .as_gpu import cuda_patched, on_device

Line = tuple[str, int]

# Ops whose output shape depends on their input's values (logged and replayed whole).
DATA_SHAPED = frozenset({"nonzero", "bincount", "_unique2", "unique_dim", "unique_consecutive",
                         "repeat_interleave", "masked_select"})
# Ops that take boolean masks among their indices (a mask is logged as its nonzero positions).
MASK_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
PYTHON_READS = (torch.Tensor.tolist, torch.Tensor.numpy)
SAMPLE_SEED = 0


def user_line() -> Line | None:
    """The innermost frame outside torch and Scalify's capture code."""
    from .tracer import _outside_user_code
    frame = sys._getframe(1)
    while frame is not None and _outside_user_code(frame.f_code.co_filename):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


@dataclass
class ReadLog:
    """One program's sampled reads, in order, by the user line that made them and their kind
    (`scalar`, `list`, `mask`, or the name of a data-shaped op)."""

    entries: dict[tuple[Line, str], list[Any]] = field(default_factory=dict)
    replayed: list[str] = field(default_factory=list)  # "file:line" of reads of the data

    def add(self, line: Line | None, kind: str, value: Any) -> None:
        self.entries.setdefault((line or ("", 0), kind), []).append(value)

    def take(self, line: Line | None, kind: str) -> Any:
        """The next value of `kind` read at `line`; a program that reads where the sample did
        not has taken another path than the sampled run."""
        queue = self.entries.get((line or ("", 0), kind))
        if not queue:
            raise CaptureError(f"{_where(line)}: a read ({kind}) the sampled run on real numbers "
                               "did not make at this line; the program took another path when "
                               "captured")
        return queue.pop(0)

    def note(self, line: Line | None) -> None:
        """The value taken at `line` came from the data: what is proved holds for it only."""
        if _where(line) not in self.replayed:
            self.replayed.append(_where(line))


def _where(line: Line | None) -> str:
    return f"{line[0]}:{line[1]}" if line else "the model"


def mask_positions(indices: Any) -> Any:
    """Boolean masks among `indices` as the long positions they select (a mask over k dims
    becomes k index tensors, as indexing reads it)."""
    if not isinstance(indices, (list, tuple)):
        return indices
    out: list[Any] = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            out.extend(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


def has_mask(args: tuple) -> bool:
    return len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


def _detached(value: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


class _LogReads(TorchDispatchMode):
    """Logs `.item()`-like reads and the values behind data-shaped ops, running them as usual."""

    def __init__(self, log: ReadLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in MASK_INDEXED and has_mask(args):
            self.log.add(user_line(), "mask", _detached(mask_positions(args[1])))
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.log.add(user_line(), "scalar", out)
        elif name in DATA_SHAPED:
            self.log.add(user_line(), name, _detached(out))
        return out


class _LogPythonReads(TorchFunctionMode):
    """Logs `.tolist()` and `.numpy()` (which read values without dispatching an op)."""

    def __init__(self, log: ReadLog) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in PYTHON_READS:
            self.log.add(user_line(), "list", out.tolist() if func is torch.Tensor.numpy else out)
        return out


@dataclass
class Sample:
    """The sampled run: every program's log and the reference placeholders' values (float64)."""

    reference: ReadLog
    ranks: list[ReadLog]
    values: dict[str, torch.Tensor]


def logged_reads(call: Callable[[], Any], grad: bool = False) -> ReadLog:
    """What `call()` reads of its data, run on real numbers."""
    log = ReadLog()
    with torch.set_grad_enabled(grad), on_device(torch.device("cpu")), _LogReads(log), \
            _LogPythonReads(log):
        call()
    return log


def _real(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`tensor` as float64 numbers (drawn N(0, 0.5) when it is meta); integer tensors as they
    are, which must be real."""
    if tensor.is_floating_point():
        if tensor.is_meta:
            return torch.randn(tensor.shape, generator=generator, dtype=torch.float64) * 0.5
        return tensor.detach().to("cpu", torch.float64)
    if tensor.is_meta:
        raise CaptureError("a data-dependent read is sampled on real numbers, but an integer "
                           f"tensor of shape {tuple(tensor.shape)} is meta: pass real values")
    return tensor.detach().cpu()


def _as_real(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    """`module` holding float64 numbers (meta ones drawn), changed in place."""
    for owner in module.modules():
        for store in (owner._parameters, owner._buffers):
            for name, value in store.items():
                if value is None:
                    continue
                real = _real(value, generator)
                store[name] = (torch.nn.Parameter(real, value.requires_grad)
                               if isinstance(value, torch.nn.Parameter) else real)
    return module


def _loaded(module: torch.nn.Module, values: Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]],
            generator: torch.Generator) -> torch.nn.Module:
    """`module` in float64 holding the values given for its parameters and buffers by name
    (its own, as float64, for those with none)."""
    module = _as_real(module, generator)
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    given = values({name: tuple(t.shape) for name, t in named.items()})
    with torch.no_grad():
        for name, value in given.items():
            if name in named and named[name].shape == value.shape:
                named[name].copy_(value.to(named[name].dtype))
    return module


def sample_reads(reference: torch.nn.Module, factory: Callable[[int], torch.nn.Module],
                 world_size: int, inputs: dict[str, torch.Tensor],
                 local_inputs: Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]],
                 rank_values: Callable[[dict[str, torch.Tensor], int, dict[str, tuple[int, ...]]],
                                       dict[str, torch.Tensor]],
                 call: Callable[[torch.nn.Module, dict[str, torch.Tensor]], Any],
                 grad: bool = False) -> Sample:
    """Run the reference and the `world_size` rank modules once on real numbers (seeded; the
    given inputs, float64) and log their reads. `local_inputs(inputs, rank)` cuts a rank's
    inputs; `rank_values(reference_values, rank, shapes)` its parameters and buffers."""
    generator = torch.Generator().manual_seed(SAMPLE_SEED)
    real_inputs = {name: _real(t, generator) for name, t in inputs.items()}
    with cuda_patched():
        ref = _as_real(copy.deepcopy(reference), generator)
        values = dict(ref.named_parameters()) | dict(ref.named_buffers()) | real_inputs
        values = {name: t.detach() for name, t in values.items()}
        reference_log = logged_reads(lambda: call(ref, real_inputs), grad)
        logs = _rankslogged_reads(factory, world_size, lambda module, rank: call(
            _loaded(module, lambda shapes: rank_values(values, rank, shapes), generator),
            local_inputs(real_inputs, rank)), grad)
    return Sample(reference_log, logs, values)


def _rankslogged_reads(factory: Callable[[int], torch.nn.Module], world_size: int,
                  run: Callable[[torch.nn.Module, int], Any], grad: bool) -> list[ReadLog]:
    """Every rank built and run in a forked process of its own, over a gloo process group."""
    from .ranks import fork_work, receive_work
    if dist.is_initialized():
        raise CaptureError("a torch.distributed process group is already initialized in this "
                           "process; Scalify samples ranks in process groups of its own")
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")

        def rank_log(rank: int) -> bytes:  # (pickled here: a pipe would share tensors' memory)
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world_size)
            try:
                with on_device(torch.device("cpu")):
                    module = factory(rank)
                return pickle.dumps(logged_reads(lambda: run(module, rank), grad))
            except CaptureError:
                raise
            except Exception as error:  # reported with its rank and line
                raise CaptureError(f"rank {rank} failed in the sampled run on real numbers: "
                                   f"{_failure(error)}") from None
            finally:
                dist.destroy_process_group()

        children = [fork_work(rank_log, rank) for rank in range(world_size)]
        sent = [receive_work(process, connection, f"sampling rank {rank}'s reads")
                for rank, (process, connection) in enumerate(children)]
    for log in sent:
        if isinstance(log, BaseException):
            raise log
    return [pickle.loads(log) for log in sent]


def _failure(error: BaseException) -> str:
    """The error's first line and the innermost user line it passed."""
    from .tracer import _outside_user_code
    line, trace = "", error.__traceback__
    while trace is not None:
        if not _outside_user_code(trace.tb_frame.f_code.co_filename):
            line = f" at {trace.tb_frame.f_code.co_filename}:{trace.tb_lineno}"
        trace = trace.tb_next
    return f"{(str(error).splitlines() or [type(error).__name__])[0]}{line}"
