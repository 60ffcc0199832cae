"""JAX as an HLO source: a tiny Llama block on a (dp, tp) = (2, 2) CPU mesh, partitioned by XLA
from shardings and written by hand with `shard_map`, verifies against the single-device block;
three planted bugs are caught and reported at the line that plants them.

The HLO is dumped by child processes (XLA's flags are read when JAX starts, so JAX never starts
in the test process): once for every builder here, once more through the shipped config."""
from pathlib import Path

import pytest
import torch

import scalify
from scalify.api import verify_dump
from scalify.capture.hlo import read_hlo
from scalify.capture.jax_dump import dump_jax
from scalify.config import REPO_CONFIGS
from scalify.jax_models import planted
from scalify.placements import Replicate, Shard
from scalify.verify.numeric import run_graph

AUTO = "scalify.jax_models.llama:auto_program"
BUGS = ["missing_psum", "psum_over_wrong_axis", "wq_sharded_on_head_dim"]
PLANTED = Path(planted.__file__)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    builders = [AUTO] + [f"scalify.jax_models.planted:{bug}" for bug in BUGS]
    return dict(zip(builders, dump_jax(builders, tmp_path_factory.mktemp("jax"))))


def _bug_lines() -> dict[str, int]:
    """The planted line of each bug, in order: the lines marked `# BUG` in planted.py."""
    marked = [n for n, line in enumerate(PLANTED.read_text().splitlines(), 1) if "# BUG" in line]
    return dict(zip(BUGS, marked))


def test_shardings_give_the_placements(dumps):
    dump = dumps[AUTO]
    assert dump.world_size == 4
    x, cos, wq, wo = dump.inputs[0], dump.inputs[1], dump.inputs[4], dump.inputs[7]
    assert x == Shard(0, chunk_of_rank=(0, 0, 1, 1))  # the batch over dp, replicated over tp
    assert (cos, wq, wo) == (Replicate(), Shard(1, chunk_of_rank=(0, 1, 0, 1)),
                             Shard(0, chunk_of_rank=(0, 1, 0, 1)))
    assert dump.outputs == [Shard(0, chunk_of_rank=(0, 0, 1, 1))]


def test_auto_partitioned_block_verifies_and_the_numbers_agree(dumps):
    report = verify_dump(dumps[AUTO], numeric=True)
    assert report.verdict == "verified", [(d.ref_source, d.hint) for d in report.discrepancies]
    assert report.numeric["agrees"]


def test_shard_map_block_verifies_from_its_config():
    report = scalify.verify(REPO_CONFIGS / "experiments" / "jax-llama-block-tp2.yaml")
    assert report.verdict == "verified", [(d.ref_source, d.hint) for d in report.discrepancies]
    assert report.stats["world_size"] == 4


def test_source_locations_come_from_the_stack_frame_tables(dumps):
    graph = read_hlo(dumps["scalify.jax_models.planted:missing_psum"].distributed.read_text(), 0, 4)
    reduce = next(node for node in graph if node.op == "all_reduce")  # attention's psum
    assert reduce.source.file.endswith("scalify/jax_models/llama.py")
    assert f"{PLANTED}:{_bug_lines()['missing_psum'] - 1}" in reduce.source.callers


@pytest.mark.parametrize("bug", BUGS[:2])
def test_planted_collective_bug_is_reported_at_its_line(dumps, bug):
    report = verify_dump(dumps[f"scalify.jax_models.planted:{bug}"])
    assert report.verdict == "discrepancy"
    first = report.discrepancies[0]
    assert (str(PLANTED), _bug_lines()[bug]) in first.lines(), (first.dist_source, first.hint)


def test_weight_sharded_on_the_wrong_dim_is_reported_with_its_in_specs_line(dumps):
    report = verify_dump(dumps["scalify.jax_models.planted:wq_sharded_on_head_dim"])
    assert report.verdict == "discrepancy"
    first = report.discrepancies[0]
    line = _bug_lines()["wq_sharded_on_head_dim"]
    assert any(p.startswith("wq") and f"planted.py:{line}" in p for p in first.placements), \
        first.placements


def test_sharding_custom_calls_are_identities_on_the_local_shard():
    text = """HloModule marks
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %s = f32[4]{0} custom-call(%x), custom_call_target="Sharding", sharding={devices=[2]<=[2]}
  %m = f32[4]{0} custom-call(%s), custom_call_target="SPMDFullToShardShape", sharding={manual}
  ROOT %f = f32[4]{0} custom-call(%m), custom_call_target="SPMDShardToFullShape", sharding={replicated}
}
"""
    graph = read_hlo(text)
    x = torch.arange(4.0)
    assert torch.equal(run_graph(graph, {"x": x})[graph.outputs[0]], x)
