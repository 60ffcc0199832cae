"""Regions: a rank layer stack named otherwise than the reference's is compared layer by layer
with the reference's (Megatron-Core's `decoder.layers.N` against HuggingFace's `model.layers.N`),
and only when the match is unambiguous."""
from scalify.verify.regions import matched_regions, region_of


def test_a_layer_is_the_module_path_up_to_its_first_index():
    assert region_of("model.layers.3.self_attn.q_proj") == "model.layers.3"
    assert region_of("decoder.layers.12") == "decoder.layers.12"
    assert region_of("embedding.word_embeddings") == ""


def test_a_stack_only_the_ranks_name_is_matched_index_by_index():
    matched = matched_regions(["", "model.layers.0", "model.layers.1"],
                              ["", "decoder.layers.0", "decoder.layers.1"])
    assert matched == {"": "", "decoder.layers.0": "model.layers.0",
                       "decoder.layers.1": "model.layers.1"}


def test_shared_names_stay_and_an_ambiguous_or_extra_stack_is_not_renamed():
    assert matched_regions(["model.layers.0"], ["model.layers.0"]) == {
        "model.layers.0": "model.layers.0"}
    two = matched_regions(["encoder.layers.0", "decoder.layers.0"], ["blocks.0"])
    assert two == {"blocks.0": "blocks.0"}
    beyond = matched_regions(["model.layers.0"], ["decoder.layers.0", "decoder.layers.1"])
    assert beyond == {"decoder.layers.0": "decoder.layers.0", "decoder.layers.1": "decoder.layers.1"}
