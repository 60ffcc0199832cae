"""Where the ranks and the reference part ways upstream of the op that fails: a column-parallel
gate/up projection whose ranks take their two halves in the wrong order fails at the `silu`,
and the report names the line that chose the halves too; so does a product whose operand was
cut from the wrong part of a fused projection (keys and values swapped)."""
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import scalify

HIDDEN, FFN, WORLD = 8, 16, 2


class GatedMLP(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * ffn, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class SwappedHalves(GatedMLP):
    """Each rank holds `[gate_r | up_r]` and takes the halves the wrong way round."""

    def forward(self, x):
        up, gate = self.gate_up(x).chunk(2, dim=-1)
        return F.silu(gate) * up


def _halves(state, rank, world_size):
    weight = state["gate_up.weight"]
    gate, up = weight.chunk(2)
    return {"gate_up.weight": torch.cat([gate.chunk(world_size)[rank], up.chunk(world_size)[rank]])}


def test_the_line_taking_the_wrong_half_is_on_the_path():
    report = scalify.verify_modules(
        reference=GatedMLP(), rank_module_factory=lambda rank: SwappedHalves(FFN // WORLD),
        world_size=WORLD, example_inputs={"x": torch.randn(4, HIDDEN)}, shard_fn=_halves,
        output_placements=[scalify.Shard(1)])
    assert report.verdict == "discrepancy"
    first = report.discrepancies[0]
    lines, start = inspect.getsourcelines(SwappedHalves.forward)
    chunk_line = start + next(i for i, text in enumerate(lines) if ".chunk(" in text)
    assert first.ref_op == "silu"
    assert chunk_line in {loc.line for loc in first.path}


def _heads(t):
    return t.view(t.shape[0], 2, HIDDEN // 2).transpose(0, 1)


class Scores(nn.Module):
    """Per-head attention scores from separate query, key and value projections."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))

    def forward(self, x):
        q, k, v = (_heads(p(x)) for p in (self.q, self.k, self.v))
        return (q @ k.transpose(1, 2)).softmax(-1) @ v


class FusedScores(nn.Module):
    """One fused projection on every rank, its output cut as query, value, key."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)

    def forward(self, x):
        q, v, k = self.qkv(x).split(HIDDEN, dim=-1)
        q, k, v = _heads(q), _heads(k), _heads(v)
        return (q @ k.transpose(1, 2)).softmax(-1) @ v


def _fused(state, rank, world_size):
    return {"qkv.weight": torch.cat([state["q.weight"], state["k.weight"], state["v.weight"]])}


def test_the_line_cutting_an_operand_from_the_wrong_part_is_named():
    report = scalify.verify_modules(
        reference=Scores(), rank_module_factory=lambda rank: FusedScores(), world_size=WORLD,
        example_inputs={"x": torch.randn(4, HIDDEN)}, shard_fn=_fused,
        output_placements=[scalify.Replicate()])
    assert report.verdict == "discrepancy"
    first = report.discrepancies[0]
    lines, start = inspect.getsourcelines(FusedScores.forward)
    split_line = start + next(i for i, text in enumerate(lines) if ".split(" in text)
    assert first.ref_op == "matmul"
    assert split_line in {line for _, line in first.lines()}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        loss = F.mse_loss(self.proj(x).squeeze(-1), y)
        return (loss, *torch.autograd.grad(loss, list(self.proj.parameters())))


class BucketedDataParallel(Regression):
    """Gradients flattened into one bucket (divided by `before` there, when it is given),
    all-reduced in place, scaled by `factor` after."""

    def __init__(self, factor: float, before: int | None = None) -> None:
        super().__init__()
        self.factor, self.before = factor, before

    def forward(self, x, y):
        loss = F.mse_loss(self.proj(x).squeeze(-1), y)
        grads = torch.autograd.grad(loss, list(self.proj.parameters()))
        bucket = torch.cat([g.reshape(-1) for g in grads])
        if self.before:
            bucket = bucket / self.before
        dist.all_reduce(bucket)
        bucket.mul_(self.factor)
        parts = bucket.split([g.numel() for g in grads])
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        return (reduced / WORLD, *(p.view_as(g) for p, g in zip(parts, grads)))


def _bucketed(factor: float):
    return scalify.verify_modules(
        reference=Regression(), rank_module_factory=lambda rank: BucketedDataParallel(factor),
        world_size=WORLD, example_inputs={"x": torch.randn(4, HIDDEN), "y": torch.randn(4)},
        input_placements={"x": scalify.Shard(0), "y": scalify.Shard(0)},
        output_placements=[scalify.Replicate()] * 3, grad=True)


def test_a_bucket_scaled_right_after_its_all_reduce_verifies():
    assert _bucketed(1 / WORLD).verdict == "verified"


def test_a_wrong_scale_after_the_all_reduce_is_named():
    report = _bucketed(1 / WORLD ** 2)
    assert report.verdict == "discrepancy"
    lines, start = inspect.getsourcelines(BucketedDataParallel.forward)
    scale_line = start + next(i for i, text in enumerate(lines) if "mul_(" in text)
    assert (inspect.getsourcefile(BucketedDataParallel), scale_line) in report.discrepancies[0].lines()


def test_a_bucket_scaled_before_and_after_its_all_reduce_names_both_lines():
    report = scalify.verify_modules(
        reference=Regression(), rank_module_factory=lambda rank: BucketedDataParallel(
            1 / WORLD, before=WORLD),
        world_size=WORLD, example_inputs={"x": torch.randn(4, HIDDEN), "y": torch.randn(4)},
        input_placements={"x": scalify.Shard(0), "y": scalify.Shard(0)},
        output_placements=[scalify.Replicate()] * 3, grad=True)
    assert report.verdict == "discrepancy"
    lines, start = inspect.getsourcelines(BucketedDataParallel.forward)
    scalings = {start + i for i, text in enumerate(lines)
                if text.endswith("/ self.before\n") or "mul_(" in text}
    named = {line for file, line in report.discrepancies[0].lines()
             if file == inspect.getsourcefile(BucketedDataParallel)}
    assert len(scalings) == 2 and scalings <= named


ROWS = 4  # of the stacked gate and up weights (few: a strided cut relates row by row)


class StackedGatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(2, ROWS, HIDDEN))

    def forward(self, x):
        return F.silu(x @ self.gate_up[0].T) * (x @ self.gate_up[1].T)


class CutInCode(StackedGatedMLP):
    """Holds the full stacked weight and cuts its own rows of the gate and up weights: a block
    of rows, or (wrongly) every other row."""

    def __init__(self, rank: int, strided: bool) -> None:
        super().__init__()
        self.rank, self.strided = rank, strided

    def forward(self, x):
        part = ROWS // WORLD
        if self.strided:
            gate_up = self.gate_up[:, self.rank::WORLD]
        else:
            gate_up = self.gate_up[:, self.rank * part:(self.rank + 1) * part]
        return F.silu(x @ gate_up[0].T) * (x @ gate_up[1].T)


class CutAndFused(CutInCode):
    """Cuts its block of gate and up rows and multiplies once by them stacked ([gate | up])."""

    def forward(self, x):
        part = ROWS // WORLD
        local = self.gate_up[:, self.rank * part:(self.rank + 1) * part].flatten(0, 1)
        gate, up = (x @ local.T).chunk(2, dim=-1)
        return F.silu(gate) * up


def _cut(strided: bool, module: type = CutInCode):
    return scalify.verify_modules(
        reference=StackedGatedMLP(),
        rank_module_factory=lambda rank: module(rank, strided), world_size=WORLD,
        example_inputs={"x": torch.randn(4, HIDDEN)}, output_placements=[scalify.Shard(1)])


def test_weights_cut_in_code_by_blocks_of_rows_verify():
    assert _cut(strided=False).verdict == "verified"


def test_weights_cut_in_code_and_fused_verify():
    assert _cut(strided=False, module=CutAndFused).verdict == "verified"


def test_weights_cut_by_strided_rows_name_the_cut():
    report = _cut(strided=True)
    assert report.verdict == "discrepancy"
    lines, start = inspect.getsourcelines(CutInCode.forward)
    cut_line = start + next(i for i, text in enumerate(lines) if "::WORLD]" in text)
    assert (inspect.getsourcefile(CutInCode), cut_line) in report.discrepancies[0].lines()


_TP_GROUP = None  # set by `_grid_groups`, read by `GatheredNorm`


def _grid_groups(columns: bool) -> None:
    """Ranks [[0, 1], [2, 3]]: tensor-parallel groups are the rows (or, wrongly, the columns)."""
    global _TP_GROUP
    grid, rank = [[0, 1], [2, 3]], dist.get_rank()
    rows = [dist.new_group(row) for row in grid]
    cols = [dist.new_group([grid[0][j], grid[1][j]]) for j in range(2)]
    if columns:
        _TP_GROUP = cols[rank % 2]
    else:
        _TP_GROUP = rows[rank // 2]


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.proj(x).pow(2).sum(-1)


class GatheredNorm(Norm):
    """Column-parallel projection over a tensor-parallel pair, gathered, then the norm."""

    def __init__(self, columns: bool) -> None:
        super().__init__()
        _grid_groups(columns)
        self.proj = nn.Linear(HIDDEN, HIDDEN // 2, bias=False)

    def forward(self, x):
        parts = [torch.empty(x.shape[0], HIDDEN // 2) for _ in range(2)]
        dist.all_gather(parts, self.proj(x), group=_TP_GROUP)
        return torch.cat(parts, dim=-1).pow(2).sum(-1)


def _pairs(state, rank, world_size):
    return {"proj.weight": state["proj.weight"].chunk(2)[rank % 2].clone()}


def _gathered(columns: bool):
    return scalify.verify_modules(
        reference=Norm(), rank_module_factory=lambda rank: GatheredNorm(columns), world_size=4,
        example_inputs={"x": torch.randn(3, HIDDEN)}, shard_fn=_pairs,
        output_placements=[scalify.Replicate()])


def test_a_gather_over_the_tensor_parallel_pairs_verifies():
    assert _gathered(columns=False).verdict == "verified"


def test_a_gather_over_ranks_holding_one_shard_names_where_its_group_was_chosen():
    """The gathered value is related (the reference's halves are parts of rank 0's and rank 1's
    gathers), but each rank's gather holds one half twice: the op that reads all of it fails,
    and the report follows the gather back to the line that chose its group."""
    report = _gathered(columns=True)
    assert report.verdict == "discrepancy"
    lines, start = inspect.getsourcelines(_grid_groups)
    chosen = start + next(i for i, text in enumerate(lines) if "cols[rank % 2]" in text)
    assert (inspect.getsourcefile(_grid_groups), chosen) in report.discrepancies[0].lines()
