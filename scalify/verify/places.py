"""Where a value's elements lie in a source when equal elements lie at several places.

Element numbering gives equal values equal ids, so a value with repeated elements (the zeros of
`x * sin(0)` in a rotary embedding, a constant row) can be read from many places of the tensors
that hold it. Taking the first place of each scatters those reads and no movement term lays them
out. `affine_places` instead finds places that move by a fixed step along each dim of the value,
the shape every movement term has: the steps are read off the elements held at one place only and,
where no such element tells a step, continued from the steps around it; the places are then
checked element by element against the source, so what it returns holds exactly.
"""
from __future__ import annotations

import torch

_UNKNOWN = -1


def affine_places(ids: torch.Tensor, source_ids: torch.Tensor) -> torch.Tensor | None:
    """Indices into the flat `source_ids`, of `ids`'s shape, holding `ids` and affine in each dim
    of it (a step per index along each dim), or None when no such places are found."""
    source = source_ids.reshape(-1)
    single = _single_places(ids, source)
    known = single != _UNKNOWN
    if not bool(known.any()):
        return None
    steps = []
    for dim in range(ids.dim()):
        step = _steps(single.movedim(dim, -1), known.movedim(dim, -1))
        if step is None:
            return None
        steps.append(step)
    places = torch.zeros(ids.shape, dtype=torch.int64)
    for dim, step in enumerate(steps):
        shape = [1] * ids.dim()
        shape[dim] = ids.shape[dim]
        places = places + step.reshape(shape)
    offsets = (single - places)[known]
    if not bool((offsets == offsets[0]).all()):
        return None
    places = places + offsets[0]
    if bool((places < 0).any()) or bool((places >= source.numel()).any()):
        return None
    return places if torch.equal(source[places], ids) else None


def _single_places(ids: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Each element's place in `source` where it is held at exactly one, else _UNKNOWN."""
    order = torch.argsort(source, stable=True)
    ordered = source[order]
    flat = ids.reshape(-1)
    first = torch.searchsorted(ordered, flat)
    last = torch.searchsorted(ordered, flat, right=True)
    once = (last - first) == 1
    places = torch.full_like(flat, _UNKNOWN)
    places[once] = order[first[once]]
    return places.reshape(ids.shape)


def _steps(single: torch.Tensor, known: torch.Tensor) -> torch.Tensor | None:
    """The step of each index of the last dim (index 0 steps by 0): differences between places
    known on one line, alike on every line; steps no line tells are continued arithmetically."""
    size = single.shape[-1]
    lines = single.reshape(-1, size)
    held = known.reshape(-1, size)
    base = int(held.sum(0).argmax())
    rise: list[int | None] = []
    for index in range(size):
        both = held[:, base] & held[:, index]
        if not bool(both.any()):
            rise.append(None)
            continue
        differences = lines[both, index] - lines[both, base]
        if not bool((differences == differences[0]).all()):
            return None
        rise.append(int(differences[0]))
    if any(r is None for r in rise):
        rise = _continued(rise, base)
        if rise is None:
            return None
    return torch.tensor(rise, dtype=torch.int64) - rise[0]


def _continued(rise: list[int | None], base: int) -> list[int] | None:
    """`rise` with its gaps filled, when the known entries move by one stride per index."""
    known = [(index, r) for index, r in enumerate(rise) if r is not None]
    others = [(index, r) for index, r in known if index != base]
    if not others:
        return None
    index, value = others[0]
    if value % (index - base):
        return None
    stride = value // (index - base)
    if any(r != (i - base) * stride for i, r in known):
        return None
    return [(i - base) * stride for i in range(len(rise))]
