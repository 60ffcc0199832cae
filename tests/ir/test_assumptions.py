"""Assumed input ranges, and the ranges ops bound on their own, decide comparisons before the
proof, and only where they may."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scalify.capture.tracer import capture
from scalify.ir.assumptions import ValueRange, assuming, value_ranges
from scalify.ir.graph import Graph, Node
from scalify.verify.numeric import run_graph

ROWS, CLASSES = 6, 5


class Loss(nn.Module):
    def forward(self, logits, labels):
        return F.cross_entropy(logits, labels)


def _loss_graph() -> Graph:
    inputs = {"logits": torch.randn(ROWS, CLASSES), "labels": torch.randint(0, CLASSES, (ROWS,))}
    module = Loss()
    return capture(module, lambda: module(**inputs), inputs)


def test_the_ignore_index_drops_out_and_the_numbers_stay() -> None:
    graph = _loss_graph()
    [assumed] = assuming([graph], {"labels": ValueRange(0, CLASSES - 1)})
    assert {"eq_scalar", "ne_scalar", "masked_fill"}.isdisjoint(n.op for n in assumed)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        env = {"logits": torch.randn(ROWS, CLASSES, generator=generator, dtype=torch.float64),
               "labels": torch.randint(0, CLASSES, (ROWS,), generator=generator)}
        before = run_graph(graph, env)[graph.outputs[0]]
        after = run_graph(assumed, env)[assumed.outputs[0]]
        torch.testing.assert_close(before, after)


def test_a_range_holding_the_ignore_index_decides_nothing() -> None:
    graph = _loss_graph()
    [same] = assuming([graph], {"labels": ValueRange(-100, CLASSES - 1)})
    assert [n.op for n in same] == [n.op for n in graph]


def _node(name: str, op: str, inputs: tuple[str, ...], size: tuple[int, ...], dtype: str = "int64",
          **attrs) -> Node:
    return Node(name, op, inputs, tuple(sorted(attrs.items())), size, dtype)


def _broadcast_rank(root: bool) -> Graph:
    """Rank 0 broadcasts its labels (a block of an all_gather); every rank tests them. Unless
    `root`, the rank brings an input of its own, which nothing bounds."""
    graph = Graph()
    graph.add(_node("labels", "placeholder", (), (4,), kind="input", target="labels", shape=(4,)))
    graph.add(_node("own", "placeholder", (), (4,), kind="input", target="own", shape=(4,)))
    graph.add(_node("gathered", "all_gather", ("labels" if root else "own",), (8,), group=(0, 1),
                    shape=(8,)))
    graph.add(_node("root", "slice", ("gathered",), (4,), dim=0, start=0, end=4))
    graph.add(_node("ignored", "eq_scalar", ("root",), (4,), "bool", value=-100))
    graph.outputs = ["ignored"]
    return graph


def test_ranges_cross_a_gather_only_when_every_member_brings_one() -> None:
    graphs = [_broadcast_rank(True), _broadcast_rank(True)]
    ranges = value_ranges(graphs, {"labels": ValueRange(0, 9)})
    assert ranges[1]["root"] == ValueRange(0, 9)
    assert all(graph["ignored"].op == "full" for graph in assuming(graphs, {"labels": ValueRange(0, 9)}))
    mixed = [_broadcast_rank(True), _broadcast_rank(False)]  # the other rank's is unbounded
    assert "gathered" not in value_ranges(mixed, {"labels": ValueRange(0, 9)})[0]


class CapacityMask(nn.Module):
    """DeepSpeed's top-1 gate: a token is kept while its slot (a running count of its expert's
    one-hot rows, minus one) is below the capacity."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def forward(self, logits):
        mask = F.one_hot(torch.argmax(logits, dim=1), num_classes=logits.shape[1])
        locations = torch.cumsum(mask, dim=0) - 1
        return logits * (mask * torch.lt(locations, self.capacity)).type_as(logits)


def _capacity_graph(capacity: int) -> Graph:
    inputs = {"logits": torch.randn(ROWS, CLASSES)}
    module = CapacityMask(capacity)
    return capture(module, lambda: module(**inputs), inputs)


