"""The Ray parameter server: a shard killed mid-training is restarted by Ray, recovers from the
checkpoint store, and training still reaches the threshold, at the cost the in-process harness
measures for the same failure."""
import pytest

from scalify.recovery.harness import Failure, reference_run, run_trials
from scalify.recovery.layout import Layout
from scalify.recovery.server import ParameterServer, Restart
from scalify.recovery.strategies import strategies
from scalify.recovery.workloads import LogisticRegression

# A Ray cluster per test module: under `pytest -n` these run on one worker, one at a time.
pytestmark = pytest.mark.xdist_group("ray")

TARGET, LIMIT = 30, 60
FAILURE = Failure(13, lost_shard=2)


@pytest.fixture(scope="module")
def workload():
    return LogisticRegression()


@pytest.mark.parametrize("strategy", [0, 2], ids=["traditional", "partial + prioritized"])
def test_a_killed_shard_recovers_and_training_reaches_the_threshold(local_ray, workload,
                                                                    strategy, tmp_path):
    chosen = strategies(period=8, fraction=0.25)[strategy]
    layout = Layout(workload.size, blocks=16, shards=4)
    reference = reference_run(workload, TARGET, TARGET)
    server = ParameterServer(LogisticRegression, layout, chosen, tmp_path / "ray")
    try:
        reached = server.train(reference.threshold, LIMIT, FAILURE)
    finally:
        server.close()
    assert server.restarts == [Restart(13, 2)]
    assert TARGET <= reached < LIMIT
    [in_process] = run_trials(workload, reference, layout, [chosen], [FAILURE],
                              tmp_path / "numpy")
    assert reached - TARGET == pytest.approx(in_process.rework, abs=1e-6)
    if chosen.name == "traditional":  # rolled back to iteration 8: about five redone
        assert in_process.rework > 3
