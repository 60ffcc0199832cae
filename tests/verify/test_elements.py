"""Relations found by following elements: heads regrouped by an all-to-all and merged with the
batch (Ulysses sequence parallelism) verify; the head blocks returned in the wrong order are
caught at the line that reorders them; pieces of a weight several ranks hold number alike, and
constant-index gathers and scatters move ids."""
import math

import torch
import torch.distributed as dist
from torch import nn

import scalify
from scalify.ir.graph import Node
from scalify.rules.terms import evaluate, parse
from scalify.verify.elements import HeldPiece, Origins, follow_elements

WORLD, BATCH, SEQ, HEADS, DIM = 2, 2, 8, 4, 4


def _exchange(x: torch.Tensor) -> torch.Tensor:
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x.contiguous())
    return received


class Attention(nn.Module):
    """Heads merged into the batch for `bmm`; `ranks`: the sequence is sharded and heads are
    exchanged for it; `wrong_order`: the return exchange interleaves the head blocks."""

    def __init__(self, ranks: bool = False, wrong_order: bool = False) -> None:
        super().__init__()
        self.ranks, self.wrong_order = ranks, wrong_order
        self.qkv = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.out = nn.Linear(HEADS * DIM, HEADS * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM).unbind(2)
        if self.ranks:  # [b, s/P, H, d] -> [b, s, H/P, d]
            q, k, v = (_exchange(t.reshape(b, s, WORLD, HEADS // WORLD, DIM).permute(2, 0, 1, 3, 4))
                       .permute(1, 0, 2, 3, 4).reshape(b, WORLD * s, HEADS // WORLD, DIM)
                       for t in (q, k, v))
        heads = q.shape[2]
        q, k, v = (t.transpose(1, 2).reshape(b * heads, -1, DIM) for t in (q, k, v))
        probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(DIM), -1)
        context = torch.bmm(probs, v).view(b, heads, -1, DIM).transpose(1, 2)
        if self.ranks:  # [b, s, H/P, d] -> [b, s/P, H, d]
            sent = context.reshape(b, WORLD, context.shape[1] // WORLD, heads, DIM)
            received = _exchange(sent.permute(1, 0, 2, 3, 4))
            if self.wrong_order:
                context = received.permute(1, 2, 3, 0, 4).reshape(b, s, HEADS, DIM)  # the bug
            else:
                context = received.permute(1, 2, 0, 3, 4).reshape(b, s, HEADS, DIM)
        return self.out(context.reshape(b, context.shape[1], HEADS * DIM))


def _verify(wrong_order: bool = False):
    torch.manual_seed(0)
    return scalify.verify_modules(
        reference=Attention(), world_size=WORLD,
        rank_module_factory=lambda rank: Attention(ranks=True, wrong_order=wrong_order),
        example_inputs={"x": torch.randn(BATCH, SEQ, HEADS * DIM)},
        input_placements={"x": scalify.Shard(1)}, output_placements=[scalify.Shard(1)],
        numeric=True)


def test_heads_regrouped_by_all_to_all_verify():
    report = _verify()
    assert report.verdict == "verified", report.discrepancies[:1]
    assert report.numeric["agrees"]


def test_head_blocks_in_the_wrong_order_are_caught_at_the_reorder():
    report = _verify(wrong_order=True)
    assert report.verdict == "discrepancy" and not report.numeric["agrees"]
    lines = {line for _, line in report.discrepancies[0].lines()}
    source = open(__file__).read().splitlines()
    bug = next(i + 1 for i, text in enumerate(source) if text.endswith("# the bug"))
    assert bug in lines


def _node(name, op, inputs, shape):
    return Node(name, op, tuple(inputs), (), shape, "float32")


def _origins(definitions):
    shapes = {"r0/a": (2, 3, 4), "r1/a": (2, 3, 4), "r0/b": (2, 4, 5), "r1/b": (2, 4, 5)}
    return Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                   lambda name: shapes.get(name, (2, 3, 5)), lambda key: None, {})


def test_each_batch_is_found_where_a_rank_computes_it():
    """The reference's batches are the ranks' batches, stacked; with rank 1 multiplying rank 0's
    right operand, the reference's last batches are computed by no rank tensor."""
    both = '(concat (dist "r0/{0}") (dist "r1/{0}") 0 2 2)'
    value = f'(matmul {both.format("a")} {both.format("b")} 3)'
    candidates = [_node("r0/c", "matmul", ["r0/a", "r0/b"], (2, 3, 5)),
                  _node("r1/c", "matmul", ["r1/a", "r1/b"], (2, 3, 5))]
    order = {"r0/c": 0, "r1/c": 1}
    right = {"r0/c": '(matmul (dist "r0/a") (dist "r0/b") 3)',
             "r1/c": '(matmul (dist "r1/a") (dist "r1/b") 3)'}
    term = follow_elements(value, candidates, _origins(right), order)
    values = {"r0/c": torch.randn(2, 3, 5), "r1/c": torch.randn(2, 3, 5)}
    assert torch.equal(evaluate(parse(term), values), torch.cat([values["r0/c"], values["r1/c"]]))
    wrong = {**right, "r1/c": '(matmul (dist "r1/a") (dist "r0/b") 3)'}
    assert follow_elements(value, candidates, _origins(wrong), order) is None


def test_the_last_tensor_holding_the_elements_is_taken_when_asked():
    """A value the ranks hold twice (a transposed copy, then its transpose back after their
    exchange): the earliest holder by default, the last (plain, no reshape) with `latest`."""
    value = '(concat (dist "r0/a") (dist "r1/a") 0 2 2)'
    candidates = [_node(f"r{rank}/{name}", op, [f"r{rank}/{source}"], shape)
                  for rank in (0, 1) for name, op, source, shape in (
                      ("t", "transpose", "a", (3, 2, 4)), ("c", "transpose", "t", (2, 3, 4)))]
    order = {node.name: index for index, node in enumerate(candidates)}
    definitions = {f"r{rank}/{name}": f'(transpose (dist "r{rank}/{source}") 0 1)'
                   for rank in (0, 1) for name, source in (("t", "a"), ("c", "t"))}
    earliest = follow_elements(value, candidates, _origins(definitions), order)
    latest = follow_elements(value, candidates, _origins(definitions), order, latest=True)
    assert "r0/t" in earliest and "transpose" in earliest
    assert "r0/c" in latest and "r1/c" in latest and "transpose" not in latest
    values = {"r0/c": torch.randn(2, 3, 4), "r1/c": torch.randn(2, 3, 4)}
    assert torch.equal(evaluate(parse(latest), values), torch.cat([values["r0/c"], values["r1/c"]]))


def test_elements_computed_alike_on_replicas_are_one():
    """Two ranks' copies of a replicated weight, once named replicas, number alike."""
    definitions = {"r0/c": '(unary "neg" (dist "r0/w"))', "r1/c": '(unary "neg" (dist "r1/w"))'}
    origins = Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                      lambda name: (3,), lambda key: None, {"r1/w": "r0/w"})
    assert torch.equal(origins.of(parse('(dist "r0/c")')), origins.of(parse('(dist "r1/c")')))
    unnamed = Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                      lambda name: (3,), lambda key: None, {})
    assert not torch.equal(unnamed.of(parse('(dist "r0/c")')), unnamed.of(parse('(dist "r1/c")')))


