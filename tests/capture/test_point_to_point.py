"""torch.distributed.send/recv are captured as `send` and `recv` IR ops (c10d.send, c10d.recv_)."""
import torch
import torch.distributed as dist
from torch import nn

from scalify.capture.ranks import capture_rank


class Relay(nn.Module):
    """Rank 0 sends 2x to rank 1; rank 1 receives it and returns it plus its own input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple:
        if dist.get_rank() == 0:
            dist.send(x * 2, 1)
            return ()
        received = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        dist.recv(received, 0)
        return received + x


def _capture(rank: int):
    inputs = {"x": torch.empty(2, 3, device="meta")}
    return capture_rank(lambda r: Relay(), rank, 2, inputs, lambda m, i: m(**i))


def test_send_is_kept_with_its_peer_though_no_output_uses_it():
    graph = _capture(0)
    (send,) = [node for node in graph if node.op == "send"]
    assert send.attr("peer") == 1 and send.shape == (2, 3)
    assert graph[send.inputs[0]].op == "mul_scalar"


def test_recv_produces_a_tensor_of_the_buffers_shape():
    graph = _capture(1)
    (recv,) = [node for node in graph if node.op == "recv"]
    assert recv.attr("peer") == 0 and recv.shape == (2, 3) and recv.inputs == ()
    assert recv.name in graph[graph.outputs[0]].inputs
