"""The lines that set the Python values an op's line reads: an offset into a bucket, a scale, the
process group of a collective. These values are not tensors, so the graph holds no node for
them; a report that names only the op's line misses a bug in the arithmetic that computed them.

Read from the source, a step back (and through the file's calls where a value came in as an
argument or out of a function of the file): for a local name, the assignments that
can reach the line (the last one above it, and those later in a loop around it); for a global,
its module-level assignments and those under `global`; for `obj.attr` (or `getattr(obj, "attr")`),
every assignment to an attribute of that name in the file (`setattr` with its name too), and
where one assigns a parameter of its function (a constructor keeping its argument), the
arguments the file's calls pass for it and where the attributes they read were set. A list
of tensors read on the line names the lines that built it and, for the attributes those lines
read, where they were set: which tensors it holds (gradients chosen by a tag on their
parameters). The tests of the `if`s and `while`s around the line count too: they decided that
it runs (a parameter counted on the wrong ranks is a wrong condition)."""
from __future__ import annotations

import ast
import linecache
from functools import lru_cache
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_SCALARS = (int, float, bool, str, dist.ProcessGroup)


def value_sources(frame: FrameType) -> tuple[str, ...]:
    """`file:line`s that assigned the non-tensor values read on `frame`'s current line."""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    if _module_tree(filename) is None:
        return ()
    found: set[int] = set()
    for read in _line_reads(filename, line)[1]:
        value = _local_or_global(frame, read.id) if isinstance(read, ast.Name) else None
        local = isinstance(read, ast.Name) and read.id in frame.f_code.co_varnames
        if isinstance(read, ast.Name) and (_is_scalar(value) or _tensors(value) or (
                local and (value is None or isinstance(value, nn.Parameter)))):  # a parameter
            # (or none) chosen in Python: where it was chosen
            built = _name_definitions(filename, line, read.id, local)
            found.update(built)
            function = _line_reads(filename, line)[0]
            if local and function is not None and function.lineno in built:  # as passed in
                found.update(_passed_to_parameter(filename, function.lineno, read.id))
            if _tensors(value):  # which tensors the list holds: what its lines read of them
                found.update(number for at in built
                             for number in _read_attribute_definitions(filename, at))
        elif local and isinstance(value, torch.Tensor):  # a tensor taken from a list by a loop
            found.update(_looped_over(frame, filename, line, read.id))
        elif (isinstance(read, ast.Attribute) and isinstance(read.value, ast.Name)
              and _is_scalar(_attribute(_local_or_global(frame, read.value.id), read.attr))):
            found.update(_attribute_definitions(filename, read.attr))
            found.update(_passed_to_attribute(filename, read.attr))
    found.update(_governing_conditions(filename, line))
    found.discard(line)
    return tuple(f"{filename}:{number}" for number in sorted(found))


def _looped_over(frame: FrameType, filename: str, line: int, name: str) -> set[int]:
    """For a loop variable `name` (`for grad in grads:`), the sources of the list of tensors it
    runs over: where that list was built, or what the callers passed for it."""
    function = _line_reads(filename, line)[0]
    if function is None:
        return set()
    found: set[int] = set()
    for loop in _statements(function):
        if (isinstance(loop, (ast.For, ast.AsyncFor)) and loop.lineno in _reaching(
                function, name, line) and isinstance(loop.iter, ast.Name)
                and _tensors(frame.f_locals.get(loop.iter.id))):
            built = _name_definitions(filename, loop.lineno, loop.iter.id, True)
            found.update(built)
            if function.lineno in built:
                found.update(_passed_to_parameter(filename, function.lineno, loop.iter.id))
    return found


def _tensors(value: Any) -> bool:
    """A list or tuple of tensors (gradients gathered to be reduced together)."""
    return isinstance(value, (tuple, list)) and bool(value) and all(
        isinstance(item, torch.Tensor) for item in value)


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


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _line_reads(filename: str, line: int) -> tuple[Function | None, tuple[ast.expr, ...]]:
    """The function holding `line` of `filename` and the names and attributes read there, on
    every line of the simple statement that starts there (a call's arguments on the lines
    below it: `group=` of a collective written over two lines)."""
    innermost = None
    for function in _functions(filename):  # outer functions first
        if function.lineno <= line <= (function.end_lineno or function.lineno):
            innermost = function
    reads = _reads_by_line(filename, innermost.lineno if innermost else 0)
    return innermost, tuple(read for number in range(line, _statement_end(filename, line) + 1)
                            for read in reads.get(number, ()))