def test_pieces_several_ranks_hold_number_alike():
    """A fused weight: each rank holds its own query rows and a copy of the shared kv rows."""
    pieces = {f"r{rank}/w": [HeldPiece("w", (6, 3), 0, 0, 2 * rank, 2),
                             HeldPiece("w", (6, 3), 0, 2, 4, 2)] for rank in (0, 1)}
    origins = Origins(lambda name: None, lambda name: (4, 3), lambda key: None, {}, pieces)
    kv = [origins.of(parse(f'(slice (dist "r{rank}/w") 0 2 4)')) for rank in (0, 1)]
    queries = [origins.of(parse(f'(slice (dist "r{rank}/w") 0 0 2)')) for rank in (0, 1)]
    assert torch.equal(*kv)
    assert not set(queries[0].reshape(-1).tolist()) & set(queries[1].reshape(-1).tolist())


def test_gathers_and_scatters_by_constant_indices_place_ids():
    """A block table read (`index_select`) and a cache write (`index_put`) with constant slots
    move ids; indices read from a rank tensor leave the result a fresh tensor."""
    definitions = {
        "r0/read": '(opaque2 "index|none_positions=(False,)" (dist "r0/cache") (const "ab"))',
        "r0/write": '(opaque3 "index_put|accumulate=False;indices=(True,)" (dist "r0/cache") '
                    '(const "ab") (dist "r0/new"))',
        "r0/by_rank": '(opaque2 "index|none_positions=(False,)" (dist "r0/cache") (dist "r0/ids"))'}
    shapes = {"r0/cache": (4, 3), "r0/new": (2, 3), "r0/ids": (2,)}
    origins = Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                      lambda name: shapes.get(name, (2, 3)), lambda key: (2,), {},
                      const_value=lambda key: torch.tensor([2, 0]))
    cache, new = origins.of(parse('(dist "r0/cache")')), origins.of(parse('(dist "r0/new")'))
    assert torch.equal(origins.of(parse('(dist "r0/read")')), cache[[2, 0]])
    written = cache.clone()
    written[[2, 0]] = new
    assert torch.equal(origins.of(parse('(dist "r0/write")')), written)
    assert not set(origins.of(parse('(dist "r0/by_rank")')).reshape(-1).tolist()) & set(
        cache.reshape(-1).tolist())


