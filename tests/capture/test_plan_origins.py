"""Where a module's tensor-parallel plan entry was written: every op of a module that
`parallelize_module` gave a style names the plan entry's line (a dict written beside the call,
or a style passed alone), and a rowwise output left Partial is caught with its entry named;
the styles are torch's own again after the capture."""
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import scalify
from scalify.capture.ranks import capture_rank

LINES = Path(__file__).read_text().splitlines()
WORLD, HIDDEN = 2, 8


def _line(marker: str) -> str:
    number = next(n for n, text in enumerate(LINES, 1) if text.endswith(f"# {marker}"))
    return f"{__file__}:{number}"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _planned(down_output=Replicate()) -> MLP:
    model = MLP()
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {
        "up": ColwiseParallel(),  # up's entry
        "down": RowwiseParallel(output_layouts=down_output),  # down's entry
    }
    return parallelize_module(model, mesh, plan)


def _alone() -> MLP:
    model = MLP()
    mesh = init_device_mesh("cpu", (WORLD,))
    parallelize_module(model.up, mesh, ColwiseParallel())  # up alone
    parallelize_module(model.down, mesh, RowwiseParallel())  # down alone
    return model


def _sources(factory) -> dict[str, set[str]]:
    graph = capture_rank(lambda _: factory(), 0, WORLD, {"x": torch.ones(3, HIDDEN)},
                         lambda module, inputs: module(**inputs))
    found: dict[str, set[str]] = {}
    for node in graph:
        found.setdefault(node.source.module, set()).update(node.source.values_from)
    return found


def test_every_op_of_a_planned_module_names_its_plan_entry():
    sources = _sources(_planned)
    assert _line("up's entry") in sources["up"] and _line("down's entry") in sources["down"]
    assert _line("down's entry") not in sources["up"]


def test_a_style_passed_alone_names_its_call():
    sources = _sources(_alone)
    assert _line("up alone") in sources["up"] and _line("down alone") in sources["down"]


def test_a_rowwise_output_left_partial_is_caught_with_its_plan_entry_named():
    report = scalify.verify_modules(
        MLP(), lambda rank: _planned(down_output=Partial()), WORLD,
        {"x": torch.randn(3, HIDDEN)}, numeric=True)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    assert (__file__, int(_line("down's entry").rsplit(":", 1)[1])) in report.discrepancies[0].lines()


def test_the_styles_are_torch_s_own_again_after_the_capture():
    _sources(_planned)
    assert RowwiseParallel._apply.__qualname__ == "RowwiseParallel._apply"
    assert ColwiseParallel._apply.__module__ == "torch.distributed.tensor.parallel.style"
