"""Runs code written for CUDA on the capture device (meta or cpu), as if a GPU were there.

`as_gpu(device)` patches the `torch.cuda` entry points such code calls (device queries, RNG
state, streams, events, NVTX, synchronisation; Megatron's RNG tracker reaches for
`default_generators` and `_lazy_call`) and maps CUDA devices in factory kwargs and in
`.to(...)`/`.cuda()` onto `device` with a TorchFunctionMode. Everything is restored on exit.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes


class _Stream:
    """A stream or event that has always finished."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., Any]:  # wait_stream, record, synchronize...
        return lambda *args, **kwargs: True if name == "query" else None


class _Generator:
    """A CUDA generator's state handling, on a CPU state tensor (copied with no capture mode
    on: RNG bookkeeping is not part of the program)."""

    def __init__(self) -> None:
        self.state = torch.get_rng_state()

    def get_state(self) -> torch.Tensor:
        with _disable_current_modes():
            return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        with _disable_current_modes():
            self.state = state.clone()

    def manual_seed(self, seed: int) -> _Generator:
        with _disable_current_modes():
            self.state = torch.Generator().manual_seed(seed).get_state()
        return self

    graphsafe_get_state = get_state
    graphsafe_set_state = set_state

    def seed(self) -> int:
        return 0

    def initial_seed(self) -> int:
        return 0


def _nothing() -> Callable[..., None]:
    """A fresh do-nothing function (one object per patched name)."""
    return lambda *args, **kwargs: None


def _cuda_patches(devices: int) -> dict[str, Any]:
    generators = tuple(_Generator() for _ in range(devices))

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        generators[0].set_state(state)

    return {
        "is_available": lambda: True, "is_initialized": lambda: True, "init": _nothing(),
        "device_count": lambda: devices, "current_device": lambda: 0, "set_device": _nothing(),
        "get_device_name": lambda *a: "scalify capture GPU",
        "get_device_capability": lambda *a: (9, 0), "is_bf16_supported": lambda *a, **k: True,
        "synchronize": _nothing(), "empty_cache": _nothing(),
        "memory_allocated": lambda *a: 0, "max_memory_allocated": lambda *a: 0,
        "get_rng_state": lambda device="cuda": generators[0].get_state(),
        "set_rng_state": set_rng_state, "manual_seed": _nothing(),
        "manual_seed_all": _nothing(), "seed": _nothing(), "seed_all": _nothing(), "initial_seed": lambda: 0,
        "default_generators": generators, "_lazy_call": lambda fn, **kwargs: fn(),
        "Stream": _Stream, "Event": _Stream, "ExternalStream": _Stream,
        "current_stream": lambda *a: _Stream(), "default_stream": lambda *a: _Stream(),
        "stream": lambda stream=None: nullcontext(stream), "set_stream": _nothing(),
        "device": lambda *a: nullcontext(), "nvtx": mock.MagicMock(),
    }


# `torch.cuda.random`'s own names for the RNG entry points (torch.cuda re-exports them).
_RANDOM_ENTRY_POINTS = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all",
                        "seed", "seed_all", "initial_seed")


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, int) and not isinstance(value, bool)


class _OnDevice(TorchFunctionMode):
    """Replaces CUDA devices (`"cuda"`, `torch.device("cuda", i)`, an integer) in calls."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0].to(self.device)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = self.device
        if func is torch.Tensor.to:
            args = tuple(self.device if _is_cuda(arg) and position else arg
                         for position, arg in enumerate(args))
        return func(*args, **kwargs)


@contextmanager
def cuda_patched(devices: int = 8) -> Iterator[None]:
    """`torch.cuda`'s entry points answer as if `devices` GPUs were there (for every thread)."""
    # torch._dynamo caches a table of torch's functions the first time it is asked: fill it
    # before the patches, or it keeps them.
    from torch._dynamo.trace_rules import get_torch_obj_rule_map
    get_torch_obj_rule_map()
    with ExitStack() as stack:
        patches = _cuda_patches(devices)
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=True))
        for name in _RANDOM_ENTRY_POINTS:  # called as torch.cuda.random.* (Megatron's tracker)
            stack.enter_context(mock.patch.object(torch.cuda.random, name, patches[name]))
        yield


@contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """CUDA devices named in calls of this thread are `device` while inside, in the backward of
    custom autograd Functions too (the autograd engine runs them without Python function modes:
    Megatron's sequence-parallel gather allocates on `torch.cuda.current_device()` there)."""
    user_backward = BackwardCFunction.apply

    def apply(node: BackwardCFunction, *args: Any) -> Any:
        with _OnDevice(device):
            return user_backward(node, *args)

    with _OnDevice(device), mock.patch.object(BackwardCFunction, "apply", apply):
        yield


@contextmanager
def as_gpu(device: torch.device | str, devices: int = 8) -> Iterator[None]:
    """CUDA code runs on `device` while inside (`devices` GPUs are reported)."""
    with cuda_patched(devices), on_device(torch.device(device)):
        yield


def capture_device(inputs: dict[str, torch.Tensor]) -> torch.device:
    """Where CUDA tensors go during a capture: where its inputs are (meta when there are none)."""
    return next((t.device for t in inputs.values() if isinstance(t, torch.Tensor)),
                torch.device("meta"))
