"""The lines that set the Python values (offsets, scales, groups) an op's line reads: the last
assignment above the line and those later in a loop around it; attributes wherever the file
assigns them (or `setattr` sets them); tensors, which the graph holds as nodes, are left out,
but a list of tensors names the line that built it and where the attributes it read were set."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import scalify
from scalify import Replicate, Shard
from scalify.capture.ranks import fake_process_group
from scalify.capture.value_sources import value_sources
from scalify.report.render import to_html

LINES = Path(__file__).read_text().splitlines()


def _line(marker: str) -> str:
    number = next(n for n, text in enumerate(LINES, 1) if text.endswith(f"# {marker}"))
    return f"{__file__}:{number}"


def _here(_: object) -> tuple[str, ...]:
    return value_sources(sys._getframe(1))


def _copy_back(buffer: torch.Tensor, sizes: list[int]) -> tuple[str, ...]:
    offset = 0  # offset starts
    for size in sizes:  # size set
        read = _here(buffer[offset:offset + size])
        offset += size  # offset moves
    return read


class _Scaled:
    def __init__(self, heads: int) -> None:
        self.scale = heads ** -0.5  # scale set
        self.weight = torch.ones(2)  # a tensor

    def forward(self, x: torch.Tensor) -> tuple[str, ...]:
        return _here(x * self.weight * self.scale)


class _Kept:
    """Keeps the factor it is built with (as an attention module keeps its scale)."""

    def __init__(self, width: int, factor: float) -> None:
        self.width, self.factor = width, factor  # factor kept

    def forward(self, x: torch.Tensor) -> tuple[str, ...]:
        return _here(x * self.factor)


class _Owner:
    def __init__(self, heads: int) -> None:
        self.scaling = heads ** -0.5  # scaling computed
        self.inner = _Kept(2,
                           self.scaling)  # scaling passed


def test_an_attribute_kept_from_a_parameter_names_the_arguments_passed_for_it():
    """One step further back through the constructor: where the caller computed the scale."""
    assert _Owner(4).inner.forward(torch.ones(2)) == tuple(sorted(
        (_line("factor kept"), _line("scaling computed"), _line("scaling passed")), key=lambda place: int(place.rpartition(":")[2])))


class _Spread:
    def __init__(self) -> None:
        self.offset = 1  # offset kept

    def forward(self, x: torch.Tensor) -> tuple[str, ...]:
        return _here(x.narrow(0,
                              self.offset, 1))


def test_a_call_over_two_lines_names_what_its_second_line_reads():
    assert _Spread().forward(torch.ones(2)) == (_line("offset kept"),)


def _apply(x: torch.Tensor, bias: nn.Parameter | None) -> tuple[str, ...]:  # bias taken
    return _here(x if bias is None else x + bias)


class _Biased(nn.Module):
    def __init__(self, owns_bias: bool) -> None:
        super().__init__()
        self.bias, self.owns_bias = nn.Parameter(torch.ones(2)), owns_bias

    def forward(self, x: torch.Tensor) -> tuple[str, ...]:
        bias = self.bias if self.owns_bias else None  # bias chosen
        return _apply(x, bias=bias)  # bias passed


def test_a_parameter_or_none_passed_in_names_where_the_caller_chose_it():
    """Which rank adds a bias is a Python choice the graph holds no node for."""
    expected = (_line("bias taken"), _line("bias chosen"), _line("bias passed"))
    assert _Biased(True)(torch.ones(2)) == expected
    assert _Biased(False)(torch.ones(2)) == expected


def _norm_of(grads_for_norm: list[torch.Tensor]) -> tuple[str, ...]:
    read = ()
    for grad in grads_for_norm:
        read = _here(grad.norm())
    return read


def _chosen_norm(grads: list[torch.Tensor], counted_here: list[bool]) -> tuple[str, ...]:
    chosen = []
    for grad, counted in zip(grads, counted_here):
        if counted:  # the choice
            chosen.append(grad)  # chosen added
    return _norm_of(chosen)  # chosen passed


def test_a_tensor_a_loop_takes_from_a_list_names_where_the_list_was_filled_and_why():
    """The gradients a norm counts: the caller's list, the line that added to it and the `if`
    that decided which."""
    named = set(_chosen_norm([torch.ones(2), torch.ones(2)], [True, False]))
    assert {_line("the choice"), _line("chosen added"), _line("chosen passed")} <= named


def test_an_offset_names_its_assignments_that_reach_the_line():
    assert _copy_back(torch.zeros(8), [3, 5]) == (_line("offset starts"), _line("size set"),
                                                  _line("offset moves"))


def test_an_attribute_names_where_the_file_assigns_it_and_a_tensor_is_left_out():
    assert _Scaled(4).forward(torch.ones(2)) == (_line("scale set"),)


def _tag(params: list[torch.Tensor]) -> None:
    setattr(params[1], "sequence_parallel", True)  # tagged


def _reduced_together(params: list[torch.Tensor]) -> tuple[str, ...]:
    grads = [p * 2 for p in params if getattr(p, "sequence_parallel", False)]  # chosen
    return _here(torch.cat(grads))


def test_a_list_of_tensors_names_the_line_that_chose_them_and_what_that_line_read():
    params = [nn.Parameter(torch.ones(2)) for _ in range(3)]
    _tag(params)
    assert _reduced_together(params) == (_line("tagged"), _line("chosen"))


def _counted(tensors: list[torch.Tensor], rank: int) -> tuple[str, ...]:
    total, read = torch.zeros(()), ()
    for index, tensor in enumerate(tensors):
        if index > 0 or rank == 0:  # counted where
            while total.numel() > 1:  # a loop that ends above the line
                total = total.sum()
            read = _here(total + tensor.sum())
    return read


def test_the_conditions_around_a_line_are_named_as_deciding_that_it_runs():
    assert _counted([torch.ones(2)], 0) == (_line("counted where"),)


def _matched(kind: str, x: torch.Tensor) -> tuple[str, ...]:
    match kind:
        case "half":
            scale = 0.5
        case _:
            scale = 1.0  # scale in the last case
    return _here(x * scale)


def test_an_assignment_in_a_match_case_is_found():
    assert _matched("half", torch.ones(2)) == (_line("scale in the last case"),)


class _Lazy:
    @property
    def size(self) -> int:
        raise RuntimeError("not built yet")


def test_a_property_that_raises_is_no_value_and_no_error():
    lazy = _Lazy()
    assert _here(lazy.size if False else 0) == ()


def test_a_process_group_names_the_line_that_chose_it():
    with fake_process_group(0, 2):
        group = dist.new_group([0, 1])  # group chosen
        tensor = torch.ones(2)  # a tensor too
        assert _here(dist.all_reduce(tensor, group=group)) == (_line("group chosen"),)


class TwoHeads(nn.Module):
    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(features, 5, bias=False)
        self.b = nn.Linear(features, 5, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class BucketedTwoHeads(TwoHeads):
    """Row-parallel heads whose partial sums are all-reduced in one aligned bucket; copying them
    back, `skip_padding` forgets the alignment when it moves the offset on."""

    def __init__(self, skip_padding: bool) -> None:
        super().__init__(features=4)
        self.skip_padding = skip_padding

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [part.contiguous() for part in super().forward(x)]
        padded = [-(-part.numel() // 8) * 8 for part in parts]
        bucket = torch.zeros(sum(padded), device=x.device)
        offset = 0
        for part, size in zip(parts, padded):
            bucket[offset:offset + part.numel()].copy_(part.flatten())
            offset += size
        dist.all_reduce(bucket)
        offset = 0
        for part, size in zip(parts, padded):
            part.copy_(bucket[offset:offset + part.numel()].view_as(part))
            offset += part.numel() if self.skip_padding else size  # offset moved on
        return tuple(parts)


def _verify_bucketed(skip_padding: bool) -> scalify.Report:
    return scalify.verify_modules(
        reference=TwoHeads(), rank_module_factory=lambda rank: BucketedTwoHeads(
            skip_padding).to("meta"), world_size=2,
        example_inputs={"x": torch.randn(4, 8)}, input_placements={"x": Shard(1)},
        param_placements={"a.weight": Shard(1), "b.weight": Shard(1)},
        output_placements=[Replicate(), Replicate()])


def test_a_bucket_copied_back_at_the_wrong_offset_names_the_line_that_moved_the_offset(tmp_path):
    assert _verify_bucketed(skip_padding=False).verdict == "verified"
    report = _verify_bucketed(skip_padding=True)
    assert report.verdict == "discrepancy"
    file, _, line = _line("offset moved on").rpartition(":")
    assert (file, int(line)) in report.discrepancies[0].lines()
    to_html(report, tmp_path / "report.html")
    shown = (tmp_path / "report.html").read_text()
    assert "values it reads set at" in shown and _line("offset moved on") in shown
