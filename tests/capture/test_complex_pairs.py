"""Complex tensors are captured as pairs of reals: a rotary embedding written with
`view_as_complex` and a complex product (Meta's Llama, torchtitan) records real ops that compute
the same numbers, forward and backward."""
import torch

from scalify.capture.tracer import capture
from scalify.verify.numeric import run_graph

SEQ, HEADS, DIM = 6, 3, 8


class Rotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        freqs = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles)  # a constant, not a buffer
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        x = self.proj(x)
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rotated = torch.view_as_real(pairs * self.freqs_cis[None, :, None, :]).flatten(3)
        loss = (rotated.type_as(x) ** 2).sum()
        return loss, torch.autograd.grad(loss, [self.proj.weight])[0]


def test_a_complex_rotary_step_is_real_ops_with_the_same_numbers():
    torch.manual_seed(0)
    module, x = Rotary(), torch.randn(2, SEQ, HEADS, DIM)
    graph = capture(module, lambda: module(x=x), {"x": x}, grad=True)
    assert all(node.dtype == "float32" for node in graph)
    assert "opaque" not in {node.op for node in graph}
    values = run_graph(graph, {"x": x.double(), "proj.weight": module.proj.weight.detach().double()})
    for name, expected in zip(graph.outputs, module(x)):
        torch.testing.assert_close(values[name].float(), expected, rtol=1e-4, atol=1e-4)


def test_a_complex_buffer_is_an_input_held_as_pairs():
    module = Rotary()
    module.register_buffer("table", module.freqs_cis.clone())
    module.forward = lambda x: torch.view_as_real(module.table * module.table)
    graph = capture(module, lambda: module(x=torch.zeros(1)), {"x": torch.zeros(1)})
    table = graph["table"]
    assert (table.op, table.shape, table.dtype) == ("placeholder", (SEQ, DIM // 2, 2), "float32")