def test_a_slot_written_twice_is_not_numbered():
    """`index_put` with a repeated index leaves either value there: a fresh tensor."""
    definitions = {"r0/write": '(opaque3 "index_put|accumulate=False;indices=(True,)" '
                               '(dist "r0/cache") (const "ab") (dist "r0/new"))'}
    shapes = {"r0/cache": (4, 3), "r0/new": (2, 3)}
    origins = Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                      lambda name: shapes.get(name, (4, 3)), lambda key: (2,), {},
                      const_value=lambda key: torch.tensor([1, 1]))
    cache = origins.of(parse('(dist "r0/cache")'))
    written = origins.of(parse('(dist "r0/write")'))
    assert not set(written.reshape(-1).tolist()) & set(cache.reshape(-1).tolist())


def test_a_value_with_zeros_held_at_many_places_is_laid_out():
    """HF's `rotate_half(q) * sin` against Megatron's per-rank product in `[s, b, h, d]`: sin(0)
    makes the first sequence row zeros, which every rank holds at many places; the layout is read
    off the other rows and holds for the zeros too."""
    sin = torch.sin(torch.arange(8.0)[:, None] * torch.tensor([1.0, 0.5]))  # [s, d], row 0 zero
    tables = {"rank_sin": sin[:, None, None, :].expand(8, 2, 2, 2).contiguous(),  # [s, b, h, d]
              "ref_sin": sin[None, None].expand(2, 4, 8, 2).contiguous()}  # [b, h, s, d]
    origins = Origins(lambda name: parse(f'(binary "mul" (dist "{name[:3]}q") (const "rank_sin"))')
                      if name.endswith("/c") else None,
                      lambda name: (8, 2, 2, 2), lambda key: tuple(tables[key[8:-2]].shape), {},
                      const_value=lambda key: tables[key[8:-2]])
    value = ('(binary "mul" (concat (transpose (transpose (dist "r0/q") 0 1) 1 2) '
             '(transpose (transpose (dist "r1/q") 0 1) 1 2) 1 2 2) (const "ref_sin"))')
    candidates = [_node(f"r{rank}/c", "mul", [f"r{rank}/q"], (8, 2, 2, 2)) for rank in (0, 1)]
    term = follow_elements(value, candidates, origins, {"r0/c": 0, "r1/c": 1})
    assert term is not None
    products = {f"r{rank}/c": torch.randn(8, 2, 2, 2) * tables["rank_sin"] for rank in (0, 1)}
    expected = torch.cat([products[f"r{rank}/c"].permute(1, 2, 0, 3) for rank in (0, 1)], 1)
    assert torch.equal(evaluate(parse(term), products), expected)


