"""Scalar factors that two programs write as different roundings of one real number.

HuggingFace scales attention scores by `head_dim ** -0.5`, Megatron-Core by
`1 / math.sqrt(head_dim)`: both mean 1/sqrt(d), but the two floats may differ in the last
bit (0.3535533905932738 against 0.35355339059327373 for d = 8). The proof reads a factor as
the exact rational its float is, so those two would be different scalings. A rank factor
within `ULPS` units in the last place of a reference factor is taken as that factor; the
report states it (a bug that scales by a wrong factor is off by far more than a rounding).
"""
from __future__ import annotations

import math
from dataclasses import replace

from .graph import Graph

FACTORS = frozenset({"mul_scalar", "div_scalar"})
ULPS = 2


def factors_as_reference(reference: Graph, ranks: list[Graph]) -> tuple[list[Graph], list[str]]:
    """The rank graphs with each factor that is a rounding of a reference factor (and not one
    itself) written as the reference's, and the source lines where one was."""
    written = sorted({factor for node in reference if (factor := _factor(node)) is not None})
    snapped: list[str] = []
    result = []
    for graph in ranks:
        nearest = {node.name: near for node in graph if (factor := _factor(node)) is not None
                   and factor not in written and (near := _nearest(factor, written)) is not None}
        if not nearest:  # (the graph as it is: nothing to copy)
            result.append(graph)
            continue
        out = Graph(outputs=list(graph.outputs), sampled_reads=graph.sampled_reads)
        for node in graph:
            if node.name in nearest:
                node = replace(node, attrs=tuple((k, nearest[node.name] if k == "value" else v)
                                                 for k, v in node.attrs))
                snapped.append(str(node.source) if node.source else node.name)
            out.add(node)
        result.append(out)
    return result, list(dict.fromkeys(snapped))


def _factor(node) -> float | None:
    value = node.attr("value") if node.op in FACTORS else None
    return value if isinstance(value, float) and math.isfinite(value) and value else None


def _nearest(factor: float, written: list[float]) -> float | None:
    """The reference factor within ULPS units in the last place of `factor`, if one is."""
    close = [w for w in written if abs(w - factor) <= ULPS * math.ulp(w)]
    return min(close, key=lambda w: abs(w - factor)) if close else None
