"""DeepSpeed engine data parallel step with bucketed async all-reduce and gradient predivide;
BUG: after the all-reduce the buckets are divided by the dp world size again although they were
already pre-divided, so gradients are scaled down twice."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
import scalify

STYLE = "deepspeed"
STEP = "training"
WORLD_SIZE = 2
BUG = "The post-all-reduce scaling multiplies by 1 / dp_world_size instead of predivide_factor / dp_world_size, dividing the pre-divided gradients a second time."

IN, HID, CLASSES = 12, 16, 5
GRADIENT_PREDIVIDE_FACTOR = 2.0
REDUCE_BUCKET_SIZE = 256   # elements


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.head = nn.Linear(HID, CLASSES)

    def loss(self, x, labels):
        return F.cross_entropy(self.head(F.gelu(self.norm(self.dense(x)))), labels)

    def forward(self, x, labels):
        loss = self.loss(x, labels)
        return (loss, *torch.autograd.grad(loss, list(self.parameters())))


class DeepSpeedEngine(nn.Module):
    def __init__(self, module, dp_group=None):
        super().__init__()
        self.module = module
        self.dp_group = dp_group
        self.dp_world_size = dist.get_world_size(group=dp_group)

    def gradient_predivide_factor(self):
        return GRADIENT_PREDIVIDE_FACTOR

    def buckets(self, grads):
        bucket, size = [], 0
        for g in grads:
            bucket.append(g)
            size += g.numel()
            if size >= REDUCE_BUCKET_SIZE:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def allreduce_gradients(self, grads):
        pending = []
        for bucket in self.buckets(grads):
            tensor = _flatten_dense_tensors(bucket)
            if self.gradient_predivide_factor() != 1.0:
                tensor.mul_(1.0 / self.gradient_predivide_factor())
            handle = dist.all_reduce(tensor, group=self.dp_group, async_op=True)
            pending.append((handle, tensor, bucket))
        for handle, tensor, bucket in pending:
            handle.wait()
            tensor.mul_(1.0 / self.dp_world_size)  # BUG
            for grad, synced in zip(bucket, _unflatten_dense_tensors(tensor, bucket)):
                grad.copy_(synced)

    def forward(self, x, labels):
        loss = self.module.loss(x, labels)
        grads = [g.detach() for g in torch.autograd.grad(loss, list(self.module.parameters()))]
        self.allreduce_gradients(grads)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced, group=self.dp_group)
        return (reduced / self.dp_world_size, *grads)


def reference():
    return Classifier()


def rank_module(rank, world_size):
    return DeepSpeedEngine(Classifier())


def shard(state, rank, world_size):
    return {f"module.{k}": v.clone() for k, v in state.items()}


def inputs():
    return {"x": torch.randn(4, IN), "labels": torch.randint(0, CLASSES, (4,))}


INPUT_PLACEMENTS = {"x": scalify.Shard(0), "labels": scalify.Shard(0)}
OUTPUT_PLACEMENTS = [scalify.Replicate()] * 7
