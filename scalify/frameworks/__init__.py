"""Real frameworks' parallel code as Scalify's subjects: each module sets up at capture what its
framework needs (parallel state, RNG trackers), builds the framework's own model from a plan,
and relates its weights to the HuggingFace reference's by name, as checkpoint converters do."""


def rope_theta(hf_config) -> float:
    """A HuggingFace Llama config's rotary base (in `rope_parameters` since transformers 5)."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
