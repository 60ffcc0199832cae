"""What an experiment verifies: the reference program, each rank's program, their inputs, and
the relations the plan promises (parameters and inputs in, outputs out)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from .capture.shard_fn import stated_placements
from .config import Experiment
from .errors import ConfigError
from .placements import Custom, Placement, Replicate, Shard, Stage
from .steps import Step, hf_logits, hf_loss, training_step


@dataclass
class Programs:
    """The modules `verify_modules` captures and the placements that relate them."""

    reference: nn.Module
    rank: Callable[[int], nn.Module]
    inputs: dict[str, torch.Tensor]
    placements: dict[str, Placement]
    outputs: list[Placement]
    grad: bool = False  # the programs compute gradients
    input_placements: dict[str, Placement] = field(default_factory=dict)
    shard_fn: Callable | None = None  # a checkpoint sharding function stating the placements
    # Reference ops in a row the ranks may compute fused, never holding their values (the
    # softmax of attention merged over key blocks, a vocab-parallel loss's softmax gradient).
    fused_ops: int = 0
    # Integer inputs' ranges the proof may assume (token ids within the vocabulary).
    assume: dict[str, tuple[int, int]] = field(default_factory=dict)


def programs_for(experiment: Experiment) -> Programs:
    """The programs of a tensor/sequence-parallel or a data-parallel plan, forward or one
    training step (`verify.backward`)."""
    from .models import build_reference, example_inputs, make_hf_config

    model = experiment.model
    hf_config = make_hf_config(model.family, model.config)
    reference = build_reference(model.family, hf_config)
    inputs = example_inputs(model.family, experiment.inputs.batch, experiment.inputs.seq)
    backward, loss = experiment.verify.backward, experiment.verify.loss
    if backward or loss:
        inputs["labels"] = inputs["input_ids"].clone()
    names = [name for name, _ in reference.named_parameters()]
    # Models stay in eval mode: a training step is verified with dropout off.
    run = training_step(hf_loss, names) if backward else hf_loss if loss else hf_logits
    reference_step = Step(reference, run)
    if experiment.plan.style == "megatron_core":
        return _megatron_core(experiment, hf_config, reference, inputs)
    if experiment.plan.style == "torchtitan":
        return _torchtitan(experiment, hf_config, inputs)
    build = (_dtensor if experiment.plan.style == "dtensor" else
             _context_parallel if experiment.plan.context_parallel > 1 else
             _expert_parallel if experiment.plan.expert_parallel > 1 else
             _pipeline if experiment.plan.pipeline_parallel > 1 else
             _data_parallel if experiment.plan.data_parallel > 1 else _tensor_parallel)
    return build(experiment, hf_config, reference_step, inputs, names)


def _dtensor(experiment: Experiment, hf_config, reference_step: Step,
             inputs: dict[str, torch.Tensor], names: list[str]) -> Programs:
    from .parallel.dtensor import dtensor_subject, parameter_layout_grads

    plan, world = experiment.plan, experiment.world_size()
    subject = dtensor_subject(experiment.model.family, hf_config, plan.dtensor_plan, world,
                              plan.planted_bug)
    if not experiment.verify.backward:
        return Programs(reference_step, lambda rank: Step(subject.rank_factory(rank), hf_logits),
                        inputs, subject.param_placements, [subject.logits])
    if not isinstance(subject.logits, Replicate):
        raise ConfigError("verify.backward with a DTensor plan needs replicated logits (HF's loss "
                          f"runs on them); this plan leaves them {subject.logits}: torch's "
                          "loss_parallel is not supported yet")
    step = training_step(hf_loss, names, parameter_layout_grads)
    return Programs(reference_step, lambda rank: Step(subject.rank_factory(rank), step), inputs,
                    subject.param_placements,
                    [Replicate(), *(subject.param_placements.get(name, Replicate()) for name in names)],
                    grad=True)


def _megatron_core(experiment: Experiment, hf_config, reference: nn.Module,
                   inputs: dict[str, torch.Tensor]) -> Programs:
    """Megatron-Core's GPTModel on every rank against the HuggingFace llama: the logits, or
    with `verify.loss` the mean loss over the next tokens (Megatron's vocab-parallel cross
    entropy against the reference's), for token ids within the vocabulary."""
    from .frameworks.megatron_core import hf_to_megatron, rank_model, reference_step

    loss, smoothing = experiment.verify.loss, experiment.plan.megatron_core.label_smoothing
    if smoothing and not loss:
        raise ConfigError("plan.megatron_core.label_smoothing: the loss is smoothed, so it needs "
                          "verify.loss: true")
    if experiment.verify.backward:
        raise ConfigError("verify.backward is not supported for style megatron_core yet: verify "
                          "the forward (the logits) or the loss (verify.loss)")
    if hf_config.tie_word_embeddings:
        raise ConfigError("model.tie_word_embeddings: Megatron-Core's shared output layer is not "
                          "mapped yet; use untied embeddings")
    return Programs(reference_step(reference, hf_config, loss, smoothing),
                    rank_model(hf_config, experiment.plan.megatron_core, loss),
                    {"input_ids": inputs["input_ids"]}, {}, [Replicate()],
                    shard_fn=hf_to_megatron(hf_config), fused_ops=3 if loss else 0,
                    assume={"input_ids": (0, hf_config.vocab_size - 1)} if loss else {})


def _torchtitan(experiment: Experiment, hf_config, inputs: dict[str, torch.Tensor]) -> Programs:
    """torchtitan's Llama 3 parallelised by its own `parallelize` against the same model on one
    device: the logits, sharded over the vocabulary as torchtitan's loss parallel leaves them;
    or its loss (`verify.loss`), or a training step (`verify.backward`: the loss and every
    parameter's gradient, laid out as the parameter), for token ids within the vocabulary."""
    from .frameworks.torchtitan import declared_placements, reference_model, rank_model, run_of

    plan, verify = experiment.plan.torchtitan, experiment.verify
    what = "step" if verify.backward else "loss" if verify.loss else "logits"
    reference = reference_model(hf_config, plan)
    names = [name for name, _ in reference.named_parameters()]
    run = run_of(hf_config, plan, what, names)
    reference.run = run
    placements = declared_placements(reference.model)
    outputs = {"logits": [Shard(2)], "loss": [Replicate()],
               "step": [Replicate(), *(placements.get(name, Replicate()) for name in names)]}[what]
    return Programs(reference, rank_model(hf_config, plan, run), {"input_ids": inputs["input_ids"]},
                    placements, outputs, grad=what == "step", fused_ops=0 if what == "logits" else 3,
                    assume={} if what == "logits" else {"input_ids": (0, hf_config.vocab_size - 1)})


def _tensor_parallel(experiment: Experiment, hf_config, reference_step: Step,
                     inputs: dict[str, torch.Tensor], names: list[str]) -> Programs:
    from .parallel import build_rank_model, finalize_grads, param_placements, shard_function

    plan, family, world = experiment.plan, experiment.model.family, experiment.world_size()
    shard_fn = shard_function(family, hf_config, fused=plan.fused, path=plan.shard_fn,
                              planted_bug=plan.planted_bug)
    placements = {} if shard_fn else param_placements(family, hf_config, world,
                                                      planted_bug=plan.planted_bug)

    def rank_model(rank: int) -> nn.Module:
        return build_rank_model(family, hf_config, rank, world, logits=plan.logits,
                                planted_bug=plan.planted_bug, fused=plan.fused,
                                sequence_parallel=plan.sequence_parallel)

    if experiment.verify.loss and not experiment.verify.backward:
        return Programs(reference_step, lambda rank: Step(rank_model(rank), rank_loss), inputs,
                        placements, [Replicate()], shard_fn=shard_fn)
    if not experiment.verify.backward:
        logits = Replicate() if plan.logits == "gathered" else Shard(-1)
        return Programs(reference_step, rank_model, inputs, placements, [logits],
                        shard_fn=shard_fn)
    if plan.fused:
        _check_fused_backward(hf_config, world)
    if shard_fn is not None:  # the gradients are laid out as the parameters the function gives
        placements = stated_placements(reference_step, world, None, shard_fn)
    step = training_step(rank_loss, names, finalize_grads, _holders(placements, names))
    # A fused projection's input gradient is one matmul on the ranks, the sum of one per
    # projection in the reference; a vocab-parallel loss fuses its softmax gradient.
    fused_ops = 3 if plan.logits == "vocab_parallel" else 4 if shard_fn is not None else 0
    return Programs(reference_step, lambda rank: Step(rank_model(rank), step), inputs, placements,
                    [Replicate(), *(placements[name] for name in names)], grad=True,
                    fused_ops=fused_ops)


def _check_fused_backward(hf_config, world: int) -> None:
    """Refuse the fused layout's training step where it is not proved yet."""
    from .parallel.fused import head_layout

    groups, _, sharing = head_layout(hf_config, world)
    if sharing > 1:
        raise ConfigError(
            f"verify.backward with plan.fused: {hf_config.num_key_value_heads} kv heads over "
            f"{world} ranks are replicated over {sharing} ranks each, and that training step is "
            "not proved in reasonable time yet: use as many kv heads as tensor_parallel "
            "(model.num_key_value_heads in overrides)")
    if groups > 1:
        raise ConfigError(
            f"verify.backward with plan.fused: each rank holds {groups} interleaved [q, k, v] "
            f"groups ({hf_config.num_key_value_heads} kv heads over {world} ranks), whose input "
            "gradient is not related to the reference's yet: use at most as many kv heads as "
            "tensor_parallel (model.num_key_value_heads in overrides)")


def _holders(placements: dict[str, Placement], names: list[str]) -> dict[str, str]:
    """The rank parameter holding each reference parameter of a Custom placement (a fused
    qkv_proj holds q_proj), whose gradient then stands for the reference parameter's."""
    holders = {}
    for name in names:
        placement = placements[name]
        if isinstance(placement, Custom):
            held_in = sorted({piece.local for piece in placement.pieces})
            if len(held_in) > 1:
                raise ConfigError(f"verify.backward: the sharding function puts pieces of {name} "
                                  f"in several rank tensors ({', '.join(held_in)}); a training "
                                  "step is verified when each reference parameter lies in one")
            holders[name] = held_in[0]
    return holders


def _context_parallel(experiment: Experiment, hf_config, reference_step: Step,
                      inputs: dict[str, torch.Tensor], names: list[str]) -> Programs:
    from .models import build_reference
    from .parallel.context import SEQUENCE_DIM, SequenceLayout, context_parallel_rank
    from .parallel.context_planted import context_parts

    if experiment.verify.backward or experiment.verify.loss:
        raise ConfigError("verify.backward and verify.loss are not supported for context-parallel "
                          "plans yet: verify the forward (the logits)")
    plan = experiment.plan
    layout = SequenceLayout(plan.context_parallel, experiment.inputs.seq, plan.context_load_balance)
    parts = context_parts(plan.planted_bug)

    def rank_model(rank: int) -> nn.Module:
        return context_parallel_rank(
            hf_config, rank, layout, lambda config: build_reference(experiment.model.family, config),
            parts)

    return Programs(reference_step, rank_model, inputs, {}, [Replicate()],
                    input_placements={"input_ids": layout.placement(SEQUENCE_DIM)}, fused_ops=3)


def _expert_parallel(experiment: Experiment, hf_config, reference_step: Step,
                     inputs: dict[str, torch.Tensor], names: list[str]) -> Programs:
    from .parallel.experts import expert_parallel_rank, expert_placements

    world, bug = experiment.world_size(), experiment.plan.planted_bug
    dispatch = experiment.plan.expert_dispatch
    tokens = experiment.inputs.batch * experiment.inputs.seq
    if dispatch == "all_to_all" and tokens % world:
        raise ConfigError(f"all_to_all dispatch splits the {tokens} tokens (inputs.batch * "
                          f"inputs.seq) evenly over {world} ranks: make them a multiple")
    expert_parallel_rank(hf_config, 0, world, bug, dispatch)  # a bad planted_bug fails early

    placements = expert_placements(hf_config, world)
    run = training_step(hf_loss, names) if experiment.verify.backward else hf_logits

    def rank_model(rank: int) -> nn.Module:
        return Step(expert_parallel_rank(hf_config, rank, world, bug, dispatch), run)

    if not experiment.verify.backward:
        return Programs(reference_step, rank_model, inputs, placements, [Replicate()])
    return Programs(reference_step, rank_model, inputs, placements,
                    [Replicate(), *(placements[name] for name in names)], grad=True)


def _data_parallel(experiment: Experiment, hf_config, reference_step: Step,
                   inputs: dict[str, torch.Tensor], names: list[str]) -> Programs:
    from .models import build_reference
    from .parallel.data import grad_placements
    from .parallel.planted import data_parallel_step

    plan, family = experiment.plan, experiment.model.family
    batch_shards = {name: Shard(0) for name in inputs}

    def rank_model(rank: int) -> nn.Module:
        return build_reference(family, hf_config)

    if not experiment.verify.backward:
        return Programs(reference_step, lambda rank: Step(rank_model(rank), hf_logits), inputs, {},
                        [Shard(0)], input_placements=batch_shards)
    step = data_parallel_step(plan.planted_bug, tuple(names), plan.micro_batches, plan.zero_stage)
    return Programs(reference_step, lambda rank: Step(rank_model(rank), step), inputs, {},
                    [Replicate(), *grad_placements(names, plan.zero_stage)], grad=True,
                    input_placements=batch_shards)


def _pipeline(experiment: Experiment, hf_config, reference_step: Step,
              inputs: dict[str, torch.Tensor], names: list[str]) -> Programs:
    from .models import build_reference
    from .parallel.pipeline import check_every_layer_held, stage_model, stage_placements
    from .parallel.planted import pipeline_schedule

    plan, stages = experiment.plan, experiment.plan.pipeline_parallel
    schedule = pipeline_schedule(plan.planted_bug, tuple(names), stages,
                                 hf_config.num_hidden_layers, plan.micro_batches)
    check_every_layer_held(schedule)
    placements, last = stage_placements(schedule), Stage(stages - 1)
    backward = experiment.verify.backward

    def rank_program(rank: int) -> nn.Module:
        stage = replace(schedule, stage=rank)
        model = stage_model(build_reference(experiment.model.family, hf_config),
                            stage.block(rank), stage.first, stage.last)
        return Step(model, stage.train if backward else stage.logits)

    if not backward:
        return Programs(reference_step, rank_program, inputs, placements, [last])
    return Programs(reference_step, rank_program, inputs, placements,
                    [last, *(placements[name] for name in names)], grad=True)


def rank_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor-parallel rank model's loss: its forward with labels returns it."""
    return model(**inputs)