def test_a_capacity_no_slot_reaches_is_decided_on_every_input() -> None:
    graph = _capacity_graph(ROWS)
    [decided] = assuming([graph], {})
    assert "lt_scalar" in {n.op for n in graph} and "lt_scalar" not in {n.op for n in decided}
    logits = {"logits": torch.randn(ROWS, CLASSES)}
    torch.testing.assert_close(run_graph(decided, logits)[decided.outputs[0]],
                               run_graph(graph, logits)[graph.outputs[0]])


def test_a_capacity_a_slot_may_reach_stays_a_comparison() -> None:
    graph = _capacity_graph(ROWS - 1)
    [kept] = assuming([graph], {})
    assert "lt_scalar" in {n.op for n in kept}


def test_orderings_are_not_decided_from_assumed_ranges() -> None:
    graph = Graph()
    graph.add(_node("ids", "placeholder", (), (4,), kind="input", target="ids", shape=(4,)))
    graph.add(_node("below", "lt_scalar", ("ids",), (4,), "bool", value=10))
    graph.outputs = ["below"]
    [kept] = assuming([graph], {"ids": ValueRange(0, 9)})
    assert kept["below"].op == "lt_scalar"


class _ShardLookup(nn.Module):
    """vLLM's local ids (`where(in range, ids - start, 0)`), clamped into the rank's 4 rows."""

    def forward(self, ids):
        valid = (ids >= 4) & (ids < 8)
        local = torch.where(valid, ids - 4, 0)
        return local.clamp(0, 3)


def test_a_shards_local_ids_lie_in_its_rows_so_a_clamp_into_them_drops_out() -> None:
    """Where the mask keeps ids, 4 <= ids < 8, so ids - 4 lies in [0, 3]; elsewhere it is 0."""
    inputs = {"ids": torch.randint(0, 12, (2, 6))}
    module = _ShardLookup()
    graph = capture(module, lambda: module(**inputs), inputs)
    [decided] = assuming([graph], {})
    def clamps(g: Graph) -> list[Node]:
        return [n for n in g if n.op in ("lt_scalar", "gt_scalar")
                and g[n.inputs[0]].op == "masked_fill"]

    assert len(clamps(graph)) == 2 and not clamps(decided)
    ids = {"ids": torch.arange(-3, 15).reshape(3, 6)}  # (every input, not only the example's)
    assert torch.equal(run_graph(decided, ids)[decided.outputs[0]],
                       run_graph(graph, ids)[graph.outputs[0]])


def test_a_fill_beside_unrelated_tests_keeps_its_inputs_range_only() -> None:
    graph = Graph()
    graph.add(_node("ids", "placeholder", (), (4,), "int64", kind="input", target="ids", shape=(4,)))
    graph.add(_node("other", "placeholder", (), (4,), "int64", kind="input", target="other",
                    shape=(4,)))
    graph.add(_node("low", "lt_scalar", ("other",), (4,), "bool", value=0))
    graph.add(_node("kept", "masked_fill", ("ids", "low"), (4,), "int64", value=0))
    graph.outputs = ["kept"]
    assert "kept" not in value_ranges([graph], {})[0]
    assert value_ranges([graph], {"ids": ValueRange(2, 5)})[0]["kept"] == ValueRange(0, 5)


def test_a_fill_whose_mask_keeps_no_value_in_range_has_no_range() -> None:
    """`4 <= ids < 2` never holds: no position keeps the input (an empty range, not an error)."""
    graph = Graph()
    graph.add(_node("ids", "placeholder", (), (4,), "int64", kind="input", target="ids", shape=(4,)))
    graph.add(_node("low", "lt_scalar", ("ids",), (4,), "bool", value=4))
    graph.add(_node("high", "ge_scalar", ("ids",), (4,), "bool", value=2))
    graph.add(_node("out", "bitwise_or", ("low", "high"), (4,), "bool"))
    graph.add(_node("kept", "masked_fill", ("ids", "out"), (4,), "int64", value=0))
    graph.outputs = ["kept"]
    assert "kept" not in value_ranges([graph], {})[0]
