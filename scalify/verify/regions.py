"""Regions: the numbered layer an op belongs to, on the reference and on the ranks.

Windows and memoized segments are cut per region, so a rank op is looked for in the layer of
the reference op it should match. The two programs may name their layers differently
(HuggingFace's `model.layers.3` against Megatron-Core's `decoder.layers.3`): a rank layer stack
whose name the reference does not use is matched, index by index, to the reference's one stack
of that kind the ranks do not use.
"""
from __future__ import annotations

import re
from typing import Iterable

_LAYER = re.compile(r"^(.*?)\.(\d+)(\.|$)")


def region_of(module: str) -> str:
    """The layer a module path belongs to (`model.layers.3`), or "" outside numbered layers."""
    match = _LAYER.match(module)
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def matched_regions(ref_regions: Iterable[str], rank_regions: Iterable[str]) -> dict[str, str]:
    """Each rank region -> the reference region it is compared with: itself where the reference
    has it; else, when the ranks have exactly one layer stack the reference lacks and the
    reference exactly one the ranks lack, and the ranks' indices are among the reference's, the
    reference's layer of the same index."""
    ref_stacks, rank_stacks = _stacks(ref_regions), _stacks(rank_regions)
    renamed: dict[str, str] = {}
    only_ref = [s for s in ref_stacks if s not in rank_stacks]
    only_rank = [s for s in rank_stacks if s not in ref_stacks]
    if len(only_ref) == 1 and len(only_rank) == 1 and (
            rank_stacks[only_rank[0]] <= ref_stacks[only_ref[0]]):
        renamed = {f"{only_rank[0]}.{i}": f"{only_ref[0]}.{i}" for i in rank_stacks[only_rank[0]]}
    return {region: renamed.get(region, region) for region in set(rank_regions)}


def _stacks(regions: Iterable[str]) -> dict[str, set[str]]:
    """Layer stack name -> the indices of its layers."""
    stacks: dict[str, set[str]] = {}
    for region in regions:
        if region:
            stack, index = region.rsplit(".", 1)
            stacks.setdefault(stack, set()).add(index)
    return stacks
