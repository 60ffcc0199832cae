"""`ray job submit` against a local head: pipelines/verify.py verifies on the cluster, prints a
SCALIFY_RESULT line and logs the run to MLflow."""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlflow
import pytest

# A Ray cluster per test module: under `pytest -n` these run on one worker, one at a time.
pytestmark = pytest.mark.xdist_group("ray")

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
UPLOAD_EXCLUDES = [".venv", ".git", ".pytest_cache", "reports", "mlruns", "mlruns.db",
                   "*.egg-info", "__pycache__"]
PORT_FLAGS = ["port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
              "node-manager-port", "object-manager-port"]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture
def ray_head(tmp_path):
    """A one-node cluster on loopback (its own ports, temp dir and auth token); yields the
    dashboard URL and the environment that reaches it. Only the processes this fixture started
    are stopped: the head's process group."""
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    temp_dir = Path("/tmp") / f"scalify-head-{ports['port']}"  # short: socket paths are limited
    with open(tmp_path / "head.log", "w") as log:
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--disable-usage-stats",
             f"--temp-dir={temp_dir}", *(f"--{flag}={port}" for flag, port in ports.items())],
            env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _wait_for(f"{url}/api/version", head, tmp_path / "head.log")
        yield url, env
    finally:
        _stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for(url: str, head: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start exited:\n{log.read_text()}"
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:  # it answers (401 without the token): it is up
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no dashboard at {url} after {timeout} s:\n{log.read_text()}")


def _stop(head: subprocess.Popen) -> None:
    """SIGTERM to the head's process group, then SIGKILL to whatever of it is left."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=3)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait()


def test_job_submit_verifies_and_logs_to_mlflow(ray_head, tmp_path):
    url, env = ray_head
    config = tmp_path / "tiny.yaml"
    config.write_text("model: llama-tiny\nplan: megatron-tp2\nhardware: gpu-2\n"
                      "inputs: {batch: 1, seq: 8}\nengine: {actors: 1}\n")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runtime_env = {"working_dir": str(REPO), "excludes": UPLOAD_EXCLUDES}
    job = subprocess.run(
        [RAY, "job", "submit", "--address", url, "--runtime-env-json", json.dumps(runtime_env),
         "--", sys.executable, "pipelines/verify.py", str(config), "--tracking-uri", tracking],
        env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in job.stdout.splitlines() if line.startswith("SCALIFY_RESULT ")]
    assert job.returncode == 0 and lines, job.stdout[-3000:] + job.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("SCALIFY_RESULT "))
    assert result["verdict"] == "verified" and result["stats"]["engine"] == "ray"
    client = mlflow.MlflowClient(tracking_uri=tracking)
    run = client.get_run(result["stats"]["mlflow_run_id"])
    assert run.data.tags["verdict"] == "verified"
    assert run.data.params["engine.kind"] == "ray"
