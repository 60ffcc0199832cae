"""Ops kept as uninterpreted functions, integer arithmetic and general gathers and scatters
capture, and the captured graph computes what PyTorch computes (run by the IR interpreter,
whose shape rules must agree with the values)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scalify.capture.tracer import capture
from scalify.ir.ops import UNINTERPRETED
from scalify.verify.numeric import run_graph

_gen = torch.Generator().manual_seed(0)
IMAGE = torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=_gen)
WEIGHT = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=_gen)
ROWS = torch.randn(5, 4, dtype=torch.float64, generator=_gen)
INDEX = torch.tensor([[0, 2, 1, 3], [4, 0, 0, 1]])
NUMBERS = torch.tensor([[-7, 7, 5, -5], [9, -9, 0, 1]])

CASES = {
    "conv2d": (lambda x, w: F.conv2d(x, w, padding=1, stride=2), (IMAGE, WEIGHT)),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x[:, :, :3], w.transpose(0, 1)[:3]),
                         (IMAGE, WEIGHT)),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 2), (IMAGE,)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x[0], 3, stride=1, padding=1), (IMAGE,)),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2, ceil_mode=True), (IMAGE,)),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (4, 5)), (IMAGE,)),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, (2, 4, 5)), (IMAGE,)),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, stride=2, return_indices=True), (IMAGE,)),
    "cdist": (lambda a: torch.cdist(a, a[:3]), (ROWS,)),
    "pdist": (lambda a: F.pdist(a), (ROWS,)),
    "rfft and irfft": (lambda a: torch.fft.irfft(torch.fft.rfft(a), n=4), (ROWS,)),
    "sort": (lambda a: torch.sort(a, dim=0, descending=True), (ROWS,)),
    "embedding_bag": (lambda w: F.embedding_bag(torch.tensor([0, 2, 4, 1]), w,
                                                torch.tensor([0, 1]), mode="mean"), (ROWS,)),
    "gather along dim 0": (lambda a: a.gather(0, INDEX), (ROWS,)),
    "scatter": (lambda a: a.scatter(0, INDEX[:, :3].flip(1), a[:2, :3]), (ROWS,)),
    "scatter a value": (lambda a: a.scatter(1, INDEX[:, :2] % 4, 2.5), (ROWS,)),
    "scatter_add": (lambda a: a.scatter_add(0, INDEX, a[:2]), (ROWS,)),
    "scatter_reduce": (lambda a: a.scatter_reduce(0, INDEX, a[:2], "amax"), (ROWS,)),
    "index_put": (lambda a: a.index_put((torch.tensor([1, 3]),), a[0:2] * 2), (ROWS,)),
    "index_put accumulate": (lambda a: a.index_put((torch.tensor([1, 1]), torch.tensor([0, 0])),
                                                   a[0, :2], accumulate=True), (ROWS,)),
    "masked_scatter": (lambda a: a.masked_scatter(a > 0, a * 3), (ROWS,)),
    "prod": (lambda a: a.prod(0) + a.prod(), (ROWS,)),
    "bitwise_xor": (lambda n: (n ^ (n * 3)) ^ 6, (NUMBERS,)),
    "floor division": (lambda n: torch.div(n, n.flip(0).clamp(min=1), rounding_mode="floor")
                       + n // 4, (NUMBERS,)),
    "truncating division": (lambda n: torch.div(n, 3, rounding_mode="trunc"), (NUMBERS,)),
    "embedding gradient with padding and frequency scaling": (
        lambda g: torch.ops.aten.embedding_dense_backward(g[:4], torch.tensor([0, 2, 2, 3]), 6, 0,
                                                          True), (ROWS,)),
}


def _capture(fn, tensors: tuple[torch.Tensor, ...], grad: bool = False):
    inputs = {f"x{i}": t for i, t in enumerate(tensors)}
    return capture(nn.Module(), lambda: fn(*tensors), inputs, grad=grad), inputs


def _assert_computes(fn, tensors, grad: bool = False):
    expected = fn(*tensors)
    expected = expected if isinstance(expected, tuple) else (expected,)
    graph, inputs = _capture(fn, tensors, grad)
    assert not [n for n in graph if n.op == "opaque"]
    values = run_graph(graph, inputs)
    for node in graph:
        assert tuple(values[node.name].shape) == node.shape, node
    for output, want in zip(graph.outputs, expected):
        assert torch.allclose(values[output], want.to(values[output].dtype)), output
    return graph


@pytest.mark.parametrize("name", CASES)
def test_captured_graph_computes_what_torch_computes(name):
    _assert_computes(*CASES[name])


def test_convolution_and_pooling_lower_to_uninterpreted_ops():
    graph, _ = _capture(lambda x, w: F.avg_pool2d(F.conv2d(x, w), 2), (IMAGE, WEIGHT))
    assert [n.op for n in graph if n.op in UNINTERPRETED] == ["convolution", "avg_pool2d"]


def test_gradients_through_convolution_and_pooling():
    weight = WEIGHT.clone().requires_grad_()

    def step(x, w):
        loss = F.adaptive_avg_pool2d(F.avg_pool2d(F.conv2d(x, w), 2), 1).sum()
        return torch.autograd.grad(loss, w)

    graph = _assert_computes(step, (IMAGE, weight), grad=True)
    assert {"convolution_backward", "avg_pool2d_backward"} <= {n.op for n in graph}


def test_a_gather_along_the_last_dim_one_per_row_keeps_its_ruled_form():
    graph, _ = _capture(lambda a: a.gather(1, torch.tensor([[0], [2], [1], [3], [0]])), (ROWS,))
    assert "take" in {n.op for n in graph} and "gather" not in {n.op for n in graph}


def test_a_scatter_with_a_reduce_argument_is_not_taken_for_a_plain_one():
    fn = lambda a: torch.zeros_like(a).scatter(1, a.topk(2).indices, a[:, :2], reduce="multiply")
    graph, _ = _capture(fn, (ROWS,))
    assert "untake" not in {n.op for n in graph}


def test_an_index_put_of_more_tensors_than_the_prover_takes_stays_opaque():
    rows = torch.tensor([0, 1])
    fn = lambda a: a.reshape(1, 1, 5, 4).index_put((rows * 0, rows * 0, rows, rows), a[0, :2])
    graph, _ = _capture(fn, (ROWS,))
    assert [n.attr("target") for n in graph if n.op == "opaque"] == ["aten.index_put"]
