"""Each op names the user line that ran it: a decorator's wrapper (`typing_extensions.deprecated`
wraps torch.distributed's old names) stands for the line that called it."""
import inspect

import torch
import torch.nn.functional as F
import typing_extensions
from torch import nn

from scalify.capture.tracer import capture

# torch's own Python code behind the wrapper: no user frame between the op and the wrapper
old_softsign = typing_extensions.deprecated("use F.softsign")(F.softsign)


def test_an_op_behind_a_deprecation_wrapper_names_the_calling_line():
    x = torch.randn(3)
    line = inspect.currentframe().f_lineno + 1
    graph = capture(nn.Module(), lambda: old_softsign(x), {"x": x})
    (node, *_) = [n for n in graph if n.op != "placeholder"]
    assert (node.source.file, node.source.line) == (__file__, line)


class _Tanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


def test_callers_stop_at_the_call_from_scalify():
    """A user's forward called by the capture names the test's line, never Scalify's own."""
    x = torch.randn(3)
    module = _Tanh()
    graph = capture(module, lambda: module(x), {"x": x})
    (node, *_) = [n for n in graph if n.op != "placeholder"]
    assert node.source.callers and all(__file__ in caller for caller in node.source.callers)


class _TanhReturned(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        return y


def test_lines_that_passed_a_value_on_stop_at_the_call_from_scalify():
    """A value returned to Scalify's API names the user's return, not the API's lines nor the
    script that called the API."""
    from scalify.api import capture_modules

    reference, _ = capture_modules(_TanhReturned(), lambda rank: _TanhReturned(), 1,
                                   {"x": torch.randn(3)}, {})
    places = [place for node in reference
              for place in (*node.source.passed_at, *node.source.values_from, *node.source.callers)]
    assert places and all(place.startswith(__file__) for place in places), places


def test_a_package_whose_name_starts_with_torch_is_user_code():
    """torchtitan sits beside torch in site-packages: its lines are the user's, not torch's."""
    import os
    from scalify.capture import tracer
    beside_torch = tracer._TORCH_DIR.rstrip(os.sep) + "titan" + os.sep + "model.py"
    assert not tracer._outside_user_code(beside_torch)
    assert tracer._outside_user_code(os.path.join(tracer._TORCH_DIR, "nn", "functional.py"))
