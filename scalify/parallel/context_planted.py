"""Planted context-parallel bugs: each swaps one step of a rank's blockwise attention.

The line that does the wrong thing carries `# planted: <name>`; a verifier should point at it.
"""
from __future__ import annotations

import torch

from scalify.errors import ConfigError
from scalify.parallel.context import ContextParts, Partial, SequenceLayout


def _softmax_step_without_merge(result: Partial | None, scores: torch.Tensor,
                                values: torch.Tensor) -> Partial:
    """Each block normalised on its own keys and the block outputs added up."""
    block_out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32), values)  # planted: cp-local-softmax-no-merge
    return (block_out if result is None else result[0] + block_out), block_out


def _mask_from_local_positions(scores: torch.Tensor, rows: torch.Tensor, layout: SequenceLayout,
                               query_chunk: int, key_chunk: int) -> torch.Tensor:
    """Every key chunk masked as if its keys sat at the query chunk's own positions."""
    return scores + layout.piece(rows, 3, query_chunk)  # planted: cp-mask-local-positions


CONTEXT_PLANTED = {
    "cp-local-softmax-no-merge": ContextParts(attend=_softmax_step_without_merge),
    "cp-mask-local-positions": ContextParts(mask=_mask_from_local_positions),
}


def context_parts(planted_bug: str | None) -> ContextParts:
    """The blockwise-attention steps, with `planted_bug` planted if given."""
    if planted_bug is None:
        return ContextParts()
    if planted_bug not in CONTEXT_PLANTED:
        raise ConfigError(f"planted bug {planted_bug!r} does not apply to context parallelism; "
                          f"known: {', '.join(CONTEXT_PLANTED)}")
    return CONTEXT_PLANTED[planted_bug]
