"""The neutral graph IR: frozen nodes in topological order, each with its source location."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(frozen=True)
class SourceLoc:
    """Where a node came from: file, line, the code on that line, the module path, and the
    enclosing user frames (`file:line`, innermost first) that called into that line."""

    file: str = ""
    line: int = 0
    code: str = ""
    module: str = ""
    callers: tuple[str, ...] = ()
    backward: bool = False  # computed by the backward pass of the op at this line
    scaled_at: tuple[str, ...] = ()  # `file:line`s whose scalar factors were moved into this op
    passed_at: tuple[str, ...] = ()  # `file:line`s that passed this value on unchanged
    values_from: tuple[str, ...] = ()  # `file:line`s that set the Python values this line reads

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "<unknown>"
        return f"{where} (backward)" if self.backward else where


@dataclass(frozen=True)
class Node:
    """One core op application. `inputs` name tensor-valued nodes; `attrs` hold everything else."""

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...]
    dtype: str
    source: SourceLoc = SourceLoc()

    def attr(self, key: str, default: Any = None) -> Any:
        for name, value in self.attrs:
            if name == key:
                return value
        return default


@dataclass
class Graph:
    """A program: nodes in topological order and the names of its outputs."""

    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # `file:line` of reads of its data fixed to a sampled run's values (capture/sampled_reads.py):
    # the program holds for inputs read that way only
    sampled_reads: tuple[str, ...] = ()
    _index: dict[str, Node] = field(default_factory=dict, repr=False)

    def add(self, node: Node) -> Node:
        index = self._index
        for name in node.inputs:
            if name not in index:
                missing = [name for name in node.inputs if name not in index]
                raise ValueError(f"node {node.name} ({node.op}) uses undefined inputs {missing}")
        if node.name in index:
            raise ValueError(f"node name {node.name} defined twice")
        self.nodes.append(node)
        self._index[node.name] = node
        return node

    def __getitem__(self, name: str) -> Node:
        return self._index[name]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def placeholders(self) -> list[Node]:
        return [node for node in self.nodes if node.op == "placeholder"]

    def users(self) -> dict[str, list[str]]:
        """For each node name, the names of the nodes that consume it (in order)."""
        result: dict[str, list[str]] = {node.name: [] for node in self.nodes}
        for node in self.nodes:
            for name in dict.fromkeys(node.inputs):
                result[name].append(node.name)
        return result

    def pruned(self) -> Graph:
        """The graph without nodes that no output, send or recv depends on (placeholders are
        kept; a recv whose value goes unused still pairs with its peer's send)."""
        live = set(self.outputs) | {node.name for node in self.nodes if node.op in ("send", "recv")}
        for node in reversed(self.nodes):
            if node.name in live:
                live.update(node.inputs)
        kept = Graph(outputs=list(self.outputs))
        for node in self.nodes:
            if node.name in live or node.op == "placeholder":
                kept.add(node)
        return kept
