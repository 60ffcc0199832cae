"""A captured training step computes what torch's autograd computes: the loss and every
parameter's gradient, evaluated by the IR interpreter on real weights."""
import pytest
import torch

from scalify.capture.tracer import capture
from scalify.models import build_reference, example_inputs, make_hf_config
from scalify.models.presets import PRESETS
from scalify.steps import Step, hf_loss, training_step
from scalify.verify.numeric import run_graph

LAYERS = {"llama": "num_hidden_layers", "gpt2": "n_layer"}


def _model(family: str, device: str):
    config = make_hf_config(family, {**PRESETS[f"{family}-tiny"].config, LAYERS[family]: 1})
    model = build_reference(family, config)
    if device == "cpu":  # a real model (its buffers initialised), in float64
        model = type(model)(config).double().eval()
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_captured_step_equals_autograd(family):
    meta = _model(family, "meta")
    names = [name for name, _ in meta.named_parameters()]
    inputs = example_inputs(family, 2, 8)
    inputs["labels"] = inputs["input_ids"].clone()
    step = Step(meta, training_step(hf_loss, names))
    graph = capture(step, lambda: step(**inputs), inputs, grad=True)

    real = _model(family, "cpu")
    gen = torch.Generator().manual_seed(0)
    env = {}
    for name, param in real.named_parameters():
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.5)
        env[name] = param.detach().clone()
    env.update(dict(real.named_buffers()))
    ids = torch.randint(0, 256, (2, 8), generator=gen)
    labels = ids.masked_fill(torch.rand(2, 8, generator=gen) < 0.25, -100)
    feed = {"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long), "labels": labels}
    env.update(feed)
    expected = Step(real, training_step(hf_loss, names))(**feed)
    values = run_graph(graph, {node.name: env[node.name] for node in graph.placeholders()})
    for name, want, output in zip(["loss", *names], expected, graph.outputs):
        got, want = values[output].double(), want.double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name


def test_backward_ops_are_charged_to_their_forward_lines():
    meta = _model("llama", "meta")
    names = [name for name, _ in meta.named_parameters()]
    inputs = example_inputs("llama", 1, 8)
    inputs["labels"] = inputs["input_ids"].clone()
    step = Step(meta, training_step(hf_loss, names))
    graph = capture(step, lambda: step(**inputs), inputs, grad=True)
    backward = [node for node in graph if node.source.backward]
    assert backward, "the backward pass is recorded"
    grad_of_down = graph[graph.outputs[1 + names.index("model.layers.0.mlp.down_proj.weight")]]
    assert grad_of_down.source.backward
    assert grad_of_down.source.module == "model.layers.0.mlp.down_proj"
    assert "down_proj" in grad_of_down.source.code


@pytest.mark.parametrize("causal", [True, False])
def test_attention_backward_is_captured_op_by_op(causal):
    """F.scaled_dot_product_attention runs as its math version: its gradient is recorded op
    by op (a fused kernel's backward would be opaque) and equals autograd's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    module = torch.nn.Module()

    def step(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    inputs = {"q": q, "k": k, "v": v}
    graph = capture(module, lambda: step(q, k, v), inputs, grad=True)
    assert not [node for node in graph if node.op == "opaque"]
    values = run_graph(graph, inputs)
    for name, expected in zip(graph.outputs, step(q, k, v)):
        assert torch.allclose(values[name], expected)
