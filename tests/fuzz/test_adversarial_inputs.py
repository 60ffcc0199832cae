"""Adversarial inputs: hostile configs and HLO programs get a Scalify error (exit 2), never a
crash with a traceback, a hang, or a verdict. Hypothesis runs a fixed, derandomised budget."""
from __future__ import annotations

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scalify.capture.hlo import read_hlo
from scalify.cli import main
from scalify.config import load_experiment
from scalify.errors import ScalifyError

from ..capture.test_hlo import MODULE

BUDGET = settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow])
VALID = {"model": "llama-tiny", "plan": {"tensor_parallel": 2}, "hardware": "gpu-2",
         "inputs": {"batch": 1, "seq": 8}, "verify": {"numeric": False}}
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
PATHS = st.sampled_from([("model",), ("plan",), ("plan", "tensor_parallel"), ("hardware",),
                         ("inputs", "batch"), ("inputs", "seq"), ("verify",),
                         ("verify", "window_nodes"), ("overrides",), ("name",), ("engine",),
                         ("hlo",), ("tracking", "uri")])


def _loads_or_refuses(source) -> None:
    try:
        load_experiment(source)
    except ScalifyError:
        pass


@BUDGET
@given(PATHS, VALUES)
def test_a_config_with_any_value_anywhere_loads_or_is_refused(path, value):
    config = copy.deepcopy(VALID)
    target = config
    for key in path[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[path[-1]] = value
    _loads_or_refuses(config)


@BUDGET
@given(st.binary(max_size=300))
def test_any_bytes_as_a_config_file_load_or_are_refused(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "x.yaml"
    path.write_bytes(data)
    _loads_or_refuses(path)


def test_a_yaml_bomb_is_refused_quickly(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9))
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb)
    assert main(["verify", str(path)]) == 2


def test_a_non_utf8_path_and_a_missing_file_exit_2(tmp_path):
    assert main(["verify", str(tmp_path / "caf\udce9.yaml")]) == 2
    assert main(["verify", str(tmp_path / "absent.yaml")]) == 2


LINES = MODULE.splitlines()


@BUDGET
@given(st.lists(st.tuples(st.sampled_from(["drop", "repeat", "swap", "edit"]),
                          st.integers(0, len(LINES) - 1), st.text(max_size=6)), max_size=3))
def test_a_damaged_hlo_module_lowers_or_is_refused(edits):
    lines = list(LINES)
    for kind, at, text in edits:
        at %= len(lines)
        if kind == "drop":
            del lines[at]
        elif kind == "repeat":
            lines.insert(at, lines[at])
        elif kind == "swap":
            lines[at], lines[-1 - at] = lines[-1 - at], lines[at]
        else:
            cut = len(lines[at]) // 2
            lines[at] = lines[at][:cut] + text + lines[at][cut + 1:]
        if not lines:
            break
    try:
        read_hlo("\n".join(lines))
    except ScalifyError:
        pass


def test_the_fuzzed_config_strategy_starts_from_a_valid_config():
    load_experiment(copy.deepcopy(VALID))
    yaml.safe_dump(VALID)
