"""A dispatch-level tracer: records every aten op a module runs on meta tensors into the core IR.

Each op gets a cheap source location (the innermost frame outside torch and this package, and
the module path from forward hooks). Functional collectives are recorded with their group
resolved to global ranks, so rank graphs can be merged later. Ops on DTensors are left to
DTensor, and its local ops are recorded (see dtensor.py): a rank's graph is its local program.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed._functional_collectives as funcol
import numpy
import typing_extensions
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                          _get_current_dispatch_mode)
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import CaptureError, DataDependentRead, ScalifyError
from ..ir.graph import Graph, SourceLoc
from ..ir.ops import COLLECTIVE, OPS, POINT_TO_POINT, RANDOM
from . import c10d, complex_pairs
from .aten import LOWERINGS, lower, lowering_name, opaque
from .as_gpu import as_gpu, capture_device
from .builder import GraphBuilder, Ref
from .decompose import decomposition_of
from .movement import canonical_movement
from .passed_on import PassedOn
from .sampled_reads import DATA_SHAPED, ReadLog, has_mask, mask_positions, user_line
from .value_sources import value_sources
from .dtensor import dtensor_layout, has_dtensor, local_tensor, sharding_propagation_unrecorded

# (with the separator: `torchtitan` and `torchvision` sit beside `torch` and are user code)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CAPTURE_DIR = os.path.dirname(__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))
# The package's own subjects (parallel models verified like a user's): user code to the tracer.
_SUBJECT_DIRS = tuple(os.path.join(_PACKAGE_DIR, name) + os.sep
                      for name in ("parallel", "models", "jax_models"))
# Decorators' wrappers (`typing_extensions.deprecated` wraps torch.distributed's old names):
# their frames stand for the line that called them.
_WRAPPERS = frozenset(module.__file__ for module in (contextlib, functools, typing_extensions))
LITERAL_ELEMENTS = 4096  # a constant the program reads is written into it up to this size
_POINT_TO_POINT = ("send", "recv_")  # lowered in aten.py; every other c10d op is a collective
_VARYING = (RANDOM, COLLECTIVE, POINT_TO_POINT)  # op traits whose values no program text fixes
_COLLECTIVE_GROUP_ARG = {"all_reduce": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
                         "all_to_all_single": 3}


class SourceTracker:
    """Knows the module path being executed and finds the user frame of the current op."""

    def __init__(self, module_names: dict[int, str],
                 plan_lines: dict[str, tuple[str, ...]] | None = None) -> None:
        self._module_names = module_names
        self._plan_lines = plan_lines or {}  # by module name: the plan entries that shard it
        self.stack: list[str] = []
        self._lines: dict[tuple[Any, int], tuple[str, int, str, tuple[str, ...]]] = {}
        self._forward: dict[int, SourceLoc] = {}  # autograd sequence number -> forward location
        self._last_backward = SourceLoc(backward=True)

    def enter(self, module: torch.nn.Module, *_: Any) -> None:
        self.stack.append(self._module_names.get(id(module), self.stack[-1] if self.stack else ""))

    def leave(self, module: torch.nn.Module, *_: Any) -> None:
        if self.stack:
            self.stack.pop()

    def current(self) -> SourceLoc:
        """Where the op being dispatched comes from. A backward op is charged to the forward op
        whose autograd node runs it (a custom `autograd.Function` backward: its own line, in
        the forward's module)."""
        node = torch._C._current_autograd_node()
        if node is None:
            loc, in_engine = self._user_frame()
            if in_engine:  # the engine summing two gradients of one tensor: the last node's place
                return self._last_backward
            if torch.is_grad_enabled():  # the node this op creates (if any) has the last number
                self._forward.setdefault(torch.autograd._get_sequence_nr() - 1, loc)
            return loc
        forward = self._forward_of(node._sequence_nr())
        if hasattr(node, "_forward_cls"):  # a custom Function: its backward's own line
            own, engine_only = self._user_frame()
            forward = forward if engine_only else dataclasses.replace(own, module=forward.module)
        self._last_backward = dataclasses.replace(forward, backward=True)
        return self._last_backward

    def _forward_of(self, sequence_nr: int) -> SourceLoc:
        """The location recorded for autograd node `sequence_nr` (or the nearest earlier one:
        an identity forward dispatches nothing)."""
        while sequence_nr >= 0 and sequence_nr not in self._forward:
            sequence_nr -= 1
        return self._forward.get(sequence_nr, SourceLoc())

    def _user_frame(self) -> tuple[SourceLoc, bool]:
        """The innermost frame outside torch and this package, and whether the autograd engine
        runs between it and the op (so no user code of the backward pass is on the stack)."""
        frame, in_engine = sys._getframe(3), False
        while frame is not None:
            if not _outside_user_code(frame.f_code.co_filename):
                break
            in_engine = in_engine or frame.f_code.co_name == "_engine_run_backward"
            frame = frame.f_back
        module = self.stack[-1] if self.stack else ""
        if frame is None:
            return SourceLoc(module=module), in_engine
        key = (frame.f_code, frame.f_lineno)
        if key not in self._lines:
            filename = frame.f_code.co_filename
            self._lines[key] = (filename, frame.f_lineno,
                                linecache.getline(filename, frame.f_lineno).strip(),
                                () if _scalify_own(filename) else value_sources(frame))
        filename, line, code, values_from = self._lines[key]
        planned = self._plan_lines.get(module, ())
        return SourceLoc(filename, line, code, module, _callers(frame.f_back),
                         values_from=tuple(dict.fromkeys((*values_from, *planned)))), in_engine

    def failure(self, error: BaseException) -> str:
        """The module being run and the innermost user line of `error`'s traceback."""
        line = ""
        trace = error.__traceback__
        while trace is not None:
            filename = trace.tb_frame.f_code.co_filename
            if not _outside_user_code(filename):
                line = f" at {filename}:{trace.tb_lineno}"
            trace = trace.tb_next
        return f"{self.stack[-1] if self.stack else 'the model'}{line}"


def _outside_user_code(filename: str) -> bool:
    """Torch's, this package's, generated code, or a decorator's wrapper."""
    return (filename.startswith(_TORCH_DIR) or filename.startswith(_CAPTURE_DIR)
            or filename.startswith("<") or filename in _WRAPPERS)


def _scalify_own(filename: str) -> bool:
    """Scalify's own code outside capture (its API, its training-step helpers): the line an op
    is charged to may be there, but no user value or caller is (its subjects are user code)."""
    return filename.startswith(_PACKAGE_DIR + os.sep) and not filename.startswith(_SUBJECT_DIRS)


def _callers(frame: Any, count: int = 3) -> tuple[str, ...]:
    """`file:line` of the next few user frames outward (helpers hide their call sites), up to
    the call from Scalify that ran the program."""
    found: list[str] = []
    while frame is not None and len(found) < count:
        filename = frame.f_code.co_filename
        if _scalify_own(filename):
            break
        if not (filename.startswith(_TORCH_DIR) or filename.startswith("<")
                or filename in _WRAPPERS):
            found.append(f"{filename}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(found)


class _Recorder(TorchDispatchMode):
    """Lowers each dispatched op into the builder and remembers which node holds each tensor."""

    def __init__(self, builder: GraphBuilder, sources: SourceTracker,
                 group_ranks: Callable[[str], tuple[int, ...]],
                 group_origins: Callable[[tuple[int, ...]], tuple[str, ...]],
                 replay: ReadLog | None = None) -> None:
        super().__init__()
        self.builder = builder
        self.replay = replay  # the sampled reads, when the program reads its data
        self.sources = sources
        self.group_ranks = group_ranks
        self.group_origins = group_origins
        self.passed_on = PassedOn(builder.graph, lambda filename: not (
            _outside_user_code(filename) or _scalify_own(filename)), _scalify_own)
        # id -> (tensor, its node, when it was bound): a view read after its base was bound
        # again (written in place, or through another view) is derived from the base again
        self.refs: dict[int, tuple[torch.Tensor, Ref, int]] = {}
        self._binds = 0
        self._decomposing: set[Any] = set()  # ops whose decomposition is running

    def bind(self, tensor: torch.Tensor, ref: Ref) -> None:
        self._binds += 1
        self.refs[id(tensor)] = (tensor, ref, self._binds)

    def node_of(self, tensor: torch.Tensor) -> str | None:
        """The node holding `tensor` (or the base it views whole), recording nothing."""
        base = tensor._base
        for held in (tensor, base if base is not None and base.shape == tensor.shape else None):
            entry = self.refs.get(id(held)) if held is not None else None
            if entry is not None and entry[0] is held:
                return entry[1].name
        return None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (or the base it views) is a value of the captured program."""
        return id(tensor) in self.refs or (tensor._base is not None and id(tensor._base) in self.refs)

    def _outside_program(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op reads only real integer or boolean tensors the program neither holds nor
        computed (Megatron's RNG tracker compares CPU generator states): it runs as it would,
        unrecorded, and a real result is a value from outside like its inputs (a literal if the
        program reads it). Numbers from outside (a rotary table) are recorded as literals."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return bool(tensors) and not any(t.is_meta or t.is_floating_point() or t.is_complex()
                                         or self.holds(t) for t in tensors)

    def ref(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        entry = self.refs.get(id(value))
        if entry is None and value._base is not None and id(value._base) not in self.refs:
            self._constant_base(value._base)
        base = self.refs.get(id(value._base)) if value._base is not None else None
        if base is not None and (entry is None or entry[2] < base[2]):
            return self._view_again(value, value._base)
        if entry is not None:
            return entry[1]
        return self._literal(value)

    def _view_again(self, view: torch.Tensor, base: torch.Tensor) -> Ref:
        """`view`'s value now: its view ops replayed on its base's current value."""
        with self._recording():
            fresh = view._view_func(base)
        ref = self.ref(fresh)
        self.bind(view, ref)
        return ref

    def _write_through(self, written: torch.Tensor) -> None:
        """After an op wrote into `written`, a view: its base holds the written values."""
        base = written._base
        if base is None or id(base) not in self.refs:
            return
        # bound again now: the write of another view of `base` just before (all_gather into a
        # list of views) must not make `written` read as a view of that base
        if id(written) in self.refs:
            self.bind(written, self.refs[id(written)][1])
        with self._recording():
            merged = torch.ops.aten.as_strided_scatter(
                base, written, written.size(), written.stride(), written.storage_offset())
        self.bind(base, self.ref(merged))

    @contextmanager
    def _recording(self) -> Iterator[None]:
        """This recorder on (inside its own dispatch it is off)."""
        if _get_current_dispatch_mode() is self:
            yield
            return
        with self:
            yield

    def _constant_base(self, base: torch.Tensor) -> None:
        """Bind a constant that a first-read view was cut from before capture (Megatron's grad
        buffer behind each `param.main_grad`), so writes through the view reach it; a base too
        large to hold as a literal leaves the view a literal of its own."""
        try:
            self._literal(base)
        except CaptureError:
            pass

    def _literal(self, tensor: torch.Tensor, sampled: torch.Tensor | None = None) -> Ref:
        """A literal node holding `tensor`'s values (`sampled`'s, for a tensor whose values
        the sampled run gave), bound to `tensor`."""
        if sampled is None and not held_as_literal(tensor):
            raise CaptureError(f"a tensor of shape {tuple(tensor.shape)} was used that is neither an "
                               "input, a parameter, a buffer nor computed from them")
        with _disable_current_modes():  # (reading the value records nothing)
            value = (tensor if sampled is None else sampled).detach().cpu()
            if value.is_complex():  # held as its pairs (complex_pairs.py)
                value = torch.view_as_real(value)
        dtype = str(value.dtype).removeprefix("torch.")
        values = tuple(value.reshape(-1).tolist())
        ref = self.builder.emit("literal", [], dtype, shape=tuple(value.shape), values=values,
                                dtype=dtype)
        self.bind(tensor, ref)
        return ref

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if has_dtensor(types):
            return NotImplemented  # DTensor runs it; its local ops come back here
        if self._outside_program(args, kwargs):  # bookkeeping on values of its own (an RNG state)
            out = func(*args, **kwargs)
            if not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(out)):
                return out  # (moved onto the capture device, it is the program's: recorded)
        if complex_pairs.lowers(func, (args, kwargs)):
            return self._as_pairs(func, args, kwargs)
        packet = func.overloadpacket.__name__
        if packet in DATA_SHAPED:
            sampled = self._data_shaped(packet, args, kwargs)
            if sampled is not None:
                return sampled
        if packet == "index" and has_mask(args):  # x[mask]: positions as the sample found them
            args = (args[0], self._mask_positions(args[1]), *args[2:])
        decomposition = decomposition_of(func) if func not in self._decomposing else None
        if decomposition is not None:
            result = self._decompose(func, decomposition, args, kwargs)
            if result is not NotImplemented:
                return result
        if func is torch.ops.aten._local_scalar_dense.default:
            replaying, value = self.read_into_python(args[0], "scalar")
            if replaying:
                return value
        if func.namespace == "c10d" and func.overloadpacket.__name__ not in _POINT_TO_POINT:
            out = _run(func, args, kwargs)
            self._collective(func, args, out)
            return out
        name = lowering_name(func)[0]
        self.builder.source = self.sources.current()
        # read before the op runs: a constant it writes in place is held as it was
        ref_args = [tree_map(self.ref, a) for a in args]
        ref_kwargs = {k: tree_map(self.ref, v) for k, v in kwargs.items()}
        out = _run(func, args, kwargs)
        if name in ("as_strided", "as_strided_scatter"):  # the input's memory layout matters
            ref_kwargs["input_layout"] = (args[0].stride(), args[0].storage_offset())
        if func.namespace == "_c10d_functional" and name in _COLLECTIVE_GROUP_ARG:
            index = _COLLECTIVE_GROUP_ARG[name]
            ref_args[index] = self.group_ranks(ref_args[index])
            self._over_group(ref_args[index])
        try:
            result = lower(self.builder, name, ref_args, ref_kwargs, out)
        except (CaptureError, ValueError) as error:  # kept opaque: what depends on it is unknown
            tensors = [r for r in tree_leaves((ref_args, ref_kwargs)) if isinstance(r, Ref)]
            reason = (str(error) if name in LOWERINGS
                      else "no lowering to the core IR and no decomposition into lowered ops")
            result = opaque(self.builder, str(func.overloadpacket), tensors, out, reason)
        if isinstance(result, Ref) and any(isinstance(a, Ref) and a.name == result.name
                                           for a in tree_leaves(ref_args)):  # passed on as is
            self.passed_on.add_source(result.name, self.builder.source)
        if func.namespace == "c10d":  # send/recv return a Work; recv fills its buffer
            self._bind_result(args[0][0] if name == "recv" else None, result)
        else:
            self._bind_result(out, result)
        for tensor in _written(func, args, kwargs):
            self._write_through(tensor)
        return out

    def _as_pairs(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op on complex tensors, recorded as real ops on their pairs (complex_pairs.py)."""
        self.builder.source = self.sources.current()
        out = _run(func, args, kwargs)
        try:
            with self._recording():
                result = self.ref(complex_pairs.lowered(func, args, kwargs, out, self._pairs))
        except CaptureError as error:
            tensors = [self.ref(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            result = opaque(self.builder, str(func.overloadpacket), tensors, out, str(error))
        self._bind_result(out, result)
        return out

    def _pairs(self, tensor: torch.Tensor) -> torch.Tensor:
        """A complex tensor's pairs, as a real tensor bound to its node (a real one as is)."""
        if not tensor.is_complex():
            return tensor
        ref = self.ref(tensor)
        with _disable_current_modes():  # (a conjugate or negative view: its values resolved)
            pairs = torch.view_as_real(tensor.resolve_conj().resolve_neg())
        self.bind(pairs, ref)
        return pairs

    def _from_data(self, tensor: torch.Tensor) -> bool:
        """Whether an input, a random draw, another rank's data or uninitialised memory lies
        upstream of `tensor` (an op kept opaque, like `nonzero` on DeviceMesh's table of
        ranks, is a function of its inputs)."""
        if not self.holds(tensor):
            return False
        graph, stack, seen = self.builder.graph, [self.ref(tensor).name], set()
        while stack:
            node = graph[stack.pop()]
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op == "placeholder" or _varying(node):
                return True
            stack.extend(node.inputs)
        return False

    def read_into_python(self, tensor: torch.Tensor, kind: str) -> tuple[bool, Any]:
        """`.item()`, `.tolist()`, `if x:`: the program goes on with Python numbers, which the
        graph would hold as constants. Replaying a sample: (True, the sampled value), noted as
        a condition of the proof when the tensor comes from the data. Else (False, None), and
        refused when it comes from the data (the caller samples the reads and tries again)."""
        if self.replay is not None:
            line = user_line()
            value = self.replay.take(line, kind)
            if self._from_data(tensor):
                self.replay.note(line)
            return True, value
        if self._from_data(tensor):
            raise DataDependentRead(
                f"{self.sources.current()}: a tensor computed from the inputs (or drawn at "
                "random, or from other ranks) is read into Python (.item(), .tolist(), "
                "int(), bool(), an `if` on a tensor); the captured graph would hold its "
                "value as a constant")
        return False, None

    def _sampled(self, like: torch.Tensor, value: Any) -> Any:
        """The sampled `value` (tensors) as tensors on `like`'s device bound to literals."""
        def bound(sampled: Any) -> Any:
            if not isinstance(sampled, torch.Tensor):
                return sampled
            with _disable_current_modes():
                tensor = (torch.empty(sampled.shape, dtype=sampled.dtype, device=like.device)
                          if like.is_meta else sampled.to(like.device))
            self.builder.source = self.sources.current()
            self._literal(tensor, sampled)
            return tensor
        return tree_map(bound, value)

    def _data_shaped(self, packet: str, args: tuple, kwargs: dict) -> Any:
        """An op whose output's shape depends on its input's values (`nonzero`, `bincount`):
        as the sample computed it when it reads the data (refused without a sample) or meta
        tensors; None when it runs as usual."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_data = any(self._from_data(t) for t in tensors)
        if self.replay is None:
            if from_data:
                raise DataDependentRead(
                    f"{self.sources.current()}: aten.{packet} computes a shape from values "
                    "that come from the inputs (or from other ranks)")
            return None
        line = user_line()
        value = self.replay.take(line, packet)
        if not (from_data or any(t.is_meta for t in tensors)):
            return None
        if from_data:
            self.replay.note(line)
        return self._sampled(tensors[0], value)

    def _mask_positions(self, indices: list) -> list:
        """Boolean masks among `indices` (x[mask]) as the positions the sample found, when
        they come from the data (refused without a sample) or are meta; else as they are."""
        masks = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
        from_data = any(self._from_data(m) for m in masks)
        if self.replay is None:
            if from_data:
                raise DataDependentRead(f"{self.sources.current()}: a boolean mask computed "
                                        "from the inputs selects elements (x[mask])")
            return indices
        line = user_line()
        positions = self.replay.take(line, "mask")
        if not (from_data or any(m.is_meta for m in masks)):
            return indices
        if from_data:
            self.replay.note(line)
        return self._sampled(masks[0], positions)

    def _collective(self, func: Any, args: tuple, out: Any) -> None:
        """An in-place c10d collective: rebind the tensors it overwrites to its result (to
        opaque values if it cannot be lowered)."""
        self.builder.source = self.sources.current()
        for group in (a for a in args if c10d.is_group(a)):
            self._over_group(c10d.group_ranks(group))
        first_new = len(self.builder.graph)
        try:
            lowering = c10d.LOWERINGS.get(func.overloadpacket.__name__)
            if lowering is None:
                raise CaptureError(f"c10d.{func.overloadpacket.__name__} is not supported")
            rebinds = lowering(self.builder, args, self.ref)
        except (CaptureError, ValueError) as error:
            written = c10d.overwritten(args)
            inputs = [r for r in tree_leaves([self.ref(t) for t in tree_leaves(args)
                                              if isinstance(t, torch.Tensor)])]
            refs = opaque(self.builder, str(func.overloadpacket), inputs, written, str(error))
            rebinds = list(zip(written, refs))
        self._buffers_written(rebinds, first_new)
        for tensor, ref in rebinds:
            self.bind(tensor, ref)
        for tensor, _ in rebinds:
            self._write_through(tensor)

    def _over_group(self, ranks: tuple[int, ...]) -> None:
        """The collective being recorded runs over `ranks`: where that group was made is
        where its ranks came from (group_origins.py)."""
        made = self.group_origins(ranks)
        source = self.builder.source
        if made:
            self.builder.source = dataclasses.replace(
                source, values_from=tuple(dict.fromkeys((*source.values_from, *made))))

    def _buffers_written(self, rebinds: list[tuple[torch.Tensor, Ref]], first_new: int) -> None:
        """A collective wrote its result into buffers it does not read (an all_gather into a
        list of views): the lines that made them are where the result was passed on."""
        graph = self.builder.graph
        read = {name for node in graph.nodes[first_new:] for name in node.inputs}
        for tensor, ref in rebinds:
            before = self.node_of(tensor)
            if before is not None and before not in read and before != ref.name:
                source = graph[before].source
                if source.file:
                    self.passed_on.add(ref.name, f"{source.file}:{source.line}")

    def _decompose(self, func: Any, decomposition: Callable, args: tuple, kwargs: dict) -> Any:
        """Run `decomposition` with this recorder on, so its pieces are recorded (an op it
        calls again is not decomposed again); NotImplemented if it refuses these arguments."""
        self._decomposing.add(func)
        try:
            with self:
                return decomposition(*args, **kwargs)
        except ScalifyError:
            raise
        except Exception:  # e.g. a data-dependent decomposition on meta tensors
            return NotImplemented
        finally:
            self._decomposing.discard(func)

    def _bind_result(self, out: Any, result: Any) -> None:
        if result is None or out is None:
            return
        if isinstance(out, torch.Tensor):
            self.bind(out, result if isinstance(result, Ref) else result[0])
            return
        for tensor, ref in zip(out, result):
            if isinstance(tensor, torch.Tensor) and ref is not None:
                self.bind(tensor, ref)


_DATA = torch.Tensor.data  # the `.data` attribute's descriptor


class _PythonLevelCalls(TorchFunctionMode):
    """Calls the recorder must see before dispatch. `.tolist()` and `.numpy()` read values
    without dispatching an op: checked as `.item()` is. `F.one_hot` with its number of classes
    given runs as the comparison it is (PyTorch's eager version reads its input's min and max
    to check the range, which would refuse every MoE router written with it). Attention
    without dropout runs PyTorch's math version, whose backward is made of recorded ops (a
    fused kernel's backward, such as the CPU flash attention's, has no lowering). `.data`
    passes the value on."""

    _READS = (torch.Tensor.tolist, torch.Tensor.numpy)

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._READS:
            replaying, value = self.recorder.read_into_python(args[0], "list")
            if replaying:
                return numpy.array(value) if func is torch.Tensor.numpy else value
        if func is torch.nn.functional.one_hot:
            classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            if classes > 0:
                labels = torch.arange(classes, dtype=args[0].dtype, device=args[0].device)
                return (args[0].unsqueeze(-1) == labels).long()
        if func is torch.nn.functional.scaled_dot_product_attention:
            result = _math_attention(*args, **kwargs)
            if result is not None:
                return result
        if func == _DATA.__get__ or func == _DATA.__set__:
            return self._data(func, args)
        return func(*args, **kwargs)

    def _data(self, func: Any, args: tuple) -> Any:
        """`t.data` is `t`'s value, and `t.data = v` makes `t` hold `v`'s: neither dispatches an
        op (Megatron's `make_viewless_tensor` swaps a fresh tensor's data for its input's)."""
        result = func(*args)
        source, target = (args[0], result) if func == _DATA.__get__ else (args[1], args[0])
        if self.recorder.holds(source):
            self.recorder.bind(target, self.recorder.ref(source))
        return result


def _math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor | None:
    """`F.scaled_dot_product_attention` as PyTorch's math version; None with dropout. A boolean
    mask (True: attend) becomes the additive one the public function makes of it: the math
    version itself would add the booleans as numbers."""
    if dropout_p:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


@contextmanager
def functional_collectives_waited() -> Iterator[None]:
    """Functional collectives return waited plain tensors, as they do under a compiler's
    tracing, instead of `AsyncCollectiveTensor` wrappers whose later use (an in-place add on
    an all_reduce's result, say) runs inside the wrapper, unseen by the recorder."""
    traced = funcol._are_we_tracing
    funcol._are_we_tracing = lambda: True
    try:
        yield
    finally:
        funcol._are_we_tracing = traced


def _varying(node: Any) -> bool:
    """A value no program text fixes: a random draw, another rank's data, or an opaque op that
    reads no input (uninitialised memory) or that communicates (a collective with no lowering)."""
    if node.op != "opaque":
        return OPS[node.op].trait in _VARYING
    return not node.inputs or node.attr("target").split(".")[0] in ("c10d", "_c10d_functional")


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes into (in place or `out=`), from its schema."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` on the captured (meta) tensors; a 0-dim CPU tensor among them (a scalar, which
    would mix with CUDA tensors) is moved to their device first, and so is every real tensor
    an op mixes with meta ones (torchtitan's embedding multiplies its meta output by a mask
    of the real token ids; its loss backward picks a 0-dim meta gradient by the real labels):
    the op computes only a shape, and the graph holds its inputs' nodes."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if t.dim()}
        if "device" in str(error) and (len(devices) == 1 or any(t.is_meta for t in tensors)):
            device = torch.device("meta") if any(t.is_meta for t in tensors) else devices.pop()
            moved = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor)
                             and t.device != device and (not t.dim() or device.type == "meta")
                             else t, (args, kwargs))
            return _run_once(func, *moved)
        raise CaptureError(f"{func} failed during capture: {str(error).splitlines()[0]}") from None


