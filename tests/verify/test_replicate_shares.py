"""A replicated value added to a partial sum, a share on each rank: DTensor adds a Replicate bias
to the Partial product of a row-parallel matmul by giving each rank the bias over the world
size, and the reduce sums the shares back. That verifies on 2-D and 3-D activations; a bias
added whole on every rank before the reduce is caught at its line."""
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import scalify

HIDDEN, FFN, WORLD = 8, 16, 2
PLAN = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1),
        "fc2.bias": Replicate()}


class MLP(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, ffn), nn.Linear(ffn, HIDDEN)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class DTensorMLP(MLP):
    """Local shards wrapped as DTensors: the bias add of the Partial product is DTensor's."""

    def __init__(self) -> None:
        super().__init__(FFN // WORLD)
        self.mesh = init_device_mesh("cpu", (WORLD,))

    def forward(self, x):
        local = dict(self.named_parameters())
        p = {name: DTensor.from_local(local[name], self.mesh, [placement])
             for name, placement in PLAN.items()}
        h = F.gelu(DTensor.from_local(x, self.mesh, [Replicate()]) @ p["fc1.weight"].t()
                   + p["fc1.bias"])
        return (h @ p["fc2.weight"].t() + p["fc2.bias"]).full_tensor()


class WholeBiasMLP(MLP):
    """The bias added whole to each rank's part before the reduce: summed twice."""

    def __init__(self) -> None:
        super().__init__(FFN // WORLD)

    def forward(self, x):
        out = F.gelu(self.fc1(x)) @ self.fc2.weight.t()
        out = out + self.fc2.bias
        dist.all_reduce(out)
        return out


def _verify(rank_module, shape):
    return scalify.verify_modules(
        reference=MLP(), rank_module_factory=lambda rank: rank_module(),
        world_size=WORLD, example_inputs={"x": torch.randn(*shape)},
        param_placements={name: scalify.Shard(p.dim) for name, p in PLAN.items()
                          if isinstance(p, Shard)},
        output_placements=[scalify.Replicate()], numeric=True)


@pytest.mark.parametrize("shape", [(4, HIDDEN), (2, 3, HIDDEN)], ids=["2-D", "3-D"])
def test_a_replicate_bias_added_to_a_partial_dtensor_verifies(shape):
    report = _verify(DTensorMLP, shape)
    assert report.verdict == "verified" and report.numeric["agrees"]


def test_a_whole_bias_on_every_rank_before_the_reduce_is_caught_at_its_line():
    report = _verify(WholeBiasMLP, (4, HIDDEN))
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    lines, start = inspect.getsourcelines(WholeBiasMLP.forward)
    bias_line = start + next(i for i, text in enumerate(lines) if "out + self.fc2.bias" in text)
    assert (inspect.getsourcefile(WholeBiasMLP), bias_line) in report.discrepancies[0].lines()
