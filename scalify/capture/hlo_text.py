"""Parses XLA HLO module text into plain data: computations of instructions, shapes, attributes
and the stack-frame tables (no meaning is given to any op here; see capture/hlo.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import CaptureError

# f16[2048,64,4]{2,1,0}, pred[], s32[<=8] (a bounded dim is read as its bound).
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_PAYLOAD_OPS = ("constant", "parameter")  # what their parentheses hold is not operands
_COMMENT = re.compile(r"/\*.*?\*/")  # /*index=5*/ inside long tuples
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


@dataclass(frozen=True)
class HloShape:
    """An array shape (`dtype`, `dims`, its `layout`: dims minor to major, when written) or a
    tuple of shapes (`elements`, dtype "tuple")."""

    dtype: str
    dims: tuple[int, ...] = ()
    elements: tuple[HloShape, ...] = ()
    layout: tuple[int, ...] = ()


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction; `attrs` keep each attribute's text, `payload` what sits between the
    parentheses when it is not a list of operands (a constant's literal, a parameter's index)."""

    name: str
    opcode: str
    shape: HloShape
    operands: tuple[str, ...]
    attrs: dict[str, str]
    payload: str
    line: int  # 1-based line number in the module text
    text: str  # the instruction's line, for messages


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    root: str = ""
    is_entry: bool = False

    def parameters(self) -> list[Instruction]:
        """The parameters in parameter-number order."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: int(i.payload))


@dataclass
class StackTables:
    """The module's stack-frame tables: ids to file names, function names, locations, frames."""

    files: dict[int, str] = field(default_factory=dict)
    functions: dict[int, str] = field(default_factory=dict)
    locations: dict[int, dict[str, int]] = field(default_factory=dict)
    frames: dict[int, dict[str, int]] = field(default_factory=dict)


@dataclass
class HloModule:
    name: str
    computations: dict[str, Computation]
    entry: str
    stack: StackTables

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


_SIGNIFICANT = re.compile(r'"(?:[^"\\]|\\.)*"|[()\[\]{}]|,')  # quoted strings, brackets, commas


def split_top_level(text: str) -> list[str]:
    """`text` cut at commas outside brackets, braces, parentheses and quotes."""
    parts, depth, start = [], 0, 0
    for match in _SIGNIFICANT.finditer(text):
        token = match.group(0)
        if token in "([{":
            depth += 1
        elif token in ")]}":
            depth -= 1
        elif token == "," and depth == 0:
            parts.append(text[start:match.start()].strip())
            start = match.end()
    tail = text[start:].strip()
    return parts + [tail] if tail else parts


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at `start` (quotes respected)."""
    depth = 0
    for match in _SIGNIFICANT.finditer(text, start):
        token = match.group(0)
        if token in "([{":
            depth += 1
        elif token in ")]}":
            depth -= 1
            if depth == 0:
                return match.start()
    raise ValueError(f"unbalanced brackets in {text[start:start + 60]!r}")


def parse_shape(text: str) -> tuple[HloShape, int]:
    """The shape at the start of `text` and the number of characters it takes."""
    stripped = text.lstrip()
    offset = len(text) - len(stripped)
    if stripped.startswith("("):
        end = _closing(stripped, 0)
        elements = tuple(parse_shape(part)[0] for part in split_top_level(stripped[1:end]))
        return HloShape("tuple", (), elements), offset + end + 1
    match = _ARRAY.match(stripped)
    if match is None:
        raise ValueError(f"expected a shape at {stripped[:40]!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in match.group(2).split(",") if d.strip())
    layout = tuple(int(d) for d in re.findall(r"\d+", (match.group(3) or "").split(":")[0]))
    return HloShape(match.group(1), dims, layout=layout), offset + match.end()


def _parse_instruction(line: str, number: int) -> tuple[Instruction, bool]:
    head = _INSTRUCTION.match(line)
    if head is None:
        raise CaptureError(f"HLO line {number}: cannot read an instruction in {line.strip()[:120]!r}")
    rest = line[head.end():]
    try:
        shape, used = parse_shape(rest)
        rest = rest[used:].lstrip()
        opcode = re.match(r"[\w\-]+", rest).group(0)
        open_at = len(opcode)
        close_at = _closing(rest, open_at)
    except (ValueError, AttributeError) as error:
        raise CaptureError(f"HLO line {number}: {error}") from None
    inside = rest[open_at + 1:close_at]
    if opcode in _PAYLOAD_OPS:
        operands, payload = (), inside.strip()
    else:  # `%a, %b`, or with shapes and without `%`: `f32[8]{0} a, f32[8]{0} b`
        operands, payload = tuple(p.split()[-1].lstrip("%") for p in split_top_level(inside)), ""
    attrs = {}
    for part in split_top_level(rest[close_at + 1:].lstrip(", ")):
        key, _, value = part.partition("=")
        attrs[key.strip()] = value.strip()
    instruction = Instruction(head.group(2), opcode, shape, operands, attrs, payload, number,
                              line.strip())
    return instruction, bool(head.group(1))


def _parse_table_row(line: str, tables: StackTables, section: str) -> None:
    key, _, value = line.strip().partition(" ")
    if section in ("FileNames", "FunctionNames"):
        names = tables.files if section == "FileNames" else tables.functions
        names[int(key)] = value.strip().strip('"')
    else:
        fields = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", value)}
        (tables.locations if section == "FileLocations" else tables.frames)[int(key)] = fields


def parse_module(text: str) -> HloModule:
    """Parse one HLO module's text; a line that cannot be read is a CaptureError naming it."""
    name, entry = "", ""
    computations: dict[str, Computation] = {}
    tables, section = StackTables(), ""
    current: Computation | None = None
    for number, line in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", line)
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if current is None:
            if stripped.startswith("HloModule"):
                name = stripped.split()[1].rstrip(",")
            elif stripped in _SECTIONS:
                section = stripped
            elif section and re.match(r"^\d+\s", stripped):
                _parse_table_row(stripped, tables, section)
            elif (header := _HEADER.match(line)) is not None:
                section = ""
                current = Computation(header.group(2), is_entry=bool(header.group(1)))
            else:
                raise CaptureError(f"HLO line {number}: unexpected text {stripped[:120]!r}")
        elif stripped == "}":
            if not current.root and current.instructions:
                current.root = current.instructions[-1].name
            computations[current.name] = current
            entry = current.name if current.is_entry else entry
            current = None
        else:
            instruction, is_root = _parse_instruction(line, number)
            current.instructions.append(instruction)
            if is_root:
                current.root = instruction.name
    if not entry:
        raise CaptureError("the HLO text has no ENTRY computation")
    return HloModule(name, computations, entry, tables)
