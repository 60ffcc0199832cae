"""HLO text into the IR: parsing, source locations, op lowerings (checked on numbers),
collectives and their replica groups, and the error an unknown op raises."""
import pytest
import torch

from scalify.capture.hlo import read_hlo
from scalify.capture.hlo_groups import parse_replica_groups
from scalify.capture.hlo_text import parse_module
from scalify.errors import CaptureError
from scalify.ir.distributed import merge_ranks
from scalify.verify.numeric import run_graph

NEURON_STACK = (
    "/opt/app/test.py\\n----\\n[\\'/opt/app/test.py:46\\', "
    "\\'/opt/lib/site-packages/torch_neuronx/pyhlo/scribe.py:265\\', "
    "\\'/opt/app/src/transformers_neuronx/layers/attention.py:126\\', "
    "\\'/opt/app/src/transformers_neuronx/hlo.py:891\\', "
    "\\'/opt/lib/site-packages/torch_neuronx/pyhlo/scribe.py:561\\']")

MODULE = f"""HloModule small, entry_computation_layout={{(f32[4,6]{{1,0}}, f32[6,3]{{1,0}})->(f32[4,3]{{1,0}}, f32[4]{{0}})}}

%sum.1 (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.2 = f32[] add(f32[] %a, f32[] %b)
}}

ENTRY %main.9 (x: f32[4,6], w: f32[6,3]) -> (f32[4,3], f32[4]) {{
  %x = f32[4,6]{{1,0}} parameter(0)
  %w = f32[6,3]{{1,0}} parameter(1)
  %dot.3 = f32[4,3]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{op_type="<module>" source_file="{NEURON_STACK}" source_line=46}}
  %zero = f32[] constant(0)
  %reduce.4 = f32[4]{{0}} reduce(%x, %zero), dimensions={{1}}, to_apply=%sum.1
  ROOT %tuple.5 = (f32[4,3]{{1,0}}, f32[4]{{0}}) tuple(%dot.3, %reduce.4)
}}
"""


def test_parser_reads_computations_shapes_layouts_and_the_root():
    module = parse_module(MODULE)
    assert module.entry == "main.9" and set(module.computations) == {"sum.1", "main.9"}
    entry = module.entry_computation
    assert [p.name for p in entry.parameters()] == ["x", "w"]
    dot = next(i for i in entry.instructions if i.name == "dot.3")
    assert (dot.opcode, dot.shape.dims, dot.operands) == ("dot", (4, 3), ("x", "w"))
    assert dot.attrs["lhs_contracting_dims"] == "{1}"
    assert entry.root == "tuple.5"
    assert [e.dims for e in next(i for i in entry.instructions if i.name == "tuple.5").shape.elements] \
        == [(4, 3), (4,)]
    assert module.computations["sum.1"].root == "add.2"  # operands written with their shapes
    assert (dot.shape.layout, entry.parameters()[0].shape.layout) == ((1, 0), (1, 0))


def test_names_without_percent_and_operands_with_shapes_are_read():
    text = """HloModule plain
ENTRY main.4 {
  Arg_0.1 = f32[8]{0} parameter(0)
  Arg_1.2 = f32[8]{0} parameter(1)
  ROOT add.3 = f32[8]{0} add(f32[8]{0} Arg_0.1, f32[8]{0} Arg_1.2)
}
"""
    add = parse_module(text).entry_computation.instructions[-1]
    assert (add.name, add.operands) == ("add.3", ("Arg_0.1", "Arg_1.2"))


def test_called_computations_are_inlined():
    text = """HloModule calls
%double (p: f32[3]) -> f32[3] {
  %p = f32[3]{0} parameter(0)
  ROOT %d = f32[3]{0} add(%p, %p)
}
%fused (q: f32[3]) -> f32[3] {
  %q = f32[3]{0} parameter(0)
  ROOT %e = f32[3]{0} exponential(%q)
}
ENTRY %main (x: f32[3]) -> f32[3] {
  %x = f32[3]{0} parameter(0)
  %c = f32[3]{0} call(%x), to_apply=%double
  ROOT %f = f32[3]{0} fusion(%c), kind=kLoop, calls=%fused
}
"""
    graph = read_hlo(text)
    x = torch.randn(3, dtype=torch.float64)
    assert torch.allclose(run_graph(graph, {"x": x})[graph.outputs[0]], torch.exp(2 * x))


def test_lowered_module_computes_what_the_hlo_means():
    graph = read_hlo(MODULE)
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    values = run_graph(graph, {"x": x, "w": w})
    product, total = (values[name] for name in graph.outputs)
    assert torch.allclose(product, x @ w) and torch.allclose(total, x.sum(1))


