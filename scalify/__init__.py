"""Scalify: prove that a distributed model computes what its single-device reference computes."""
from .api import verify, verify_graphs, verify_hlo, verify_jax, verify_modules
from .capture.shard_fn import infer_placements
from .placements import Custom, Partial, Piece, Replicate, Shard
from .report.model import Discrepancy, Report

__all__ = ["Custom", "Discrepancy", "Partial", "Piece", "Replicate", "Report", "Shard",
           "infer_placements", "verify", "verify_graphs", "verify_hlo", "verify_jax",
           "verify_modules"]
