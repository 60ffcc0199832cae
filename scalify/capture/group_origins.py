"""Where each process group was made. A collective over the wrong ranks is a bug in the
arithmetic that listed them (a rank grid cut along the wrong axis), lines away from the
collective; the capture names the line that made the group, and the lines its ranks came from,
with every collective over it."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .value_sources import made_at

_SKIPPED = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


class GroupOrigins:
    """`file:line`s by a group's global ranks, for the groups made while `recording()`."""

    def __init__(self) -> None:
        self._lines: dict[tuple[int, ...], tuple[str, ...]] = {}

    def of(self, ranks: tuple[int, ...]) -> tuple[str, ...]:
        return self._lines.get(tuple(ranks), ())

    @contextmanager
    def recording(self) -> Iterator[None]:
        """`dist.new_group` records where it was called, then makes the group."""
        made = c10d.new_group

        def new_group(*args: Any, **kwargs: Any) -> Any:
            group = made(*args, **kwargs)
            frame = user_frame(sys._getframe(1))
            if frame is not None and isinstance(group, dist.ProcessGroup):
                ranks = tuple(dist.get_process_group_ranks(group))
                self._lines[ranks] = tuple(dict.fromkeys((*self.of(ranks), *made_at(frame))))
            return group

        dist.new_group = c10d.new_group = new_group
        try:
            yield
        finally:
            dist.new_group = c10d.new_group = made


def user_frame(frame: Any) -> Any:
    """The innermost frame outside torch and this package."""
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIPPED)
                                 or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
    return frame