def test_source_location_is_the_innermost_user_frame_of_the_neuron_stack():
    graph = read_hlo(MODULE)
    source = next(node for node in graph if node.op == "matmul").source
    assert (source.file, source.line) == (
        "/opt/app/src/transformers_neuronx/layers/attention.py", 126)
    assert source.callers == ("/opt/app/test.py:46",)  # torch_neuronx and hlo.py helpers skipped
    assert source.code == ("HLO line 12: %dot.3 = f32[4,3]{1,0} dot(%x, %w), "
                           "lhs_contracting_dims={1}, rhs_contracting_dims={0}")


def test_source_location_from_the_stack_frame_tables():
    text = """HloModule framed

FileNames
1 "/src/model.py"
2 "/src/train.py"

FunctionNames
1 "forward"
2 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=4 end_column=9}
2 {file_name_id=2 function_name_id=2 line=30 end_line=30 column=2 end_column=8}

StackFrames
1 {file_location_id=2 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  ROOT %exp = f32[2]{0} exponential(%x), metadata={op_name="jit(step)/exp" stack_frame_id=2}
}
"""
    graph = read_hlo(text)
    node = graph[graph.outputs[0]]
    assert (node.source.file, node.source.line) == ("/src/model.py", 12)
    assert node.source.callers == ("/src/train.py:30",)


DOT_GATHER = """HloModule ops
ENTRY %main (a: f32[2,3,4,5], b: f32[2,5,3,6], t: f32[6,4,2], i: s32[1]) -> (f32[3,2,4,6], f32[1,6,2], f32[3,2,4]) {
  %a = f32[2,3,4,5]{3,2,1,0} parameter(0)
  %b = f32[2,5,3,6]{3,2,1,0} parameter(1)
  %dot = f32[3,2,4,6]{3,2,1,0} dot(%a, %b), lhs_batch_dims={1,0}, lhs_contracting_dims={3}, rhs_batch_dims={2,0}, rhs_contracting_dims={1}
  %t = f32[6,4,2]{2,1,0} parameter(2)
  %tr = f32[4,6,2]{2,1,0} transpose(%t), dimensions={1,0,2}
  %i = s32[1]{0} parameter(3)
  %g = f32[1,6,2]{2,1,0} gather(%tr, %i), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,6,2}
  %m = f32[3,2,1,1]{3,2,1,0} slice(%dot), slice={[0:3], [0:2], [1:2], [5:6]}
  %r = f32[3,2]{1,0} reshape(%m)
  %bc = f32[3,2,4]{2,1,0} broadcast(%r), dimensions={0,1}
  %io = s32[3,2,4]{2,1,0} iota(), iota_dimension=2
  %iof = f32[3,2,4]{2,1,0} convert(%io)
  %sel = pred[3,2,4]{2,1,0} compare(%bc, %iof), direction=GT
  %out = f32[3,2,4]{2,1,0} select(%sel, %bc, %iof)
  ROOT %tuple = (f32[3,2,4,6]{3,2,1,0}, f32[1,6,2]{2,1,0}, f32[3,2,4]{2,1,0}) tuple(%dot, %g, %out)
}
"""


def test_dot_with_batch_dims_gather_broadcast_and_select_compute_what_the_hlo_means():
    graph = read_hlo(DOT_GATHER)
    a, b = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(2, 5, 3, 6, dtype=torch.float64)
    t, i = torch.randn(6, 4, 2, dtype=torch.float64), torch.tensor([2], dtype=torch.int32)
    values = run_graph(graph, {"a": a, "b": b, "t": t, "i": i})
    dot, gathered, selected = (values[name] for name in graph.outputs)
    expected = torch.einsum("bhqd,bdhk->hbqk", a, b)
    assert torch.allclose(dot, expected)
    assert torch.allclose(gathered, t.transpose(0, 1)[2:3])
    corner = expected[:, :, 1, 5].unsqueeze(-1).expand(3, 2, 4)
    positions = torch.arange(4, dtype=torch.float64).expand(3, 2, 4)
    assert torch.allclose(selected, torch.where(corner > positions, corner, positions))


