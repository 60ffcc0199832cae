"""Source locations of HLO instructions, from `metadata={...}` in either of its two forms.

- `source_file=... source_line=...`: the file and line. Neuron's Python HLO builders append the
  whole Python stack to the file name after `\\n----\\n` as a list of `file:line` strings,
  outermost first; the location is then the innermost frame that is user code, i.e. not in the
  framework's HLO-building layers (`torch_neuronx`, its `pyhlo` scribe, and the thin op helpers
  of `transformers_neuronx/hlo.py`), and the frames around it are its callers.
- `stack_frame_id=N`: a frame in the module's StackFrames table, whose parents give the callers.
  XLA prints a frame's `parent_frame_id` as the parent's row number plus one (1: no parent),
  as JAX's dumps show: a frame would otherwise often be its own parent.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache

from ..ir.graph import SourceLoc
from .hlo_text import StackTables

_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')
_STACK_SEPARATOR = "\\n----\\n"

# Frames in these paths build HLO rather than describe the model: skipped when choosing the
# innermost user frame.
FRAMEWORK_FRAMES = ("/torch_neuronx/", "/pyhlo/", "transformers_neuronx/hlo.py",
                    "transformers_neuronx/global_debugger.py")


@lru_cache(maxsize=None)  # every device's lowering reads the same metadata
def parse_metadata(text: str) -> dict[str, str]:
    """The fields of a `{key=value ...}` metadata attribute, quotes removed (escapes kept)."""
    return {key: value[1:-1] if value.startswith('"') else value
            for key, value in _FIELD.findall(text)}


def _split_frame(frame: str) -> tuple[str, int]:
    path, _, line = frame.rpartition(":")
    return (path, int(line)) if line.isdigit() else (frame, 0)


@lru_cache(maxsize=None)  # one Python stack serves many instructions and devices
def _from_stack_list(file_field: str, line: int) -> SourceLoc:
    head, _, listed = file_field.partition(_STACK_SEPARATOR)
    try:
        frames = [str(f) for f in ast.literal_eval(listed.replace("\\'", "'"))] if listed else []
    except (ValueError, SyntaxError):
        frames = []
    if not frames:
        return SourceLoc(file=head, line=line)
    users = [f for f in frames if not any(marker in f for marker in FRAMEWORK_FRAMES)] or frames
    innermost = users[-1]
    path, number = _split_frame(innermost)
    callers = tuple(reversed(users[:-1]))
    return SourceLoc(file=path, line=number, callers=callers)


def _from_frame_table(frame_id: int, tables: StackTables) -> SourceLoc:
    chain, seen = [], set()
    while frame_id in tables.frames and frame_id not in seen:
        seen.add(frame_id)
        frame = tables.frames[frame_id]
        location = tables.locations.get(frame.get("file_location_id", 0), {})
        chain.append((tables.files.get(location.get("file_name_id", 0), ""),
                      location.get("line", 0)))
        frame_id = frame.get("parent_frame_id", 1) - 1
    if not chain:
        return SourceLoc()
    (path, line), callers = chain[0], tuple(f"{p}:{n}" for p, n in chain[1:])
    return SourceLoc(file=path, line=line, callers=callers)


def source_of(metadata: str, tables: StackTables) -> SourceLoc:
    """The source location an instruction's metadata records (empty when it records none)."""
    fields = parse_metadata(metadata)
    if "stack_frame_id" in fields:
        return _from_frame_table(int(fields["stack_frame_id"]), tables)
    if "source_file" in fields:
        return _from_stack_list(fields["source_file"], int(fields.get("source_line", 0)))
    return SourceLoc()
