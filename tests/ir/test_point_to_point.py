"""Send/recv across ranks: the k-th send from a to b is the k-th recv on b from a, and the
received tensor is the sent one in the merged graph."""
import pytest

from scalify.errors import ScalifyError
from scalify.ir.distributed import link_point_to_point, merge_ranks
from scalify.ir.graph import Graph, Node, SourceLoc
from scalify.ir.symmetry import symbolic_program

SHAPE = (2, 3)


def _placeholder(graph: Graph, name: str) -> None:
    graph.add(Node(name, "placeholder", (), (("target", name),), SHAPE, "float32"))


def _sender(*sends: str, shape: tuple[int, ...] = SHAPE) -> Graph:
    """Rank 0: doubles x, sends the named values to rank 1, in order."""
    graph = Graph(outputs=[])
    _placeholder(graph, "x")
    graph.add(Node("y", "mul_scalar", ("x",), (("value", 2.0),), SHAPE, "float32"))
    for k, value in enumerate(sends):
        graph.add(Node(f"s{k}", "send", (value,), (("peer", 1), ("tag", 0)), shape, "float32",
                       SourceLoc("stage0.py", 10 + k)))
    return graph


def _receiver(count: int) -> Graph:
    """Rank 1: receives `count` tensors from rank 0 and adds them up."""
    graph = Graph(outputs=[f"v{count - 1}" if count else "x"])
    _placeholder(graph, "x")
    for k in range(count):
        graph.add(Node(f"r{k}", "recv", (), (("peer", 0), ("shape", SHAPE), ("tag", 0)), SHAPE,
                       "float32", SourceLoc("stage1.py", 20 + k)))
        previous = f"v{k - 1}" if k else "x"
        graph.add(Node(f"v{k}", "add", (previous, f"r{k}"), (), SHAPE, "float32"))
    return graph


def test_the_kth_recv_is_the_kth_send():
    links = link_point_to_point([_sender("x", "y"), _receiver(2)])
    assert links == {"r1/r0": "r0/x", "r1/r1": "r0/y"}


def test_merged_graph_reads_the_senders_tensor_and_drops_send_and_recv():
    merged = merge_ranks([_sender("y"), _receiver(1)])
    assert merged.graph["r1/v0"].inputs == ("r1/x", "r0/y")
    assert not any(node.op in ("send", "recv") for node in merged.graph)
    assert merged.rank_outputs == [[], ["r1/v0"]]


def test_a_send_without_its_recv_names_the_line():
    with pytest.raises(ScalifyError, match=r"stage0.py:11: send #1 from rank 0 to rank 1 .*hang"):
        merge_ranks([_sender("x", "y"), _receiver(1)])


def test_a_recv_without_its_send_names_the_line():
    with pytest.raises(ScalifyError, match=r"stage1.py:21: recv #1 on rank 1 from rank 0 .*hang"):
        merge_ranks([_sender("x"), _receiver(2)])


def test_a_shape_mismatch_names_both_lines():
    with pytest.raises(ScalifyError, match=r"stage1.py:20: recv #0 .* expects shape \[2, 3\] but "
                                           r"rank 0 sends \[3, 2\] at stage0.py:10"):
        merge_ranks([_sender("x", shape=(3, 2)), _receiver(1)])


def test_point_to_point_programs_are_not_symbolic():
    program, why = symbolic_program([_sender("x"), _receiver(1)])
    assert program is None and "point-to-point" in why


def test_a_received_tensor_returned_as_an_output_is_the_sent_one():
    receiver = _receiver(1)
    receiver.outputs = ["r0"]
    merged = merge_ranks([_sender("y"), receiver])
    assert merged.rank_outputs == [[], ["r0/y"]]


def test_a_recv_whose_value_goes_unused_still_pairs_with_its_send():
    """Ring attention's last block is received and never read on a rank it is masked on."""
    receiver = _receiver(2)
    receiver.outputs = ["v0"]
    merged = merge_ranks([_sender("x", "y").pruned(), receiver.pruned()])
    assert merged.rank_outputs == [[], ["r1/v0"]]


def _ring_member(rank: int, world: int, steps: int) -> Graph:
    """Sends x to rank + 1, then forwards each tensor it receives from rank - 1, `steps` times
    (a ring passing blocks along); returns the sum of what it received."""
    graph = Graph(outputs=[f"v{steps - 1}"])
    _placeholder(graph, "x")
    held, total = "x", None
    for k in range(steps):
        graph.add(Node(f"s{k}", "send", (held,), (("peer", (rank + 1) % world), ("tag", 0)),
                       SHAPE, "float32", SourceLoc(f"rank{rank}.py", 10 + k)))
        graph.add(Node(f"r{k}", "recv", (), (("peer", (rank - 1) % world), ("shape", SHAPE),
                                             ("tag", 0)), SHAPE, "float32"))
        graph.add(Node(f"v{k}", "add", (total or "x", f"r{k}"), (), SHAPE, "float32"))
        held, total = f"r{k}", f"v{k}"
    return graph


def test_a_forwarded_tensor_is_the_first_senders():
    merged = merge_ranks([_ring_member(rank, 3, 2) for rank in range(3)])
    assert merged.graph["r0/v0"].inputs == ("r0/x", "r2/x")
    assert merged.graph["r0/v1"].inputs == ("r0/v0", "r1/x")  # rank 2 forwarded rank 1's x


def test_the_sends_that_carried_a_tensor_are_kept_for_the_report():
    """Rank 1 sends its x, rank 2 forwards it: both lines are where rank 0 got it from."""
    merged = merge_ranks([_ring_member(rank, 3, 2) for rank in range(3)])
    assert merged.sent_at["r1/x"] == (SourceLoc("rank1.py", 10), SourceLoc("rank2.py", 11))
