"""Scalify: prove that a distributed model computes what its single-device reference computes."""
from .api import verify, verify_modules
from .placements import Partial, Replicate, Shard
from .report.model import Discrepancy, Report

__all__ = ["Discrepancy", "Partial", "Replicate", "Report", "Shard", "verify", "verify_modules"]
