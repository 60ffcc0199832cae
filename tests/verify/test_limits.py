"""Verdict discipline: a window past its e-node or time limit, or holding a shape conflict, gives
no answer, and the run's verdict is "unknown" with the reasons, never "verified"."""
import pytest

import scalify
from scalify.api import _limits
from scalify.cli import exit_code
from scalify.config import load_experiment
from scalify.errors import ConfigError
from scalify.verify.session import EgglogSession, ShapeConflict, WindowLimitExceeded, WindowLimits

from .helpers import experiment


def _limited(config: dict, nodes: int) -> dict:
    return {**config, "verify": {**config["verify"], "window_nodes": nodes}}


def test_a_window_past_its_node_limit_makes_a_correct_run_unknown():
    report = scalify.verify(_limited(experiment("llama-tiny", "llama", 2), 200), numeric=True)
    assert report.verdict == "unknown" and not report.verified and not report.discrepancies
    assert report.unknown and "past 200 e-nodes" in report.unknown[0]
    assert "modeling_llama.py:" in report.unknown[0]  # the op's source line
    assert report.numeric["agrees"]
    assert exit_code(report) == 3


def test_a_limit_never_turns_a_planted_bug_into_verified():
    config = experiment("llama-tiny", "llama", 2, bug="missing-allreduce")
    report = scalify.verify(_limited(config, 200), numeric=True)
    assert report.verdict in ("unknown", "discrepancy") and not report.verified


def test_the_default_limits_leave_correct_runs_verified():
    assert scalify.verify(experiment("llama-tiny", "llama", 2)).verdict == "verified"


def test_a_window_past_its_time_limit_gives_no_answer():
    session = EgglogSession(limits=WindowLimits(seconds=0.0))
    with pytest.raises(WindowLimitExceeded, match="took over 0 s"):
        session.saturate('(let $y (binary "add" (dist "a") (dist "b")))')


_RELATED_AT_ONCE = ('(let $y (binary "add" (dist "a") (dist "b")))\n'
                    '(union (dist "c") (binary "add" (dist "a") (dist "b")))')


def test_a_grown_window_stops_with_the_relation_it_has_found():
    with pytest.raises(WindowLimitExceeded):  # the prelude alone is past 10 e-nodes
        EgglogSession(limits=WindowLimits(nodes=10)).saturate(_RELATED_AT_ONCE)
    settling = EgglogSession(limits=WindowLimits(nodes=10, settle_nodes=1))
    assert settling.saturate(_RELATED_AT_ONCE).term == '(dist "c")'


_TWO_SIZES = ('(let $y (binary "add" (dist "a") (dist "a")))\n'
              '(set (dimsize (dist "a") 0) 4)\n(set (dimsize (dist "b") 0) 8)\n'
              '(union (dist "a") (dist "b"))')


def test_a_window_that_unites_tensors_of_two_sizes_gives_no_answer():
    session = EgglogSession()
    with pytest.raises(ShapeConflict, match="shape conflict"):
        session.saturate(_TWO_SIZES)
    with pytest.raises(ShapeConflict):
        session.holds(_TWO_SIZES, ['(binary "add" (dist "b") (dist "b"))'])
    agreeing = _TWO_SIZES.replace("0) 8)", "0) 4)")
    assert session.holds(agreeing, ['(binary "add" (dist "b") (dist "b"))'])  # still usable


@pytest.mark.parametrize("field", ["window_nodes", "window_seconds", "window_search_nodes",
                                   "window_settle_nodes", "window_escalate_nodes"])
def test_limits_must_be_positive(field):
    config = experiment("llama-tiny", "llama", 2)
    config["verify"][field] = 0
    with pytest.raises(ConfigError, match=f"verify.{field}"):
        load_experiment(config)


