"""A second run of the same model reuses the proofs the first one stored."""
import scalify
from scalify.verify.session import EgglogSession, canonicalize
from scalify.verify.store import ProofStore

from .helpers import experiment


def test_second_run_reuses_stored_proofs(tmp_path):
    config = experiment("llama-tiny", "llama", 2, layers=2)
    config["verify"] = {"memo_store": str(tmp_path / "proofs.db")}
    first = scalify.verify(config)
    second = scalify.verify(config)
    assert first.verified and second.verified
    assert first.stats["memo_misses"] > 0
    assert second.stats["memo_misses"] == 0
    assert second.stats["layer_memo_hits"] == 2


def test_store_round_trip_and_rule_versioning(tmp_path):
    store = ProofStore(tmp_path / "p.db")
    store.put("window", "text", ["(dist \"v0\")", [], []])
    store.close()
    assert ProofStore(tmp_path / "p.db").get("window", "text") == ["(dist \"v0\")", [], []]
    assert ProofStore(tmp_path / "p.db").get("layer", "text") is None


def test_sessions_running_other_rules_do_not_share_window_proofs(tmp_path):
    """A window's answer depends on the rules run: a symmetric session's proof is not handed
    to a per-rank or context-parallel session."""
    store = ProofStore(tmp_path / "p.db")
    window = '(let $y (unary "neg" (dist "a")))'
    symmetric = EgglogSession(store=store, rank_families=True)
    symmetric.saturate(window)
    assert symmetric._stored(canonicalize(window)[0]) is not None
    for other in (EgglogSession(store=store), EgglogSession(store=store, rank_families=True,
                                                            context_parallel=True)):
        assert other._stored(canonicalize(window)[0]) is None
