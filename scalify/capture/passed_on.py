"""Where user code passed a captured value on unchanged, for a discrepancy to name.

A value that no op changes leaves no node at the lines that handled it, yet those lines are
often where a bug lies: a row-parallel layer that returns its partial sum without the all-reduce,
an identity `autograd.Function` copied where the reduction belonged, a backward that returns its
gradient as it came, a gather written into buffers cut in the wrong order. Three kinds of line
are recorded for the node that holds the value:
- a user function returned it: the `return` line, the line that last assigned the local name
  it returned, and the line that called the function;
- an op passed it on as is (`clone`, `detach`, `contiguous`, an identity Function's alias);
- a collective wrote it into a buffer (or a view of one) made at a line.
"""
from __future__ import annotations

import dis
import sys
from contextlib import contextmanager
from dataclasses import replace
from types import CodeType, FrameType
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves

from ..ir.graph import Graph, SourceLoc

KEPT = 4  # lines kept per node, innermost first: the value's first hands


class PassedOn:
    """`file:line`s per node name, recorded during capture and written into the nodes' sources."""

    def __init__(self, graph: Graph, is_user_code: Callable[[str], bool],
                 runs_the_program: Callable[[str], bool]) -> None:
        self._graph = graph  # the graph being captured, whose nodes the lines are recorded for
        self._is_user_code = is_user_code
        self._runs_the_program = runs_the_program  # files whose frames no call site lies beyond
        self._user_code: dict[CodeType, bool] = {}
        self._stores: dict[CodeType, dict[str, list[int]]] = {}
        self.lines: dict[str, list[str]] = {}
        self.values_from: dict[str, list[str]] = {}  # node -> lines that set what the ops read

    def add(self, name: str, *lines: str) -> None:
        """Lines that passed node `name`'s value on (its own line and '' are left out)."""
        source = self._graph[name].source
        kept = self.lines.setdefault(name, [])
        for line in lines:
            if line and line != f"{source.file}:{source.line}" and line not in kept and len(
                    kept) < KEPT:
                kept.append(line)

    def add_source(self, name: str, source: SourceLoc) -> None:
        """An op at `source` passed the value of node `name` on (with the line that called it)."""
        if source.file:
            self.add(name, f"{source.file}:{source.line}", *source.callers[:1])
            values = self.values_from.setdefault(name, [])
            values.extend(line for line in source.values_from if line not in values)

    @contextmanager
    def returns(self, node_of: Callable[[torch.Tensor], str | None]) -> Iterator[None]:
        """Record the user functions that return a captured tensor while the block runs
        (`node_of` names the node holding a tensor, or None). Left off under a debugger or a
        coverage tool, whose own trace function is kept."""
        if sys.gettrace() is not None:
            yield
            return

        def on_return(frame: FrameType, event: str, value: Any) -> None:
            if event != "return":
                return
            held = [(t, node_of(t)) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            if any(name for _, name in held):
                file = frame.f_code.co_filename
                called = self._call_site(frame.f_back)
                for tensor, name in held:
                    if name is not None:
                        assigned = self._assigned_line(frame, tensor)
                        self.add(name, f"{file}:{assigned}" if assigned else "",
                                 f"{file}:{frame.f_lineno}", called)

        def on_call(frame: FrameType, event: str, _: Any) -> Callable | None:
            code = frame.f_code
            if code not in self._user_code:
                self._user_code[code] = self._is_user_code(code.co_filename)
            if not self._user_code[code]:
                return None
            frame.f_trace_lines = False
            return on_return

        sys.settrace(on_call)
        try:
            yield
        finally:
            sys.settrace(None)

    def _assigned_line(self, frame: FrameType, tensor: torch.Tensor) -> int | None:
        """The last line before the return that stored `tensor` under a local name (not an
        argument's): `grad_input = grad_output` where the reduction belonged."""
        code = frame.f_code
        if code not in self._stores:
            stores: dict[str, list[int]] = {}
            for instruction in dis.get_instructions(code):
                if instruction.opname in ("STORE_FAST", "STORE_DEREF", "STORE_NAME"):
                    line = instruction.positions.lineno if instruction.positions else None
                    if line is not None:
                        stores.setdefault(instruction.argval, []).append(line)
            self._stores[code] = stores
        arguments = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
        lines = [line for local, value in frame.f_locals.items()
                 if value is tensor and local not in arguments
                 for line in self._stores[code].get(local, ()) if line <= frame.f_lineno]
        return max(lines, default=None)

    def _call_site(self, frame: FrameType | None) -> str:
        """The innermost user line that called into `frame`'s callee ('' when the autograd
        engine or the code that runs the program did: no line of the program called it)."""
        while frame is not None:
            if (frame.f_code.co_name == "_engine_run_backward"
                    or self._runs_the_program(frame.f_code.co_filename)):
                return ""
            if self._is_user_code(frame.f_code.co_filename):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back
        return ""

    def written_into(self, graph: Graph) -> Graph:
        """`graph` with each node's recorded lines in its source's `passed_at`, and the lines that
        set the values the passing ops read in its `values_from`."""
        if not self.lines:
            return graph
        written = Graph(outputs=list(graph.outputs))
        for node in graph:
            lines = self.lines.get(node.name)
            if lines:
                values = dict.fromkeys([*node.source.values_from,
                                        *self.values_from.get(node.name, ())])
                node = replace(node, source=replace(node.source, passed_at=tuple(lines),
                                                    values_from=tuple(values)))
            written.add(node)
        return written
