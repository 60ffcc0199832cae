"""torchtitan's own Llama 3 as a subject: parallelised by its own `parallelize` inside each
rank's fake process group (Scalify builds its ParallelDims and device mesh), against the same
model on one device. Its experiments are cells of the framework matrix
(tests/test_framework_matrix.py)."""


def test_a_plan_s_placements_are_read_from_torchtitan_s_own_declarations():
    from scalify.frameworks.torchtitan import declared_placements, reference_model
    from scalify.frameworks.torchtitan_plan import TorchtitanPlan
    from scalify.models import make_hf_config
    from scalify.models.presets import PRESETS
    from scalify.placements import Replicate, Shard

    hf_config = make_hf_config("llama", PRESETS["llama-tiny"].config)
    placements = declared_placements(reference_model(hf_config, TorchtitanPlan(2)).model)
    assert placements["tok_embeddings.weight"] == Shard(0)
    assert placements["layers.0.attention.wo.weight"] == Shard(1)
    assert placements["layers.0.feed_forward.w2.weight"] == Shard(1)
    assert placements["layers.0.attention_norm.weight"] == Replicate()
