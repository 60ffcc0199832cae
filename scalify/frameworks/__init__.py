"""Real frameworks' parallel code as Scalify's subjects: each module sets up at capture what its
framework needs (parallel state, RNG trackers), builds the framework's own model from a plan,
and relates its weights to the HuggingFace reference's by name, as checkpoint converters do."""