def test_dynamic_slice_and_update_with_constant_starts_are_clamped_like_hlo():
    text = """HloModule dynamic
ENTRY %main (x: f32[4,6], u: f32[2,3]) -> (f32[2,3], f32[4,6]) {
  %x = f32[4,6]{1,0} parameter(0)
  %u = f32[2,3]{1,0} parameter(1)
  %one = s32[] constant(1)
  %far = s32[] constant(5)
  %d = f32[2,3]{1,0} dynamic-slice(%x, %one, %far), dynamic_slice_sizes={2,3}
  %w = f32[4,6]{1,0} dynamic-update-slice(%x, %u, %one, %one)
  ROOT %t = (f32[2,3]{1,0}, f32[4,6]{1,0}) tuple(%d, %w)
}
"""
    graph = read_hlo(text)
    x, u = torch.randn(4, 6, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    values = run_graph(graph, {"x": x, "u": u})
    sliced, written = (values[name] for name in graph.outputs)
    assert torch.equal(sliced, x[1:3, 3:6])  # start 5 clamped to 3
    expected = x.clone()
    expected[1:3, 1:4] = u
    assert torch.equal(written, expected)


@pytest.mark.parametrize("text,groups", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", ((0, 1, 2, 3),)),
    ("[2,2]<=[4]", ((0, 1), (2, 3))),
    ("[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
    ("mesh[x=2,y=2] {y}", ((0, 1), (2, 3))),
    ("mesh[x=2,y=2] {x}", ((0, 2), (1, 3))),
], ids=["explicit", "all", "iota", "iota-transposed", "mesh-inner-axis", "mesh-outer-axis"])
def test_replica_groups_in_every_spelling(text, groups):
    assert parse_replica_groups(text, 4) == groups


COLLECTIVES = """HloModule spmd
%add (p: f32[], q: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %s = f32[] add(%p, %q)
}
ENTRY %main (x: f32[2,4]) -> (f32[2,4], f32[2,8], f32[2,4], u32[], f32[2,1], f32[2,4]) {
  %x = f32[2,4]{1,0} parameter(0)
  %ar = f32[2,4]{1,0} all-reduce(%x), replica_groups=[2,2]<=[4], to_apply=%add
  %ag = f32[2,8]{1,0} all-gather(%x), replica_groups={{0,2},{1,3}}, dimensions={1}
  %cp = f32[2,4]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %id = u32[] partition-id()
  %rs = f32[2,1]{1,0} reduce-scatter(%x), replica_groups={}, dimensions={1}, to_apply=%add
  %a2a = f32[2,4]{1,0} all-to-all(%x), replica_groups={{0,1},{2,3}}, dimensions={1}
  ROOT %t = (f32[2,4]{1,0}, f32[2,8]{1,0}, f32[2,4]{1,0}, u32[], f32[2,1]{1,0}, f32[2,4]{1,0}) tuple(%ar, %ag, %cp, %id, %rs, %a2a)
}
"""


def test_collectives_are_lowered_per_device_and_merge_across_devices():
    graphs = [read_hlo(COLLECTIVES, device, 4) for device in range(4)]
    reduce = next(n for n in graphs[2] if n.op == "all_reduce")
    assert reduce.attr("group") == (2, 3) and reduce.attr("reduce") == "sum"
    assert next(n for n in graphs[1] if n.op == "all_gather").attr("group") == (1, 3)
    assert graphs[3][graphs[3].outputs[3]].attr("value") == 3  # partition-id
    inputs = {f"r{r}/x": (r + 1) * torch.arange(8, dtype=torch.float64).reshape(2, 4)
              for r in range(4)}
    merged = merge_ranks(graphs)  # each receive reads its peer's sent tensor
    values = run_graph(merged.graph, inputs)
    reduced, gathered, permuted, _, scattered, exchanged = (
        values[name] for name in merged.rank_outputs[2])
    x = inputs["r0/x"]
    assert torch.equal(reduced, 7 * x)  # ranks 2 + 3
    assert torch.equal(gathered, torch.cat([x, 3 * x], 1))  # ranks 0 and 2 along dim 1
    assert torch.equal(permuted, 2 * x)  # from rank 1
    assert torch.equal(scattered, 10 * x[:, 2:3])  # block 2 of the sum over all four
    assert torch.equal(exchanged, torch.cat([3 * x[:, :2], 4 * x[:, :2]], 1))  # block 0 of 2, 3


def test_unknown_op_names_the_op_and_the_hlo_line():
    text = """HloModule unknown
ENTRY %main (x: c64[8]) -> c64[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %f = f32[8]{0} cbrt(%x)
}
"""
    with pytest.raises(CaptureError, match=r"HLO line 4 \(%f, cbrt\): unsupported HLO op 'cbrt'"):
        read_hlo(text)


def test_unknown_custom_call_target_is_named():
    text = """HloModule custom
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} custom-call(%x), custom_call_target="MyKernel"
}
"""
    with pytest.raises(CaptureError, match="custom-call target 'MyKernel'"):
        read_hlo(text)


def test_a_declared_shape_the_op_does_not_give_is_an_error():
    text = """HloModule wrong
ENTRY %main (x: f32[2,3]) -> f32[2,3] {
  %x = f32[2,3]{1,0} parameter(0)
  ROOT %t = f32[2,3]{1,0} transpose(%x), dimensions={1,0}
}
"""
    with pytest.raises(CaptureError, match=r"gives shape \[3, 2\], the instruction declares \[2, 3\]"):
        read_hlo(text)