def test_the_limits_are_read_from_the_config():
    config = experiment("llama-tiny", "llama", 2)
    config["verify"].update(window_nodes=9, window_seconds=8, window_search_nodes=7,
                            window_settle_nodes=6, window_escalate_nodes=5)
    assert _limits(load_experiment(config)) == WindowLimits(9, 8, search_nodes=7, settle_nodes=6,
                                                            escalate_nodes=5)


def test_an_escalating_window_grows_to_four_times_its_size_or_the_escalation_floor():
    """A small window escalates far (cheap, and the fused-QKV relation lies 8x out); a large one
    at most fourfold (a window with no relation to find would pay for every e-node up to the
    search bound)."""
    session = EgglogSession(limits=WindowLimits(search_nodes=300_000, escalate_nodes=50_000))
    assert session._escalation_bound(1_000) == 50_000
    assert session._escalation_bound(20_000) == 80_000
    assert session._escalation_bound(100_000) == 300_000


def test_a_window_that_multiplies_its_size_stops_before_the_iteration_that_would_pass_limits():
    """One egglog iteration cannot be interrupted: a window growing 5x per iteration is stopped
    when the next one would pass the e-node or time limit, not after it ran out of memory."""
    session = EgglogSession(limits=WindowLimits(nodes=1_000_000, seconds=60.0))
    session._refuse_runaway(before=100_000, nodes=150_000, took=1.0, spent=2.0)  # slow growth
    with pytest.raises(WindowLimitExceeded, match="would pass 1000000 e-nodes"):
        session._refuse_runaway(before=100_000, nodes=500_000, took=1.0, spent=2.0)
    with pytest.raises(WindowLimitExceeded, match="would take over 60 s"):
        session._refuse_runaway(before=20_000, nodes=100_000, took=12.0, spent=15.0)


def test_a_window_whose_iterations_multiply_their_time_stops_before_the_next_one():
    """Measured on a bucketed training step: 1.6 s, 23 s, then 259 s for 4% more e-nodes; the
    window stops after the 23 s iteration. A steady pace, or iterations under a second, go on."""
    session = EgglogSession(limits=WindowLimits(seconds=60.0))
    with pytest.raises(WindowLimitExceeded, match="14.4x longer each"):
        session._refuse_runaway(before=149_680, nodes=218_172, took=23.0, spent=2.5, previous=1.6)
    session._refuse_runaway(before=149_680, nodes=218_172, took=23.0, spent=2.5, previous=20.0)
    session._refuse_runaway(before=149_680, nodes=218_172, took=0.9, spent=2.5, previous=0.05)


def test_a_slow_iteration_after_a_fast_one_stops_before_the_next():
    """Measured on a training step whose gradients are all-reduced over the wrong group: 0.5 s,
    then 8.3 s while growing fourfold, then past 14 GiB in the next. A first iteration has no
    pace to go by."""
    session = EgglogSession(limits=WindowLimits(seconds=60.0))
    with pytest.raises(WindowLimitExceeded, match="16.9x longer each"):
        session._refuse_runaway(before=61_291, nodes=257_075, took=8.3, spent=0.7, previous=0.49)
    session._refuse_runaway(before=0, nodes=257_075, took=8.3, spent=0.0, previous=0.0)


def test_a_limit_on_a_planted_bug_whose_numbers_differ_is_a_discrepancy_where_it_stopped():
    """Every op before the one whose window gave no answer is proven, and the numbers show the
    ranks do not compute the reference: the run is a discrepancy at that op. Without the
    numbers it stays unknown."""
    config = _limited(experiment("llama-tiny", "llama", 2, bug="missing-allreduce"), 200)
    report = scalify.verify(config, numeric=True)
    assert report.verdict == "discrepancy" and report.numeric["agrees"] is False
    first = report.discrepancies[0]
    assert "past 200 e-nodes" in first.hint and "the numbers differ" in first.hint
    assert report.unknown and first.ref_source.file in report.unknown[0]
    assert exit_code(report) == 1
    assert scalify.verify(config, numeric=False).verdict == "unknown"
