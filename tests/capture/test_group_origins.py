"""Where a collective's process group was made: the `new_group` call and the lines its ranks
came from (a helper that lists a rank grid's rows, a loop over its lists), named with every
collective over that group; torch's own `new_group` is back after the capture."""
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scalify.capture.ranks import capture_rank

LINES = Path(__file__).read_text().splitlines()


def _line(marker: str) -> str:
    number = next(n for n, text in enumerate(LINES, 1) if text.endswith(f"# {marker}"))
    return f"{__file__}:{number}"


def _grid_rows(world: int, width: int) -> list[list[int]]:
    return [list(range(start, start + width)) for start in range(0, world, width)]  # rows listed


class _Reduced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.group = None
        for ranks in _grid_rows(dist.get_world_size(), 2):  # rows taken
            group = dist.new_group(ranks)  # group made
            if dist.get_rank() in ranks:
                self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y, group=self.group)
        return y


def _reduction(rank: int):
    graph = capture_rank(lambda _: _Reduced(), rank, 4, {"x": torch.ones(3)},
                         lambda module, inputs: module(**inputs))
    return next(node for node in graph if node.op == "all_reduce")


def test_a_collective_names_where_its_group_and_its_ranks_were_made():
    made = set(_reduction(2).source.values_from)
    assert {_line("group made"), _line("rows taken"), _line("rows listed")} <= made


def test_new_group_is_torch_s_own_again_after_the_capture():
    _reduction(0)
    assert dist.new_group.__module__ == "torch.distributed.distributed_c10d"
    assert dist.new_group is torch.distributed.distributed_c10d.new_group
