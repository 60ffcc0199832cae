"""Pipeline parallelism for llama: rank s is stage s and holds a contiguous block of decoder
layers (stage 0 also the embedding; the last stage the final norm, lm_head and the loss).

A stage's module is the HuggingFace model with the parts the stage does not hold removed, so
its parameters keep HuggingFace's names (`model.layers.3.mlp.up_proj.weight`). The batch runs
as micro-batches, GPipe-style: every micro-batch forward (each stage sends its activation to
the next), then every micro-batch backward (each stage sends the gradient of the activation it
received back to the previous one). The loss is normalised by the target tokens of the whole
batch, so the micro-batches' gradients simply add up.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask

from scalify.errors import ConfigError
from scalify.parallel.data import micro_batches, target_tokens
from scalify.placements import Placement, Stage, _caller_location

Grads = list[torch.Tensor]
_LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class LayerBlock:
    """The decoder layers [start, stop) one stage holds; `declared_at` is the line that chose them."""

    start: int
    stop: int
    declared_at: str = field(default_factory=_caller_location, compare=False, repr=False)

    def __iter__(self):
        return iter(range(self.start, self.stop))


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter name belongs to (None outside the layers)."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    return int(name[len(_LAYER_PREFIX):].split(".", 1)[0])


def stage_model(model: nn.Module, block: LayerBlock, first: bool, last: bool) -> nn.Module:
    """`model` (a HuggingFace llama) keeping only what the stage holds: the layers of `block`
    (in a ModuleDict keyed by layer index, so names are unchanged), the embedding on the first
    stage, the final norm and lm_head on the last."""
    layers = model.model.layers
    model.model.layers = nn.ModuleDict({str(index): layers[index] for index in block})
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = None
        model.lm_head = None
    return model


@dataclass(frozen=True)
class PipelineSchedule:
    """What rank `stage` of `stages` runs: its forward (logits on the last stage) or one training
    step (the last stage's loss, then the gradient of each parameter in `names` it holds).
    Planted bugs override `block` or `loss_of`."""

    names: tuple[str, ...]
    stage: int
    stages: int
    layers: int
    micro_batches: int = 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def block(self, stage: int) -> LayerBlock:
        """The contiguous block of layers stage `stage` holds."""
        return LayerBlock(stage * self.layers // self.stages, (stage + 1) * self.layers // self.stages)

    def held(self) -> list[str]:
        """The names (in order) of the parameters this stage holds."""
        block = set(self.block(self.stage))
        return [name for name in self.names if _held_by(name, block, self.first, self.last)]

    # Forward.

    def stage_input(self, model: nn.Module, part: dict[str, torch.Tensor]) -> torch.Tensor:
        """The first stage embeds the tokens; later stages receive the previous stage's output."""
        if self.first:
            return model.model.embed_tokens(part["input_ids"])
        batch, seq = part["input_ids"].shape
        hidden = receive((batch, seq, model.config.hidden_size), self.stage - 1, model)
        return hidden.requires_grad_(torch.is_grad_enabled())

    def layer_context(self, model: nn.Module, hidden: torch.Tensor,
                      attention_mask: torch.Tensor) -> dict:
        """The causal mask, positions and rotary embeddings HF's model gives every layer."""
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + 0).unsqueeze(0)
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden,
                                  attention_mask=attention_mask, past_key_values=None,
                                  position_ids=position_ids)
        return {"attention_mask": mask, "position_ids": position_ids, "past_key_values": None,
                "position_embeddings": model.model.rotary_emb(hidden, position_ids=position_ids),
                "use_cache": False}

    def run_layers(self, model: nn.Module, hidden: torch.Tensor,
                   attention_mask: torch.Tensor) -> torch.Tensor:
        """The stage's decoder layers, in order."""
        context = self.layer_context(model, hidden, attention_mask)
        for layer in model.model.layers.values():
            hidden = layer(hidden, **context)
        return hidden

    def forward(self, model: nn.Module, part: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stage's input, its output): hidden states, or logits on the last stage (sent on
        to the next stage otherwise)."""
        stage_input = self.stage_input(model, part)
        hidden = self.run_layers(model, stage_input, part["attention_mask"])
        if self.last:
            return stage_input, model.lm_head(model.model.norm(hidden))
        dist.send(hidden, self.stage + 1)
        return stage_input, hidden

    def logits(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward of every micro-batch; the last stage returns the logits."""
        parts = [self.forward(model, part)[1] for part in micro_batches(inputs, self.micro_batches)]
        return (torch.cat(parts, 0),) if self.last else ()

    # One training step.

    def loss_of(self, logits: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss, normalised by the target tokens of the whole batch."""
        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=tokens)

    def backward(self, model: nn.Module, stage_input: torch.Tensor, output: torch.Tensor,
                 params: list[torch.Tensor]) -> Grads:
        """The gradients of `params` for one micro-batch; the gradient of the received input
        goes back to the previous stage."""
        wanted = params if self.first else [*params, stage_input]
        if self.last:
            grads = list(torch.autograd.grad(output, wanted))
        else:
            incoming = receive(tuple(output.shape), self.stage + 1, model)
            grads = list(torch.autograd.grad(output, wanted, grad_outputs=incoming))
        if not self.first:
            dist.send(grads.pop(), self.stage - 1)
        return grads

    def train(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(the loss on the last stage, then) the gradient of every parameter the stage holds."""
        parts = micro_batches(inputs, self.micro_batches)
        counts = [target_tokens(part["labels"]) for part in parts]
        tokens = sum(counts[1:], counts[0])  # the whole batch's target tokens
        runs, losses = [], []
        for part in parts:
            stage_input, output = self.forward(model, part)
            if self.last:
                output = self.loss_of(output, part["labels"], tokens)
                losses.append(output.detach())
            runs.append((stage_input, output))
        named = dict(model.named_parameters())
        params = [named[name] for name in self.held()]
        total: Grads | None = None
        for stage_input, output in runs:
            grads = self.backward(model, stage_input, output, params)
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        loss = (sum(losses[1:], losses[0]),) if self.last else ()
        return (*loss, *total)


def receive(shape: tuple[int, ...], peer: int, model: nn.Module) -> torch.Tensor:
    """A tensor of `shape` received from rank `peer` (in the model's dtype, on its device)."""
    like = next(model.parameters())
    buffer = torch.zeros(shape, dtype=like.dtype, device=like.device)
    dist.recv(buffer, peer)
    return buffer


def _held_by(name: str, block: set[int], first: bool, last: bool) -> bool:
    layer = layer_of(name)
    if layer is not None:
        return layer in block
    if name.startswith("model.embed_tokens."):
        return first
    return last  # the final norm and lm_head


def stage_placements(schedule: PipelineSchedule) -> dict[str, Placement]:
    """Where the plan puts each parameter: whole on the stage holding its layer (the embedding
    on stage 0; the final norm and lm_head on the last stage)."""
    plan = PipelineSchedule(schedule.names, 0, schedule.stages, schedule.layers)
    return {name: Stage(stage) for stage in range(plan.stages)
            for name in replace(plan, stage=stage).held()}


def check_every_layer_held(schedule: PipelineSchedule) -> None:
    """Every decoder layer on some stage, else an error naming the dropped layer's first
    parameter and the line that chose the next stage's block (its boundary)."""
    blocks = [schedule.block(stage) for stage in range(schedule.stages)]
    for layer in range(schedule.layers):
        if not any(layer in set(block) for block in blocks):
            name = next((n for n in schedule.names if layer_of(n) == layer), f"layer {layer}")
            after = next((b for b in blocks if b.start > layer), blocks[-1])
            raise ConfigError(f"{name}: decoder layer {layer} is held by no pipeline stage; the "
                              f"stage blocks are {[(b.start, b.stop) for b in blocks]} "
                              f"(boundary at {after.declared_at})")
