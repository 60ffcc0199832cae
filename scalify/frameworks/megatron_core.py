"""Megatron-Core's `GPTModel` (local layer spec, no Transformer Engine) as a rank program,
against the HuggingFace Llama reference.

Scalify sets up what Megatron needs at capture, inside each rank's fake process group: its
parallel state (`initialize_model_parallel`, without the gloo groups a fake group cannot
make) and its CUDA RNG tracker (`model_parallel_cuda_manual_seed`); the model is built on the
meta device. The weights are related by `hf_to_megatron`, the name and layout map checkpoint
converters use (fused `[q, k, v]` per query group, `[gate; up]` in `linear_fc1`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..steps import Step
from . import rope_theta
from .megatron_core_plan import MegatronCorePlan

# Fusions and dropouts off: the unfused PyTorch paths run on any device, and dropout is not
# part of what is verified (models run in eval mode).
_PLAIN_PATHS = dict(hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                    masked_softmax_fusion=False, persist_layer_norm=False,
                    bias_dropout_fusion=False, apply_rope_fusion=False,
                    gradient_accumulation_fusion=False)
MAX_SEQUENCE_LENGTH = 4096
RNG_SEED = 1234


def transformer_config(hf_config: Any, plan: MegatronCorePlan) -> Any:
    """The `TransformerConfig` of a HuggingFace Llama config under `plan` (its
    `transformer_config` fields last)."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        sequence_parallel=plan.sequence_parallel, use_cpu_initialization=True,
        perform_initialization=False, **_PLAIN_PATHS)
    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    for name, value in plan.transformer_config:
        if name not in known:
            raise ConfigError(f"plan.megatron_core.transformer_config.{name}: not a field of "
                              "Megatron-Core's TransformerConfig")
        fields[name] = value
    return TransformerConfig(**fields)


def rank_model(hf_config: Any, plan: MegatronCorePlan, loss: bool = False
               ) -> Callable[[int], nn.Module]:
    """Rank `rank`'s GPTModel with its parallel state set up, as a module returning its logits
    gathered, or with `loss` its mean loss over the next tokens from its vocab-parallel logits
    (the way Megatron's pretraining scripts call it)."""
    def build(rank: int) -> nn.Module:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=plan.tensor_model_parallel_size,
            create_gloo_process_groups=False)
        tensor_parallel.model_parallel_cuda_manual_seed(RNG_SEED)
        config = transformer_config(hf_config, plan)
        with torch.device("meta"):
            model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(),
                             vocab_size=hf_config.vocab_size,
                             max_sequence_length=MAX_SEQUENCE_LENGTH,
                             position_embedding_type="rope", rotary_base=int(rope_theta(hf_config)),
                             share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
                             parallel_output=loss)
        return Step(model.eval(), _loss(plan.label_smoothing) if loss else _logits)
    return build


def _logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPTModel's logits `[b, s, vocab]` (its own causal mask: `attention_mask=None`)."""
    return model(**_gpt_inputs(inputs))


def _loss(smoothing: float) -> Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    """GPTModel's per-token losses on the next tokens as labels (Megatron's data loaders shift
    them so), averaged over every position but the last (whose label wraps around). With label
    smoothing, Megatron's vocab-parallel cross entropy is called on GPTModel's vocab-parallel
    logits with it, as NeMo's GPT loss calls it (GPTModel's own loss takes none)."""
    def mean_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = next_tokens(inputs["input_ids"])
        if not smoothing:
            return model(**_gpt_inputs(inputs), labels=labels)[:, :-1].mean()
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        logits = model(**_gpt_inputs(inputs))
        return vocab_parallel_cross_entropy(logits, labels, smoothing)[:, :-1].mean()
    return mean_loss


def _gpt_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    ids = inputs["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": None}


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token (the last position's wraps around to the first token)."""
    return torch.cat([ids[:, 1:], ids[:, :1]], dim=1)


def reference_step(reference: nn.Module, hf_config: Any, loss: bool = False,
                   smoothing: float = 0.0) -> Step:
    """The HuggingFace model's logits on `input_ids`, causal with no padding as GPTModel is, or
    with `loss` its cross entropy on the next tokens averaged as the ranks' (`_loss`; HF's own
    loss reads its token count into Python, which a capture on meta tensors cannot); its rotary
    table rebuilt on the CPU, a constant as Megatron's is."""
    rotary = reference.model.rotary_emb
    reference.model.rotary_emb = type(rotary)(config=hf_config)

    def logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = inputs["input_ids"]
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    def mean_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = inputs["input_ids"]
        scores = logits(model, inputs)
        per_token = F.cross_entropy(scores.flatten(0, 1), next_tokens(ids).flatten(),
                                    reduction="none").view(ids.shape)
        if smoothing:  # Megatron's definition: the mass spread over the other classes
            spread = smoothing * scores.shape[-1] / (scores.shape[-1] - 1)
            mean_log_probs = F.log_softmax(scores, dim=-1).mean(dim=-1)
            per_token = (1.0 - spread) * per_token - spread * mean_log_probs
        return per_token[:, :-1].mean()
    return Step(reference, mean_loss if loss else logits)


def hf_to_megatron(hf_config: Any) -> Callable[[dict, int, int], dict]:
    """The HuggingFace Llama state dict -> rank `rank`'s GPTModel state dict."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    groups = hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads

    def shard(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
        part = lambda tensor, dim: tensor.chunk(world, dim)[rank]
        out = {"embedding.word_embeddings.weight": part(state["model.embed_tokens.weight"], 0),
               "decoder.final_layernorm.weight": state["model.norm.weight"],
               "output_layer.weight": part(state["lm_head.weight"], 0)}
        for layer in range(hf_config.num_hidden_layers):
            hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
            q = state[hf + "self_attn.q_proj.weight"].reshape(groups, heads // groups * head_dim, hidden)
            k = state[hf + "self_attn.k_proj.weight"].reshape(groups, head_dim, hidden)
            v = state[hf + "self_attn.v_proj.weight"].reshape(groups, head_dim, hidden)
            out[mc + "self_attention.linear_qkv.weight"] = part(torch.cat([q, k, v], 1), 0).reshape(-1, hidden)
            out[mc + "self_attention.linear_proj.weight"] = part(state[hf + "self_attn.o_proj.weight"], 1)
            out[mc + "mlp.linear_fc1.weight"] = torch.cat(
                [part(state[hf + "mlp.gate_proj.weight"], 0), part(state[hf + "mlp.up_proj.weight"], 0)])
            out[mc + "mlp.linear_fc2.weight"] = part(state[hf + "mlp.down_proj.weight"], 1)
            out[mc + "input_layernorm.weight"] = state[hf + "input_layernorm.weight"]
            out[mc + "pre_mlp_layernorm.weight"] = state[hf + "post_attention_layernorm.weight"]
        return out
    return shard
