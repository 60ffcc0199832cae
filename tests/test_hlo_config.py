"""HLO experiments: an `hlo:` section in place of a model and plan (HLO files, or a JAX builder),
trn1/trn2 hardware bounding the TP degree, and how each mistake names its field. The
transformers-neuronx experiments read shared/ beside the repository: skipped without it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from scalify.cli import main
from scalify.config import REPO_CONFIGS, load_experiment
from scalify.errors import ConfigError
from scalify.placements import Shard

EXPERIMENTS = REPO_CONFIGS / "experiments"
NEURON = sorted(EXPERIMENTS.glob("neuron-llama-*.yaml"))
DATA = REPO_CONFIGS.parent.parent / "shared" / "data" / "transformers-neuronx-llama"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="no transformers-neuronx data beside the repo")
FILES = {"reference": "tests/test_hlo_config.py", "distributed": "tests/test_hlo_config.py"}


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        load_experiment(data)
    return str(caught.value)


@needs_data
@pytest.mark.parametrize("path", NEURON, ids=lambda p: p.stem)
def test_neuron_experiments_load_with_their_hlo_files(path: Path) -> None:
    experiment = load_experiment(path)
    hlo = experiment.hlo
    assert (experiment.model, experiment.plan, experiment.hardware.cores_per_node) == (None, None, 32)
    assert Path(hlo.reference).parent.name.startswith("tp1_")
    assert Path(hlo.distributed).parent.name == f"tp{hlo.world_size}_{path.stem.split('-')[-1]}"
    assert hlo.outputs == (Shard(0),) and experiment.world_size() == hlo.world_size


@needs_data
def test_cli_verifies_the_tp8_four_layer_neuron_experiment() -> None:
    assert main(["verify", str(EXPERIMENTS / "neuron-llama-tp8-layer4.yaml")]) == 0


def test_nine_neuron_experiments_and_a_jax_one_ship() -> None:
    assert len(NEURON) == 9
    jax = load_experiment(EXPERIMENTS / "jax-llama-block-tp2.yaml").hlo
    assert (jax.jax, jax.world_size) == ("scalify.jax_models.llama:shard_map_program", 4)


def test_trainium_hardware_allows_the_divisors_of_its_cores_per_node() -> None:
    trn1 = load_experiment({"hardware": "trn1", "hlo": {**FILES, "world_size": 8}}).hardware
    trn2 = load_experiment({"hardware": "trn2", "hlo": {**FILES, "world_size": 64}}).hardware
    assert trn1.tensor_parallel_degrees() == (1, 2, 4, 8, 16, 32)
    assert trn2.tensor_parallel_degrees()[-1] == 64


@pytest.mark.parametrize("data,message", [
    ({"hardware": "trn1", "hlo": {**FILES, "world_size": 3}},
     "<dict>: hlo.world_size: TP degree 3 is not allowed on trn1 (its 32 cores per node allow "
     "1, 2, 4, 8, 16, 32)"),
    ({"model": "llama-tiny", "plan": {"tensor_parallel": 64}, "hardware": "trn1"},
     "<dict>: plan.tensor_parallel: TP degree 64 is not allowed on trn1"),
    ({"hardware": "trn1", "hlo": {"reference": "nowhere/tp1.hlo", "distributed": FILES["reference"],
                                  "world_size": 2}},
     "<dict>: hlo.reference: no such HLO file"),
    ({"hardware": "trn1", "hlo": {"reference": FILES["reference"], "world_size": 2}},
     "<dict>: hlo.distributed: missing required key (hlo.reference is given)"),
    ({"hardware": "trn1", "hlo": {**FILES}}, "<dict>: hlo.world_size: missing required key"),
    ({"hardware": "trn1", "hlo": {**FILES, "jax": "a.b:c", "world_size": 2}},
     "<dict>: hlo: give one source"),
    ({"hardware": "trn1", "hlo": {**FILES, "world_size": 2, "outputs": ["Shard(x)"]}},
     "<dict>: hlo.outputs.0: expected Replicate(), Shard(dim) or Partial(op), got 'Shard(x)'"),
    ({"model": "llama-tiny", "hardware": "trn1", "hlo": {**FILES, "world_size": 2}},
     "<dict>: model: not used with hlo"),
    ({"hardware": "gpu-4", "hlo": {**FILES, "world_size": 2}},
     "hardware.devices: 4 devices do not match the HLO program's world size 2"),
    ({"hardware": "trn1", "hlo": {**FILES, "world_size": 2}, "verify": {"backward": True}},
     "<dict>: verify.backward: not supported with hlo"),
])
def test_each_hlo_mistake_names_its_field(data: dict, message: str) -> None:
    assert message in _error(data)


@pytest.mark.skipif(importlib.util.find_spec("torch_neuronx") is not None,
                    reason="torch_neuronx is installed here")
def test_torch_neuronx_builder_without_the_sdk_is_a_config_error() -> None:
    message = _error({"hardware": "trn1", "hlo": {"torch_neuronx": "my.model:build", "world_size": 2}})
    assert message.startswith("<dict>: hlo.torch_neuronx: needs the torch_neuronx package")