_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor,
             ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)


@lru_cache(maxsize=1 << 14)
def _statement_end(filename: str, line: int) -> int:
    """The last line of the simple statement that starts on `line` (`line` for any other)."""
    return max((s.end_lineno or line for s in _all_statements(filename)
                if s.lineno == line and not isinstance(s, _COMPOUND)), default=line)


@lru_cache(maxsize=256)
def _all_statements(filename: str) -> tuple[ast.stmt, ...]:
    """Every statement of the file, in functions and classes too."""
    found, pending = [], list(_module_tree(filename).body)
    while pending:  # statements only: no expression holds one
        statement = pending.pop()
        found.append(statement)
        pending.extend(_nested(statement))
    return tuple(found)


def _nested(statement: ast.stmt) -> list[ast.stmt]:
    """The statements directly inside `statement` (its blocks, handlers and match cases)."""
    inner = [s for field in ("body", "orelse", "finalbody", "handlers")
             for s in getattr(statement, field, [])]
    return inner + [s for case in getattr(statement, "cases", []) for s in case.body]


@lru_cache(maxsize=256)
def _functions(filename: str) -> tuple[Function, ...]:
    """The file's functions, each after the functions that hold it."""
    found = [statement for statement in _all_statements(filename)
             if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return tuple(sorted(found, key=lambda node: (node.lineno, -(node.end_lineno or 0))))


@lru_cache(maxsize=1 << 10)
def _reads_by_line(filename: str, function_line: int) -> dict[int, tuple[ast.expr, ...]]:
    """Names and `name.attr`s loaded by line (not the callees of calls) in the function of
    `filename` defined at `function_line` (0: the module)."""
    scope = next((f for f in _functions(filename) if f.lineno == function_line),
                 _module_tree(filename))
    callees = {id(node.func) for node in ast.walk(scope) if isinstance(node, ast.Call)}
    lines: dict[int, list[ast.expr]] = {}
    for node in ast.walk(scope):
        if (isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load)
                and id(node) not in callees):
            lines.setdefault(node.lineno, []).append(node)
        named = _named_attribute(node, "getattr")
        if named is not None:  # getattr(obj, "name"): a read of obj.name
            lines.setdefault(node.lineno, []).append(
                ast.Attribute(named[0], named[1], ast.Load(), lineno=node.lineno))
    return {line: tuple(reads) for line, reads in lines.items()}


def _named_attribute(node: ast.AST, function: str) -> tuple[ast.expr, str] | None:
    """(obj, name) for a call `function(obj, "name", ...)` (getattr, setattr), else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == function and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[0], node.args[1].value
    return None


@lru_cache(maxsize=1 << 12)
def _read_attribute_definitions(filename: str, line: int) -> tuple[int, ...]:
    """The lines that assign the attributes read on `line` (what a list built there holds)."""
    reads = _line_reads(filename, line)[1]
    return tuple(number for read in reads if isinstance(read, ast.Attribute)
                 for number in _attribute_definitions(filename, read.attr))


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
        pending.extend(_nested(statement))
    return body


_LIST_BUILDS = ("append", "extend", "insert")


def _bound_names(statement: ast.stmt) -> set[str]:
    """The names a statement binds, and the list a `name.append(...)` (or extend, insert)
    adds to: which tensors a list holds is decided there."""
    built = _list_built(statement)
    if built is not None:
        return {built}
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


def _list_built(statement: ast.stmt) -> str | None:
    """`name` for a statement `name.append(...)` (or extend, insert), else None."""
    call = statement.value if isinstance(statement, ast.Expr) else None
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in _LIST_BUILDS and isinstance(call.func.value, ast.Name)):
        return call.func.value.id
    return None


def _with_their_conditions(filename: str, lines: list[int]) -> list[int]:
    """`lines`, and for those that add to a list, the `if`s that decided they ran (a gradient
    counted on the wrong ranks)."""
    builds = _list_build_lines(filename)
    return [*lines, *(number for line in lines if line in builds
                      for number in _governing_conditions(filename, line))]


@lru_cache(maxsize=256)
def _list_build_lines(filename: str) -> frozenset[int]:
    return frozenset(s.lineno for s in _all_statements(filename) if _list_built(s) is not None)


@lru_cache(maxsize=1 << 14)
def _name_definitions(filename: str, line: int, name: str, local: bool) -> tuple[int, ...]:
    """Where `name`, read on `line`, was assigned: a local's reaching assignments, or a
    global's assignments at module level and under `global` statements."""
    tree, function = _module_tree(filename), _line_reads(filename, line)[0]
    if function is not None and local:
        return tuple(_with_their_conditions(filename, _reaching(function, name, line)))
    lines = [statement.lineno for statement in _stores(tree, name)]
    for scope in _functions(filename):
        if any(isinstance(statement, ast.Global) and name in statement.names
               for statement in _statements(scope)):
            lines.extend(statement.lineno for statement in _stores(scope, name))
    return tuple(lines)


