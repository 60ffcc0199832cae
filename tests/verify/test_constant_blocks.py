"""Constants a rank cuts from a table built whole, or computes for its own rows, relate to the
reference's: each rank's chunk of a rotary table (viewed, then split into halves) is a slice of
the reference's halves, and a rank's causal mask from its own query positions is a block of the
reference's whole mask. Every rank taking the first chunk is caught, and the line that cut it
is on the report's path."""
import inspect

import pytest
import torch
from torch import nn

import scalify
from scalify.ir.distributed import constant_terms, constant_values
from scalify.ir.graph import Graph, Node
from scalify.verify.constants import ConstantOrigins

SEQ, DIM, WORLD = 8, 4, 2


class Rotary(nn.Module):
    """Scales each position's pairs by a table's cos and sin halves, then adds a causal mask
    (rows: query positions, columns: key positions)."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        angles = torch.arange(SEQ * DIM // 2, dtype=torch.float32).reshape(SEQ, DIM // 2) / 7
        self.register_buffer("table", torch.stack([angles.cos(), angles.sin()], -1),
                             persistent=False)

    def rows(self, seq: int) -> torch.Tensor:
        return self.table.chunk(WORLD)[self.rank] if self.rank is not None else self.table

    def forward(self, x):
        seq = x.shape[1]
        table = self.rows(seq).view(1, seq, DIM // 2, 2)
        pairs = x.view(*x.shape[:-1], DIM // 2, 2)
        cos, sin = table[..., 0], table[..., 1]
        out = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin,
                           pairs[..., 0] * sin + pairs[..., 1] * cos], -1).flatten(2)
        first = 0 if self.rank is None else self.rank * seq
        mask = torch.arange(first, first + seq)[:, None] >= torch.arange(SEQ)[None, :]
        return out.sum(-1, keepdim=True) + mask.float()


class FirstRows(Rotary):
    """Every rank takes the table's first rows, whatever its share of the sequence."""

    def rows(self, seq: int) -> torch.Tensor:
        return self.table[:seq]


def _verify(rank_module):
    return scalify.verify_modules(
        reference=Rotary(), rank_module_factory=lambda rank: rank_module(rank), world_size=WORLD,
        example_inputs={"x": torch.randn(2, SEQ, DIM)},
        input_placements={"x": scalify.Shard(1)}, output_placements=[scalify.Shard(1)],
        numeric=True)


def test_each_rank_s_chunk_of_a_table_and_its_own_mask_rows_verify():
    report = _verify(Rotary)
    assert report.verdict == "verified" and report.numeric["agrees"]


def test_every_rank_taking_the_first_rows_is_caught_and_the_cut_is_on_the_path():
    report = _verify(FirstRows)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    lines, start = inspect.getsourcelines(FirstRows.rows)
    cut = start + next(i for i, text in enumerate(lines) if "self.table[:seq]" in text)
    assert (inspect.getsourcefile(FirstRows), cut) in report.discrepancies[0].lines()


def _constants(*values: torch.Tensor) -> tuple[ConstantOrigins, list[str]]:
    graph = Graph()
    for i, value in enumerate(values):
        graph.add(Node(f"c{i}", "literal", (), (("dtype", "float32"), ("shape", tuple(value.shape)),
                                                 ("values", tuple(value.reshape(-1).tolist()))),
                       tuple(value.shape), "float32"))
    terms = constant_terms(graph)
    constants = ConstantOrigins()
    constants.add(graph, terms, constant_values(graph))
    return constants, [terms[f"c{i}"] for i in range(len(values))]


@pytest.mark.parametrize("start", [0, 3])
def test_a_constant_whose_values_are_rows_of_another_is_their_slice(start):
    whole = torch.arange(12.0).reshape(6, 2)
    constants, (big, small) = _constants(whole, whole[start:start + 3])
    facts = constants.facts(f"{big} {small}", counts=False)
    assert f"(union {small} (slice {big} 0 {start} {start + 3}))" in facts
    assert f"(set (dimsize {big} 0) 6)" in facts


def test_a_rank_s_block_of_a_causal_mask_is_its_slice_and_the_grid_s_blocks_say_their_values():
    mask = torch.triu(torch.ones(4, 4), diagonal=1)  # (as floats: literals here are float32)
    constants, (whole, own) = _constants(mask, mask[2:4, 2:4])
    facts = constants.facts(f"{whole} {own}", counts=False)
    for start in (0, 2):  # the diagonal blocks have its values
        assert f"(union {own} (slice (slice {whole} 0 {start} {start + 2}) 1 {start} {start + 2}))" in facts
    assert f'(uniform (slice (slice {whole} 0 0 2) 1 2 4) "1.0")' in facts  # wholly future
    assert f'(uniform (slice (slice {whole} 0 2 4) 1 0 2) "0.0")' in facts  # wholly past
    assert not [f for f in facts if f"slice {whole} 0 0 2) 1 0 2)" in f and "uniform" in f]


def test_a_constant_of_other_values_is_no_block():
    constants, (big, small) = _constants(torch.arange(12.0).reshape(6, 2), torch.ones(3, 2))
    assert not [f for f in constants.facts(f"{big} {small}", counts=False) if "union" in f]


def test_a_negative_number_is_the_negation_of_the_positive_one():
    """-1 broadcast (one program's `-grad`) is the negation of 1 broadcast (the other's `grad`
    negated): the window says so, and egglog proves it."""
    from scalify.verify.session import EgglogSession

    constants, (minus, plus) = _constants(torch.full((12,), -1.0), torch.full((12,), 1.0))
    facts = constants.facts(minus, counts=False)
    negations = [fact for fact in facts if '(unary "neg"' in fact]
    assert len(negations) == 1 and plus.split()[1] in negations[0]
    program = "\n".join([f"(let $y {minus})", *facts])
    leaf = plus[plus.index("(const"):plus.index(")") + 1]
    assert EgglogSession().holds(program, [f'(expand (unary "neg" {leaf}) 0 12)'])
    assert not [f for f in constants.facts(plus, counts=False) if "neg" in f]  # nor the positive


def test_a_constant_of_ones_says_so_and_a_product_with_it_is_the_other_operand():
    from scalify.verify.session import EgglogSession

    constants, (ones, other) = _constants(torch.ones(12), torch.full((12,), 2.0))
    facts = constants.facts(f"{ones} {other}", counts=False)
    leaf = ones[ones.index("(const"):ones.index(")") + 1]
    assert f"(ones {leaf})" in facts and not [f for f in facts if other in f and "(ones" in f]
    program = "\n".join([f'(let $y (binary "mul" (dist "x") {ones}))', *facts])
    assert EgglogSession().holds(program, ['(dist "x")'])


def test_a_product_with_minus_one_broadcast_is_the_negation_of_the_other_operand():
    """torchtitan's `mask.float() - 1.0` is -1 where the mask is off: a product with -1s is the
    negated operand (the positive ones' facts are stated with the negation)."""
    from scalify.verify.session import EgglogSession

    constants, (minus,) = _constants(torch.full((12,), -1.0))
    facts = constants.facts(minus, counts=False)
    assert [f for f in facts if f.startswith("(ones ")]
    program = "\n".join([f'(let $y (binary "mul" {minus} (dist "x")))', *facts])
    assert EgglogSession().holds(program, ['(unary "neg" (dist "x"))'])