def test_masked_scores_are_read_from_the_filled_tensors_not_the_scores_before():
    """A causal fill over two ranks' heads: each rank holds its scores before the fill and after
    it, alike but for the filled entries; the value is laid out from the filled ones."""
    mask = torch.ones(4, 4, dtype=torch.bool).triu(1).expand(2, 4, 4)
    definitions = {f"r{rank}/m": f'(masked_fill (dist "r{rank}/s") (const "mask") "-inf")'
                   for rank in (0, 1)}
    origins = Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                      lambda name: (2, 4, 4), lambda key: (2, 4, 4), {},
                      const_value=lambda key: mask)
    value = ('(masked_fill (concat (dist "r0/s") (dist "r1/s") 0 2 2) '
             '(concat (const "mask") (const "mask") 0 2 2) "-inf")')
    candidates = [_node(f"r{rank}/{name}", op, [f"r{rank}/s"], (2, 4, 4))
                  for rank in (0, 1) for name, op in (("s", "placeholder"), ("m", "masked_fill"))]
    order = {node.name: index for index, node in enumerate(candidates)}
    term = follow_elements(value, candidates, origins, order)
    assert term is not None and "/s" not in term
    scores = {f"r{rank}/m": torch.randn(2, 4, 4).masked_fill(mask, float("-inf")) for rank in (0, 1)}
    assert torch.equal(evaluate(parse(term), scores), torch.cat([scores["r0/m"], scores["r1/m"]]))


def test_a_value_past_one_querys_budget_is_numbered_over_the_next(monkeypatch):
    """Two products in a row, each within the work one query may do but not both: the second
    query resumes from the first product and numbers the value; nothing past the budget is kept
    as if computed."""
    from scalify.verify import elements

    monkeypatch.setattr(elements, "WORK_LIMIT", 100)
    value = parse('(matmul (matmul (dist "r0/a") (dist "r0/b") 2) (dist "r0/b") 2)')
    fresh = lambda: Origins(lambda name: None, lambda name: (4, 4), lambda key: None, {},
                            products="unexpanded").new_query()
    assert fresh().of(value) is None
    resumed = fresh().of_resumed(value)
    assert resumed is not None and resumed.unique().numel() == 16


def test_a_contraction_split_over_ranks_sums_to_the_whole_when_products_are_kept():
    """A row-parallel projection in a large program, of activations that are contractions
    themselves: numbered by its unexpanded products (its operands as the opaque numbering
    numbers them), the ranks' partial products summed get the reference product's ids;
    numbered opaquely (the cheap default there), they do not."""
    definitions = {f"r{rank}/c": f'(matmul (dist "r{rank}/a") (dist "r{rank}/b") 2)' for rank in (0, 1)}
    definitions |= {f"r{rank}/a": f'(matmul (dist "x") (dist "r{rank}/w") 2)' for rank in (0, 1)}
    shapes = {"r0/a": (3, 2), "r1/a": (3, 2), "r0/b": (2, 5), "r1/b": (2, 5), "x": (3, 4),
              "r0/w": (4, 2), "r1/w": (4, 2)}
    whole = parse('(matmul (concat (dist "r0/a") (dist "r1/a") 1 2 2) '
                  '(concat (dist "r0/b") (dist "r1/b") 0 2 2) 2)')
    summed = parse('(psum (dist "r0/c") (dist "r1/c"))')
    numbered = {}
    for products in ("unexpanded", "opaque"):
        make = lambda products, below=None: Origins(
            lambda name: parse(definitions[name]) if name in definitions else None,
            lambda name: shapes.get(name, (3, 5)), lambda key: None, {}, products=products,
            below=below)
        origins = make(products, make("opaque") if products == "unexpanded" else None)
        numbered[products] = origins.of(whole), origins.of(summed), origins.of(parse('(dist "r0/c")'))
    whole_ids, summed_ids, part_ids = numbered["unexpanded"]
    assert torch.equal(whole_ids, summed_ids) and not torch.equal(whole_ids, part_ids)
    assert not torch.equal(*numbered["opaque"][:2])


def test_a_maximum_split_over_ranks_is_the_whole_maximum():
    """A vocab-parallel max: each rank's max over its shard, combined by an all-reduce(MAX), gets
    the ids of the max over the whole row; a max of other elements does not."""
    shapes = {"r0/a": (3, 4), "r1/a": (3, 4)}
    definitions = {f"r{rank}/m": f'(reduce "amax" (dist "r{rank}/a") 1)' for rank in (0, 1)}
    origins = Origins(lambda name: parse(definitions[name]) if name in definitions else None,
                      lambda name: shapes.get(name, (3, 1)), lambda key: None, {})
    whole = origins.of(parse('(reduce "amax" (concat (dist "r0/a") (dist "r1/a") 1 4 4) 1)'))
    combined = origins.of(parse('(pmax (dist "r0/m") (dist "r1/m"))'))
    assert torch.equal(whole, combined)
    assert not torch.equal(whole, origins.of(parse('(dist "r0/m")')))