def _reaching(function: ast.AST, name: str, line: int) -> list[int]:
    """The assignments of local `name` that can reach `line`: the last one above it (or the
    parameter) and those below it in a loop that holds `line`."""
    stores = _stores(function, name)
    above = [statement.lineno for statement in stores if statement.lineno < line]
    found = [max(above)] if above else [function.lineno]
    rebound = next((s for s in stores if s.lineno == found[0] and isinstance(s, ast.Assign)), None)
    if rebound is not None and any(isinstance(node, ast.Name) and node.id == name
                                   for node in ast.walk(rebound.value)):
        found += _reaching(function, name, rebound.lineno)  # `x = f(x)`: one computation
    for loop in ast.walk(function):
        if (isinstance(loop, (ast.For, ast.AsyncFor, ast.While))
                and loop.lineno <= line <= (loop.end_lineno or loop.lineno)):
            found.extend(statement.lineno for statement in stores
                         if line < statement.lineno <= (loop.end_lineno or loop.lineno))
    return found


@lru_cache(maxsize=1 << 14)
def _governing_conditions(filename: str, line: int) -> tuple[int, ...]:
    """The lines of the `if` and `while` tests, in the function holding `line`, whose branches
    hold it."""
    function = _line_reads(filename, line)[0]
    scope = function or _module_tree(filename)
    return tuple(statement.test.lineno for statement in _statements(scope)
                 if isinstance(statement, (ast.If, ast.While))
                 and (statement.test.end_lineno or statement.test.lineno) < line
                 <= (statement.end_lineno or statement.lineno))


@lru_cache(maxsize=1 << 12)
def _attribute_definitions(filename: str, attribute: str) -> tuple[int, ...]:
    """Every line of the file that assigns an attribute named `attribute` (or sets it by
    `setattr` with its name)."""
    lines = []
    for node in _all_statements(filename):
        if isinstance(node, ast.Expr) and (_named_attribute(node.value, "setattr")
                                           or (None, ""))[1] == attribute:
            lines.append(node.lineno)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(part, ast.Attribute) and part.attr == attribute
                   and isinstance(part.ctx, ast.Store)
                   for target in targets for part in ast.walk(target)):
                lines.append(node.lineno)
    return tuple(lines)


@lru_cache(maxsize=1 << 12)
def _passed_to_attribute(filename: str, attribute: str) -> tuple[int, ...]:
    """For each assignment of `attribute` from a parameter of its function, the lines of the
    arguments the file's calls of that function pass for the parameter, and the lines that set
    the attributes those arguments read (`self.scale = scale`, built as `Attention(...,
    self.scaling)`: where `self.scaling` was computed)."""
    return tuple(dict.fromkeys(number for function, parameter in _parameters_assigned(
        filename, attribute) for number in _passed_to_parameter(filename, function.lineno,
                                                                parameter)))


@lru_cache(maxsize=1 << 12)
def _passed_to_parameter(filename: str, function_line: int, parameter: str) -> tuple[int, ...]:
    """The lines of the arguments the file's calls pass for `parameter` of the function defined
    at `function_line`, and where what they read was set: the attributes' assignments, and
    the caller's assignments of its locals that reach the call."""
    function = next(f for f in _functions(filename) if f.lineno == function_line)
    lines: list[int] = []
    for argument in _arguments_for(filename, function, parameter):
        lines.append(argument.lineno)
        caller = _line_reads(filename, argument.lineno)[0]
        for node in ast.walk(argument):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                lines.extend(_attribute_definitions(filename, node.attr))
            elif (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                  and caller is not None and _stores(caller, node.id)):
                lines.extend(_with_their_conditions(
                    filename, _reaching(caller, node.id, argument.lineno)))
    return tuple(dict.fromkeys(lines))


