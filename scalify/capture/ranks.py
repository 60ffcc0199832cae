"""Captures every rank's program in this process, each inside its own fake process group."""
from __future__ import annotations

import gc
import multiprocessing
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..errors import CaptureError
from ..ir.graph import Graph
from .as_gpu import as_gpu, capture_device
from .dtensor import clear_sharding_caches
from .group_origins import GroupOrigins
from .plan_origins import PlanOrigins
from .tracer import capture

if TYPE_CHECKING:
    from .sampled_reads import ReadLog

RankModuleFactory = Callable[[int], torch.nn.Module]


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A process group with no communication: collectives are recorded, not run."""
    if dist.is_initialized():
        raise CaptureError("a torch.distributed process group is already initialized in this "
                           "process; Scalify captures ranks in fake process groups of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _group_ranks(group_name: str) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))


def capture_rank(factory: RankModuleFactory, rank: int, world_size: int,
                 inputs: dict[str, torch.Tensor],
                 call: Callable[[torch.nn.Module, dict[str, torch.Tensor]], Any],
                 grad: bool = False, replay: ReadLog | None = None) -> Graph:
    """Build rank `rank`'s module inside its fake process group and capture one call (with
    autograd on when `grad`; replaying the reads of `replay`, its sampled run, on meta tensors:
    real ones would compute indices from values the fake collectives never filled)."""
    clear_sharding_caches()
    origins, plans = GroupOrigins(), PlanOrigins()
    with fake_process_group(rank, world_size), origins.recording():
        with as_gpu(capture_device(inputs)), plans.recording():  # modules written for GPUs
            module = factory(rank)                                # build on this device
        if replay is not None:  # values it reads come from the sample: it runs on meta
            module = module.to("meta")
        return capture(module, lambda: call(module, inputs), inputs, _group_ranks, grad,
                       origins.of, plans.by_module_name(module), replay)


def capture_ranks(factory: RankModuleFactory, world_size: int,
                  inputs_of_rank: Callable[[int], dict[str, torch.Tensor]],
                  call: Callable[[torch.nn.Module, dict[str, torch.Tensor]], Any],
                  progress: Callable[[int], None] = lambda rank: None,
                  workers: int = 1, grad: bool = False,
                  replays: list[ReadLog] | None = None) -> list[Graph]:
    """Every rank's graph. With `workers > 1` (and fork available) the upper ranks are captured
    in forked child processes while this process captures the lower ones. `replays` are the
    ranks' sampled reads (see sampled_reads.py)."""
    def capture_some(ranks: list[int]) -> list[Graph]:
        graphs = []
        for rank in ranks:
            graphs.append(capture_rank(factory, rank, world_size, inputs_of_rank(rank), call, grad,
                                       replays[rank] if replays else None))
            progress(rank)
        return graphs

    workers = min(workers, world_size)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return capture_some(list(range(world_size)))
    shares = [list(range(world_size))[w::workers] for w in range(workers)]
    children = [fork_work(capture_some, share) for share in shares[1:]]
    by_rank = dict(zip(shares[0], capture_some(shares[0])))
    for share, (process, connection) in zip(shares[1:], children):
        graphs = receive_work(process, connection, f"capturing ranks {share}")
        if isinstance(graphs, BaseException):
            raise graphs
        by_rank.update(zip(share, graphs))
    return [by_rank[rank] for rank in range(world_size)]


def receive_work(process: Any, connection: Any, doing: str) -> Any:
    """What the child `doing` its work sent; a clear error if it died before sending."""
    died = CaptureError(f"the process {doing} died before returning its results (out of "
                        "memory?); retry with one capture worker")
    while not connection.poll(1.0):
        if not process.is_alive():
            raise died
    try:
        received = connection.recv()
    except EOFError:
        raise died from None
    process.join()
    return received


def fork_work(work: Callable[[Any], Any], ranks: Any) -> tuple[Any, Any]:
    """Run `work(ranks)` in a forked child; its results (or its error) come back over a pipe."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child() -> None:
        # Thread pools do not survive fork: a parallel torch op (OpenMP) would wait on threads
        # the child lacks, and so would dropping an egglog e-graph the parent left for the
        # garbage collector (rayon); the child runs torch on one thread and never collects
        # what it inherited.
        torch.set_num_threads(1)
        gc.freeze()
        try:
            sender.send(work(ranks))
        except BaseException as error:  # the parent re-raises it
            sender.send(error if isinstance(error, CaptureError) else CaptureError(str(error)))
        finally:
            sender.close()

    process = context.Process(target=child, daemon=True)
    process.start()
    sender.close()
    return process, receiver
