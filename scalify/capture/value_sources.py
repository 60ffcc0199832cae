"""The lines that set the Python values an op's line reads: an offset into a bucket, a scale, the
process group of a collective. These values are not tensors, so the graph holds no node for
them; a report that names only the op's line misses a bug in the arithmetic that computed them.

Read from the source (one step back, not through calls): for a local name, the assignments that
can reach the line (the last one above it, and those later in a loop around it); for a global,
its module-level assignments and those under `global`; for `obj.attr`, every assignment to an
attribute of that name in the file."""
from __future__ import annotations

import ast
import linecache
from functools import lru_cache
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

_SCALARS = (int, float, bool, str, dist.ProcessGroup)


def value_sources(frame: FrameType) -> tuple[str, ...]:
    """`file:line`s that assigned the non-tensor values read on `frame`'s current line."""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    tree = _module_tree(filename)
    if tree is None:
        return ()
    function = _enclosing_function(tree, line)
    found: set[int] = set()
    for read in _reads_on_line(function or tree, line):
        if isinstance(read, ast.Name) and _is_scalar(_local_or_global(frame, read.id)):
            found.update(_name_definitions(tree, function, read.id, line, frame))
        elif (isinstance(read, ast.Attribute) and isinstance(read.value, ast.Name)
              and _is_scalar(_attribute(_local_or_global(frame, read.value.id), read.attr))):
            found.update(_attribute_definitions(tree, read.attr))
    found.discard(line)
    return tuple(f"{filename}:{number}" for number in sorted(found))


def _is_scalar(value: Any) -> bool:
    """A Python value an op takes as an attribute: a number, a string, a group, or a tuple or
    list of them (a tensor is a node of the graph already)."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_is_scalar(item) for item in value)
    if type(value).__name__ == "DeviceMesh":
        return True
    return isinstance(value, _SCALARS) and not isinstance(value, torch.Tensor)


def _local_or_global(frame: FrameType, name: str) -> Any:
    if name in frame.f_locals:
        return frame.f_locals[name]
    return frame.f_globals.get(name)


def _attribute(value: Any, name: str) -> Any:
    """`value.name`, or None where reading it fails (a property may raise anything)."""
    try:
        return getattr(value, name, None)
    except Exception:  # noqa: BLE001 - user code's properties are not ours to judge
        return None


@lru_cache(maxsize=256)
def _module_tree(filename: str) -> ast.Module | None:
    source = "".join(linecache.getlines(filename))
    try:
        return ast.parse(source) if source else None
    except SyntaxError:
        return None


def _enclosing_function(tree: ast.AST, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function whose body holds `line`."""
    innermost = None
    for node in ast.walk(tree):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.lineno <= line <= (node.end_lineno or node.lineno)
                and (innermost is None or node.lineno >= innermost.lineno)):
            innermost = node
    return innermost


def _reads_on_line(scope: ast.AST, line: int) -> list[ast.expr]:
    """Names and `name.attr`s loaded on `line` (not the callees of calls)."""
    callees = {id(node.func) for node in ast.walk(scope) if isinstance(node, ast.Call)}
    return [node for node in ast.walk(scope)
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load)
            and node.lineno == line and id(node) not in callees]


def _stores(scope: ast.AST, name: str) -> list[ast.AST]:
    """The statements of `scope` (not of functions inside it) that bind `name`."""
    found = []
    for statement in _statements(scope):
        targets = _bound_names(statement)
        if name in targets:
            found.append(statement)
    return found


def _statements(scope: ast.AST) -> list[ast.stmt]:
    body: list[ast.stmt] = []
    pending = list(getattr(scope, "body", []))
    while pending:
        statement = pending.pop()
        body.append(statement)
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            pending.extend(getattr(statement, field, []))
    return body


def _bound_names(statement: ast.stmt) -> set[str]:
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        targets = [statement.target]
    elif isinstance(statement, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in statement.items if item.optional_vars]
    else:
        return set()
    return {node.id for target in targets for node in ast.walk(target)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}


def _name_definitions(tree: ast.Module, function: ast.AST | None, name: str, line: int,
                      frame: FrameType) -> list[int]:
    if function is not None and name in frame.f_code.co_varnames:
        return _reaching(function, name, line)
    lines = [statement.lineno for statement in _stores(tree, name)]
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(node, ast.Global) and name in node.names for node in ast.walk(scope)):
            lines.extend(statement.lineno for statement in _stores(scope, name))
    return lines


def _reaching(function: ast.AST, name: str, line: int) -> list[int]:
    """The assignments of local `name` that can reach `line`: the last one above it (or the
    parameter) and those below it in a loop that holds `line`."""
    stores = _stores(function, name)
    above = [statement.lineno for statement in stores if statement.lineno < line]
    found = [max(above)] if above else [function.lineno]
    for loop in ast.walk(function):
        if (isinstance(loop, (ast.For, ast.AsyncFor, ast.While))
                and loop.lineno <= line <= (loop.end_lineno or loop.lineno)):
            found.extend(statement.lineno for statement in stores
                         if line < statement.lineno <= (loop.end_lineno or loop.lineno))
    return found


def _attribute_definitions(tree: ast.Module, attribute: str) -> list[int]:
    """Every line of the file that assigns an attribute named `attribute`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(part, ast.Attribute) and part.attr == attribute
                   and isinstance(part.ctx, ast.Store)
                   for target in targets for part in ast.walk(target)):
                lines.append(node.lineno)
    return lines