def _parameters_assigned(filename: str, attribute: str) -> list[tuple[Function, str]]:
    """(function, parameter) for each assignment of `attribute` in a function whose value (the
    element of a tuple assigned to it) is one of the function's parameters."""
    found = []
    for function in _functions(filename):
        parameters = {arg.arg for arg in (*function.args.posonlyargs, *function.args.args,
                                          *function.args.kwonlyargs)}
        for statement in _statements(function):
            if not isinstance(statement, ast.Assign):
                continue
            for target in statement.targets:
                value = _assigned_value(target, statement.value, attribute)
                if isinstance(value, ast.Name) and value.id in parameters:
                    found.append((function, value.id))
    return found


def _assigned_value(target: ast.expr, value: ast.expr, attribute: str) -> ast.expr | None:
    """The part of `value` that `target` assigns to an attribute named `attribute`."""
    if isinstance(target, ast.Attribute):
        return value if target.attr == attribute else None
    if (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)):
        for part, element in zip(target.elts, value.elts):
            found = _assigned_value(part, element, attribute)
            if found is not None:
                return found
    return None


def _arguments_for(filename: str, function: Function, parameter: str) -> list[ast.expr]:
    """The expressions the file's calls of `function` pass for `parameter`: calls by its name
    (`f(...)`, `obj.f(...)`), or by its class's name for an `__init__`."""
    names = [arg.arg for arg in (*function.args.posonlyargs, *function.args.args)]
    called = function.name
    if function.name == "__init__":
        called = next((c.name for c in _classes(filename) if function in c.body), "")
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    found = []
    for call in _calls(filename):
        callee = call.func
        name = callee.id if isinstance(callee, ast.Name) else (
            callee.attr if isinstance(callee, ast.Attribute) else None)
        if not called or name != called:
            continue
        found += [keyword.value for keyword in call.keywords if keyword.arg == parameter]
        if parameter in names and names.index(parameter) < len(call.args):
            argument = call.args[names.index(parameter)]
            if not isinstance(argument, ast.Starred):
                found.append(argument)
    return found


@lru_cache(maxsize=256)
def _classes(filename: str) -> tuple[ast.ClassDef, ...]:
    return tuple(s for s in _all_statements(filename) if isinstance(s, ast.ClassDef))


@lru_cache(maxsize=256)
def _calls(filename: str) -> tuple[ast.Call, ...]:
    return tuple(node for node in ast.walk(_module_tree(filename)) if isinstance(node, ast.Call))


def made_at(frame: FrameType) -> tuple[str, ...]:
    """Where the value a call on `frame`'s line makes came from (a process group's ranks): the
    line, what it reads (`value_sources`), and for those of its lines that compute a value by
    calling a function of the file, that function's `return` lines (a rank grid's groups)."""
    filename = frame.f_code.co_filename
    read = value_sources(frame)
    further = {number for place in read for number in _one_step_further(
        filename, int(place.rpartition(":")[2]))}
    return tuple(dict.fromkeys((f"{filename}:{frame.f_lineno}", *read,
                                *(f"{filename}:{number}" for number in sorted(further)))))


@lru_cache(maxsize=1 << 12)
def _one_step_further(filename: str, line: int) -> tuple[int, ...]:
    """What the statement on `line` computed its value from, where no frame tells the values:
    the `return` lines of the file's functions it calls, and for the parameters of its
    function it reads, the arguments the callers pass."""
    function, reads = _line_reads(filename, line)
    parameters = {arg.arg for arg in function.args.args} if function is not None else set()
    passed = [number for read in reads if isinstance(read, ast.Name) and read.id in parameters
              for number in _passed_to_parameter(filename, function.lineno, read.id)]
    return (*_returns_called(filename, line), *passed)


@lru_cache(maxsize=1 << 12)
def _returns_called(filename: str, line: int) -> tuple[int, ...]:
    """The `return` lines of the file's functions that the statement on `line` calls by name."""
    if _module_tree(filename) is None:
        return ()
    called = set()
    for statement in _all_statements(filename):
        if statement.lineno == line:
            header = ([statement.iter] if isinstance(statement, (ast.For, ast.AsyncFor))
                      else [] if isinstance(statement, _COMPOUND) else [statement])
            called |= {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                       for part in header for node in ast.walk(part) if isinstance(node, ast.Call)
                       and isinstance(node.func, (ast.Name, ast.Attribute))}
    return tuple(node.lineno for function in _functions(filename) if function.name in called
                 for node in ast.walk(function) if isinstance(node, ast.Return))
