"""Replica groups of HLO collectives in their three spellings, as explicit lists of device ids.

- explicit: `{{0,1},{2,3}}` (`{}` means one group of every device);
- iota: `[2,4]<=[8]` or `[2,4]<=[4,2]T(1,0)`: the ids 0..n-1 reshaped to the bracketed dims on
  the right, transposed, then read as the group shape on the left (one row per group);
- mesh axes: `mesh[x=2,y=4] {y}`: devices laid out row-major on the named axes; each group
  holds the devices that differ only along the braced axes.
"""
from __future__ import annotations

import re

import torch

from ..errors import CaptureError

Groups = tuple[tuple[int, ...], ...]

_IOTA = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
_MESH = re.compile(r"^\w*\[([^\]]*)\]\s*\{([^}]*)\}$")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _explicit(text: str) -> Groups:
    inner = text.strip()[1:-1].strip()
    return tuple(tuple(_ints(group)) for group in re.findall(r"\{([^{}]*)\}", inner))


def _iota(match: re.Match) -> Groups:
    shape, dims = _ints(match.group(1)), _ints(match.group(2))
    ids = torch.arange(int(torch.tensor(dims).prod())).reshape(dims)
    if match.group(3):
        ids = ids.permute(_ints(match.group(3)))
    return tuple(tuple(row) for row in ids.reshape(shape[0], -1).tolist())


def _mesh(match: re.Match) -> Groups:
    axes = [(name.strip(), int(size)) for name, size in
            (part.split("=") for part in match.group(1).split(",") if part.strip())]
    names = [name for name, _ in axes]
    grouped = [name.strip() for name in match.group(2).split(",") if name.strip()]
    unknown = set(grouped) - set(names)
    if unknown:
        raise CaptureError(f"replica groups name unknown mesh axes {sorted(unknown)}")
    ids = torch.arange(int(torch.tensor([s for _, s in axes]).prod())).reshape([s for _, s in axes])
    order = [names.index(n) for n in names if n not in grouped] + [names.index(n) for n in grouped]
    size = int(torch.tensor([axes[names.index(n)][1] for n in grouped] or [1]).prod())
    return tuple(tuple(row) for row in ids.permute(order).reshape(-1, size).tolist())


def parse_replica_groups(text: str, world_size: int) -> Groups:
    """The groups `text` spells; an empty spelling is one group of all `world_size` devices."""
    text = text.strip()
    if (match := _IOTA.match(text)) is not None:
        groups = _iota(match)
    elif (match := _MESH.match(text)) is not None:
        groups = _mesh(match)
    elif text.startswith("{"):
        groups = _explicit(text)
    else:
        raise CaptureError(f"cannot read replica_groups={text}")
    return groups or (tuple(range(world_size)),)


def group_of(groups: Groups, device: int) -> tuple[int, ...]:
    """The group that holds `device`."""
    for group in groups:
        if device in group:
            return group
    raise CaptureError(f"device {device} is in none of the replica groups {groups}")
