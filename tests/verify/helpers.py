"""Experiment dicts for the built-in tiny models."""

LAYERS_FIELD = {"llama": "model.num_hidden_layers", "gpt2": "model.n_layer"}


def experiment(model: str, family: str, tp: int, *, layers: int = 1, logits: str = "gathered",
               bug: str | None = None, rank_symmetry: bool = True, batch: int = 1,
               fused: bool = False, shard_fn: str | None = None, **model_fields: int) -> dict:
    overrides = {LAYERS_FIELD[family]: layers, **{f"model.{k}": v for k, v in model_fields.items()}}
    return {"model": model,
            "plan": {"style": "megatron", "tensor_parallel": tp, "logits": logits, "planted_bug": bug,
                     "fused": fused, "shard_fn": shard_fn},
            "hardware": {"name": f"gpu-{tp}", "target": "gpu", "devices": tp},
            "inputs": {"batch": batch, "seq": 8}, "overrides": overrides,
            "verify": {"rank_symmetry": rank_symmetry}}


def assert_verified(report) -> None:
    """Verified, and the numeric cross-check agrees."""
    assert report.verdict == "verified", report.discrepancies[:1]
    assert report.numeric["agrees"]


def assert_caught(report) -> None:
    """A discrepancy, and the numbers differ."""
    assert report.verdict == "discrepancy"
    assert not report.numeric["agrees"]
