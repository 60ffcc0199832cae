"""The dense experts dispatch: HF's Mixtral with it computes what HF's own eager dispatch does,
and captures on meta where the eager one cannot."""
from __future__ import annotations

import pytest
import torch
from transformers import MixtralForCausalLM

from scalify.capture.tracer import capture
from scalify.errors import CaptureError
from scalify.models import PRESETS, build_reference, example_inputs, make_hf_config
from scalify.models.moe import DENSE_EXPERTS, routing_weights


def tiny_config():
    return make_hf_config("mixtral", {**PRESETS["mixtral-tiny"].config, "num_hidden_layers": 1})


def test_routing_weights_put_each_top_k_weight_at_its_expert():
    index = torch.tensor([[2, 0], [1, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    assert torch.equal(routing_weights(index, weights, 4),
                       torch.tensor([[0.3, 0.0, 0.7, 0.0], [0.0, 0.6, 0.0, 0.4]]))


def test_dense_dispatch_equals_hf_eager_dispatch():
    config = tiny_config()
    assert config._experts_implementation == DENSE_EXPERTS
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    dense = model(input_ids=ids).logits
    config._experts_implementation = "eager"
    eager = model(input_ids=ids).logits
    torch.testing.assert_close(dense, eager, rtol=1e-5, atol=1e-6)


def test_dense_reference_captures_on_meta_with_topk_and_the_eager_one_does_not():
    config = tiny_config()
    model = build_reference("mixtral", config)
    inputs = example_inputs("mixtral", 1, 8)
    graph = capture(model, lambda: model(**inputs).logits, inputs)
    assert {"topk", "topk_index"} <= {node.op for node in graph}
    config._experts_implementation = "eager"  # loops over nonzero() experts: data-dependent
    with pytest.raises((CaptureError, RuntimeError, NotImplementedError)):
        capture(model, lambda: model(**inputs).logits, inputs)
