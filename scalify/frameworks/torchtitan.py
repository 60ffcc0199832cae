"""torchtitan's Llama 3 (`Llama3Model`) parallelised by its own `Module.parallelize`, against the
same model unparallelised (torchtitan's names match between the two; the parameters' placements
are those torchtitan's sharding declarations state).

Scalify sets up what torchtitan needs at capture, inside each rank's fake process group: its
`ParallelDims` and device mesh, and its sharding declarations (`set_llama3_sharding_config`);
both models are built on the meta device from a HuggingFace Llama config. Attention runs
torchtitan's SDPA inner attention, causal over one document: its language-model default, flex
attention, is compiled for the GPU (and its per-document masks are not what parallelism
changes).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..placements import Placement, Replicate, Shard
from ..steps import Run, Step, keep_grads, training_step
from . import rope_theta
from .torchtitan_plan import TorchtitanPlan

MAX_SEQUENCE_LENGTH = 4096
# torchtitan's label of a position no loss is taken at (its data loaders' and loss's).
IGNORE_INDEX = -100


def model_config(hf_config: Any, plan: TorchtitanPlan) -> Any:
    """torchtitan's `Llama3Model.Config` of a HuggingFace Llama config, with the sharding
    torchtitan declares for it under `plan` (sequence parallel or not)."""
    from torchtitan.models.common import (ComplexRoPE, Embedding, Linear, RMSNorm,
                                          ScaledBiasRowwiseLinear)
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or dim // heads
    eps, vocab = hf_config.rms_norm_eps, hf_config.vocab_size
    layers = _build_llama3_layers(
        n_layers=hf_config.num_hidden_layers, dim=dim, n_heads=heads,
        n_kv_heads=hf_config.num_key_value_heads, hidden_dim=hf_config.intermediate_size,
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQUENCE_LENGTH,
                                theta=rope_theta(hf_config), **_rope_scaling(hf_config)),
        attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = eps
        if getattr(hf_config, "attention_bias", False):  # as torchtitan's gpt-oss attention
            attention = layer.attention
            attention.qkv_linear.wqkv.bias = True
            attention.wo = ScaledBiasRowwiseLinear.Config(
                in_features=attention.wo.in_features, out_features=attention.wo.out_features,
                bias=True, param_init=attention.wo.param_init)
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        lm_head=Linear.Config(in_features=dim, out_features=vocab), layers=layers)
    set_llama3_sharding_config(config, enable_sp=plan.enable_sequence_parallel)
    return config


def run_of(hf_config: Any, plan: TorchtitanPlan, what: str, names: list[str] = ()) -> Run:
    """What both programs run: the model's `logits` on `input_ids`; or the `loss` as
    torchtitan's trainer takes it (its `CrossEntropyLoss`, loss parallel on vocabulary-sharded
    logits, summed and divided by the count of labelled tokens), on the next tokens as its data
    loaders label them (the last position ignored); or one `step`: that loss and the gradients
    of the parameters `names` as its optimizer reads them (DTensor gradients redistributed to
    their parameters' placements)."""
    if what == "logits":
        return _logits
    from torchtitan.components.loss import CrossEntropyLoss

    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=hf_config.vocab_size))

    def loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = inputs["input_ids"]
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
        return loss_fn(model(ids), labels, (labels != IGNORE_INDEX).sum())[0]
    if what == "loss":
        return loss
    sync = _parameter_layout_grads if plan.spmd_backend == "partial_dtensor" else keep_grads
    return training_step(loss, list(names), sync)


def reference_model(hf_config: Any, plan: TorchtitanPlan, run: Run = None) -> Step:
    """The model on one device, running `run` (its logits by default)."""
    with torch.device("meta"):
        model = model_config(hf_config, plan).build()
    return Step(model.eval(), run or _logits)


def rank_model(hf_config: Any, plan: TorchtitanPlan, run: Run = None) -> Callable[[int], nn.Module]:
    """Rank `rank`'s model, parallelised by torchtitan over the mesh its `ParallelDims` build,
    running `run` (its logits by default, which stay sharded over the vocabulary: the layout
    of torchtitan's loss parallel). With the spmd_types backend it runs in the mesh region
    torchtitan's trainer opens (outside one, its modules skip their redistributions)."""
    run = run or _logits

    def build(rank: int) -> nn.Module:
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend(plan.spmd_backend)  # as its trainer does, for its loss to read

        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=plan.tensor_parallel_degree,
                            pp=1, ep=1, world_size=plan.world_size(),
                            spmd_backend=plan.spmd_backend)
        dims.build_mesh()
        with torch.device("meta"):
            model = model_config(hf_config, plan).build()
        model.parallelize(dims)
        if plan.spmd_backend != "spmd_types":
            return Step(model.eval(), run)
        from torchtitan.distributed.spmd_types import set_current_spmd_mesh

        def in_mesh_region(module: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
            with set_current_spmd_mesh(dims.spmd_dense_mesh()):
                return run(module, inputs)
        return Step(model.eval(), in_mesh_region)
    return build


def declared_placements(model: nn.Module) -> dict[str, Placement]:
    """Each parameter's and buffer's placement over the tensor-parallel axis as torchtitan's
    sharding declarations on `model` (built from `model_config`) state it (`state_shardings`;
    the spmd_types backend keeps them as plain local tensors, so they are not read off
    DTensors)."""
    from torchtitan.distributed.parallel_dims import MeshAxisName

    placements: dict[str, Placement] = {}
    for prefix, module in model.named_modules():
        config = getattr(module, "_sharding_config", None)
        held = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
        for name, layout in (config.state_shardings.items() if config is not None else ()):
            if name in held:
                kind = layout.axis_types.get(MeshAxisName.TP)
                dim = getattr(kind, "dim", None)
                placements[f"{prefix}.{name}" if prefix else name] = (
                    Replicate() if dim is None else Shard(dim))
    return placements


def _logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(inputs["input_ids"])


def _parameter_layout_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from ..parallel.dtensor import parameter_layout_grads
    return parameter_layout_grads(model, grads)


def _rope_scaling(hf_config: Any) -> dict[str, Any]:
    """Llama 3's frequency scaling, in torchtitan's fields (none when the config has none)."""
    parameters = getattr(hf_config, "rope_parameters", None) or getattr(
        hf_config, "rope_scaling", None) or {}
    if parameters.get("rope_type") != "llama3":
        return {}
    return dict(scaling="llama", scaling_factor=parameters["factor"],
                low_freq_factor=parameters["low_freq_factor"],
                high_freq_factor=parameters["high_freq_factor"],
                original_max_position_embeddings=parameters["original_max_position_embeddings"])
