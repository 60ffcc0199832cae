"""The cluster configs in `cluster/` are valid for the installed Ray and run this repo's pipeline."""
import json
import re
import shlex
import tomllib
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]
# Resource each accelerated instance family must advertise to the autoscaler.
ACCELERATOR_RESOURCE = {"trn": "neuron_cores", "p4d": "GPU", "p5": "GPU", "g5": "GPU", "g6": "GPU"}


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "cluster" / name).read_text())


@pytest.fixture(scope="module")
def launcher() -> dict:
    return load("aws.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return load("rayjob.yaml")


def family(node_type: dict) -> str:
    return node_type["node_config"]["InstanceType"].split(".")[0]


def package(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower()


def accelerator_resource(node_type: dict) -> str | None:
    return next((resource for prefix, resource in ACCELERATOR_RESOURCE.items()
                 if family(node_type).startswith(prefix)), None)


def test_launcher_config_matches_rays_schema(launcher):
    schema = json.loads(files("ray.autoscaler").joinpath("ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)
    provider = launcher["provider"]
    assert (provider["type"], provider["region"]) == ("aws", "us-west-2")


def test_launcher_node_types_are_defined_and_bounded(launcher):
    types = launcher["available_node_types"]
    assert launcher["head_node_type"] in types
    for name, node_type in types.items():
        assert node_type.get("min_workers", 0) <= node_type.get("max_workers", 0), name
    workers = [t for n, t in types.items() if n != launcher["head_node_type"]]
    assert sum(t.get("min_workers", 0) for t in workers) <= launcher["max_workers"]


def test_launcher_has_gpu_and_trainium_workers_with_their_resources(launcher):
    types = launcher["available_node_types"]
    families = {family(t) for t in types.values()}
    assert {"trn1", "trn2"} <= families
    assert any(accelerator_resource(t) == "GPU" for t in types.values())
    for name, node_type in types.items():
        resource = accelerator_resource(node_type)
        if resource is not None:
            assert node_type["resources"].get(resource, 0) > 0, f"{name} lacks {resource}"
        if resource == "neuron_cores":
            assert "GPU" not in node_type["resources"], name


def test_launcher_installs_this_repo(launcher):
    mounted = [remote for remote, local in launcher["file_mounts"].items() if local == "."]
    assert any(f"pip install -e {remote}" in launcher["setup_commands"] for remote in mounted)
    assert any("ray start --head" in command for command in launcher["head_start_ray_commands"])
    assert any("ray start --address" in command for command in launcher["worker_start_ray_commands"])


def test_rayjob_entrypoint_names_repo_files(rayjob):
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    python, script, config = shlex.split(rayjob["spec"]["entrypoint"])
    assert python == "python"
    for path in (script, config):
        assert not Path(path).is_absolute() and (ROOT / path).is_file(), path
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    assert rayjob["spec"]["ttlSecondsAfterFinished"] > 0


def test_rayjob_runtime_env_installs_the_pinned_dependencies(rayjob):
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"]
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # Ray itself comes with the image.
    assert set(runtime_env["pip"]) == {dep for dep in pinned if package(dep) != "ray"}


def test_rayjob_groups_run_the_installed_ray_with_string_start_params(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert len(groups) >= 2
    for group in groups:
        containers = group["template"]["spec"]["containers"]
        assert containers
        for container in containers:
            tag = container["image"].rpartition(":")[2]
            assert tag.split("-")[0] == ray.__version__, container["image"]
        assert all(isinstance(value, str) for value in group["rayStartParams"].values())
