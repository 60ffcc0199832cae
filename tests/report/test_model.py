"""A discrepancy says where it is: the rank op's line, or the reference's where no rank op is."""
from scalify.ir.graph import SourceLoc
from scalify.report.model import Discrepancy


def _discrepancy(dist_source: SourceLoc) -> Discrepancy:
    return Discrepancy("matmul", "n1", "attn", SourceLoc("model.py", 72, backward=True),
                       dist_source, found="", expected="", hint="")


def test_a_discrepancy_is_located_at_the_rank_op():
    assert _discrepancy(SourceLoc("parallel.py", 9)).location == "parallel.py:9"


def test_a_discrepancy_with_no_rank_op_is_located_at_the_reference_line():
    assert _discrepancy(SourceLoc()).location == \
        "model.py:72 (backward) (reference; no rank op found)"


def test_a_discrepancy_names_the_lines_that_set_what_its_nearby_ops_read():
    """A nearby rank op's Python values (a scaling factor passed as a keyword) are named, as the
    report shows them, beside its line and its callers."""
    found = _discrepancy(SourceLoc("parallel.py", 9))
    found.nearby = [SourceLoc("parallel.py", 20, callers=("train.py:4",),
                              values_from=("train.py:2",))]
    assert found.lines() == {("parallel.py", 9), ("parallel.py", 20), ("train.py", 4),
                             ("train.py", 2)}