def _run_once(func: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        raise CaptureError(f"{func} failed during capture: {str(error).splitlines()[0]}") from None


def _module_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in module.named_modules()}


def held_as_literal(tensor: torch.Tensor) -> bool:
    """Whether a value the program reads but does not compute can be written into it."""
    return not tensor.is_meta and tensor.numel() <= LITERAL_ELEMENTS


def _built_buffers(module: torch.nn.Module) -> set[str]:
    """Buffers the modules build for themselves (registered non-persistent, so no checkpoint
    holds them: a rotary table, inverse frequencies), where their values can be written into
    the program: constants of the program, not inputs, so the reference's table and a rank's
    table of the same values are one value whatever each is named."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in module.named_modules() for name in sub._non_persistent_buffers_set
            if sub._buffers.get(name) is not None and held_as_literal(sub._buffers[name])}


def capture(module: torch.nn.Module, call: Callable[[], Any], inputs: dict[str, torch.Tensor],
            group_ranks: Callable[[str], tuple[int, ...]] = lambda name: (),
            grad: bool = False,
            group_origins: Callable[[tuple[int, ...]], tuple[str, ...]] = lambda ranks: (),
            plan_lines: dict[str, tuple[str, ...]] | None = None,
            replay: ReadLog | None = None) -> Graph:
    """Run `call()` (which runs `module` on `inputs`) and return the core-IR graph it executed.

    Parameters, buffers and inputs become placeholders named as in `named_parameters()`,
    `named_buffers()` and the `inputs` dict. With `grad`, autograd is on, so a `call` that
    computes gradients records its backward pass too. `plan_lines` name, by module, the
    lines of the tensor-parallel plan entries that sharded it (every op of it reads them).
    `replay` gives the values it reads from its data, sampled on real numbers.
    """
    builder = GraphBuilder()
    sources = SourceTracker(_module_names(module), plan_lines)
    recorder = _Recorder(builder, sources, group_ranks, group_origins, replay)
    leaves = [("param", n, t) for n, t in module.named_parameters()]
    built = _built_buffers(module)
    leaves += [("buffer", n, t) for n, t in module.named_buffers() if n not in built]
    leaves += [("input", n, t) for n, t in inputs.items()]
    for kind, name, tensor in leaves:
        layout = dtensor_layout(tensor)
        tensor = local_tensor(tensor)
        shape, dtype = complex_pairs.held_as(tensor)
        node_name = builder.emit_placeholder(name, kind, shape, dtype, layout)
        recorder.bind(tensor, node_name)
    hooks = [register_module_forward_pre_hook(sources.enter), register_module_forward_hook(sources.leave)]
    try:
        with (torch.set_grad_enabled(grad), sharding_propagation_unrecorded(),
              functional_collectives_waited(), as_gpu(capture_device(inputs)), recorder,
              _PythonLevelCalls(recorder), recorder.passed_on.returns(recorder.node_of)):
            result = call()
    except RuntimeError as error:  # raised outside the recorder's own calls, e.g. by DTensor
        raise CaptureError(f"{sources.failure(error)}: {str(error).splitlines()[0]}") from None
    finally:
        for hook in hooks:
            hook.remove()
    outputs = result if isinstance(result, (tuple, list)) else [result]
    graph = builder.graph
    graph.outputs = [recorder.ref(local_tensor(t)).name for t in outputs]
    graph = canonical_movement(recorder.passed_on.written_into(graph.pruned()))
    graph.sampled_reads = tuple(replay.replayed) if replay else ()
    return graph
