"""Megatron-Core DistributedDataParallel with use_distributed_optimizer (ZeRO-1 style) on 2 data-parallel
ranks: each rank runs its slice of the batch ([s, b/dp, h]), copies grads into a contiguous grad
buffer (params laid out in reverse order), scales by 1/dp and reduce-scatters the buffer with an
async handle, so each rank ends up owning its shard of the averaged flat gradient."""
from dataclasses import dataclass

import math
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
import scalify

STYLE = "megatron_core"
STEP = "training"
WORLD_SIZE = 2
BUG = None


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = True
    use_distributed_optimizer: bool = True


class GPTMLPBlock(nn.Module):
    def __init__(self, hidden=16, ffn=32):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.linear_fc1 = nn.Linear(hidden, ffn)
        self.linear_fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.linear_fc2(F.gelu(self.linear_fc1(self.input_layernorm(x))))


class ParamAndGradBuffer:
    def __init__(self, params, data_parallel_group, gradient_scaling_factor):
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = dist.get_world_size(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_index_map, offset = {}, 0
        for param in params[::-1]:           # backprop order: last layer first
            self.param_index_map[param] = (offset, offset + param.numel())
            offset += param.numel()
        self.numel = int(math.ceil(offset / self.data_parallel_world_size)) * self.data_parallel_world_size
        self.grad_data = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        for param in params:
            start, end = self.param_index_map[param]
            param.main_grad = self.grad_data[start:end].view(param.shape)
        self.grad_sync_handle = None

    def start_grad_sync(self):
        self.grad_data *= self.gradient_scaling_factor
        shard_size = self.numel // self.data_parallel_world_size
        rank = dist.get_rank(self.data_parallel_group)
        self.local_data_view = self.grad_data[rank * shard_size:(rank + 1) * shard_size]
        self.grad_sync_handle = dist.reduce_scatter_tensor(
            self.local_data_view, self.grad_data, group=self.data_parallel_group, async_op=True)

    def finish_grad_sync(self):
        self.grad_sync_handle.wait()
        self.grad_sync_handle = None
        return self.local_data_view


class DistributedDataParallel(nn.Module):
    def __init__(self, ddp_config, module, data_parallel_group):
        super().__init__()
        self.ddp_config, self.module = ddp_config, module
        self.data_parallel_group = data_parallel_group
        dp_size = dist.get_world_size(data_parallel_group)
        self.buffer = ParamAndGradBuffer(list(module.parameters()), data_parallel_group,
                                         gradient_scaling_factor=1.0 / dp_size)

    def forward(self, *args):
        return self.module(*args)


class TrainStep(nn.Module):
    def __init__(self):
        super().__init__()
        group = dist.new_group(list(range(dist.get_world_size())))
        self.model = DistributedDataParallel(DistributedDataParallelConfig(), GPTMLPBlock(), group)

    def forward(self, hidden_states, labels):
        output = self.model(hidden_states)
        loss = F.mse_loss(output, labels)
        params = list(self.model.module.parameters())
        for param, grad in zip(params, torch.autograd.grad(loss, params)):
            param.main_grad.add_(grad)        # the backward hook accumulates into the buffer
        self.model.buffer.start_grad_sync()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=self.model.data_parallel_group)
        reported /= dist.get_world_size(self.model.data_parallel_group)
        grad_shard = self.model.buffer.finish_grad_sync()
        return reported, grad_shard.clone()


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.module = GPTMLPBlock()

    def forward(self, hidden_states, labels):
        loss = F.mse_loss(self.model.module(hidden_states), labels)
        grads = torch.autograd.grad(loss, list(self.model.module.parameters()))
        return loss, torch.cat([g.reshape(-1) for g in grads[::-1]])


def reference() -> nn.Module:
    return Reference()


def rank_module(rank: int, world_size: int) -> nn.Module:
    return TrainStep()


def inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(4, 4, 16), "labels": torch.randn(4, 4, 16)}   # [s, b, h]


PARAM_PLACEMENTS = {}
INPUT_PLACEMENTS = {"hidden_states": scalify.Shard(1), "labels": scalify.Shard(1)}
OUTPUT_PLACEMENTS = [scalify.Replicate(), scalify.Shard(0)]
