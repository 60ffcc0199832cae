"""The numeric meaning and shape rules of the ops added for full core-ATen coverage: aten ops
applied as uninterpreted functions, exact integer division and xor, products, random draws."""
import pytest
import torch

from scalify.ir.distributed import constant_keys
from scalify.ir.graph import Graph, Node
from scalify.ir.ops import OPS, infer_shape
from scalify.ir.uninterpreted import APPLICATIONS

NUMBERS = torch.tensor([-7, -6, -1, 0, 1, 6, 7])
DIVISORS = torch.tensor([2, -4, 3, 5, -3, 4, 7])


def test_integer_division_rounds_exactly_as_python_does():
    floor = OPS["div_floor"].run([NUMBERS, DIVISORS], {})
    trunc = OPS["div_trunc"].run([NUMBERS, DIVISORS], {})
    pairs = list(zip(NUMBERS.tolist(), DIVISORS.tolist()))
    assert floor.tolist() == [a // b for a, b in pairs]
    assert trunc.tolist() == [int(a / b) for a, b in pairs]
    assert floor.dtype == trunc.dtype == torch.int64


def test_bitwise_xor_on_integers():
    assert OPS["bitwise_xor"].run([NUMBERS, DIVISORS], {}).tolist() == [
        a ^ b for a, b in zip(NUMBERS.tolist(), DIVISORS.tolist())]


def test_prod_keeps_the_reduced_dim():
    x = torch.arange(1.0, 7.0).reshape(2, 3)
    assert infer_shape("prod", [(2, 3)], {"dim": 1}) == (2, 1)
    assert OPS["prod"].run([x], {"dim": 1}).flatten().tolist() == [6.0, 120.0]


def test_an_application_rebuilds_the_call_it_recorded():
    conv = APPLICATIONS["convolution"]
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    inputs, attrs = conv.attributes([x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1], {},
                                    lambda v: isinstance(v, torch.Tensor))
    assert len(inputs) == 2 and attrs["bias"] is None and attrs["stride"] == (2, 2)
    expected = torch.nn.functional.conv2d(x, w, stride=2, padding=1)
    assert torch.equal(conv.run(inputs, attrs), expected)
    assert infer_shape("convolution", [(1, 2, 5, 5), (3, 2, 3, 3)], attrs) == (1, 3, 3, 3)


def test_an_application_picks_one_output_and_fills_defaults():
    inputs, attrs = APPLICATIONS["sort"].attributes([torch.tensor([3.0, 1.0, 2.0])], {},
                                                    lambda v: isinstance(v, torch.Tensor))
    assert attrs == {"dim": -1, "descending": False}
    assert OPS["sort"].run(inputs, {**attrs, "output": 1}).tolist() == [1, 2, 0]
    assert infer_shape("sort", [(3,)], {**attrs, "output": 1}) == (3,)


def test_a_list_of_optional_index_tensors_is_recorded_by_presence():
    index_put = APPLICATIONS["index_put"]
    x, columns, values = torch.zeros(2, 3), torch.tensor([2, 0]), torch.ones(2, 2)
    inputs, attrs = index_put.attributes([x, [None, columns], values], {},
                                         lambda v: isinstance(v, torch.Tensor))
    assert attrs["indices"] == (False, True) and len(inputs) == 3
    assert OPS["index_put"].run(inputs, attrs).tolist() == [[1.0, 0.0, 1.0]] * 2


def test_arguments_an_overload_does_not_take_are_refused():
    sort = APPLICATIONS["sort"]
    with pytest.raises(ValueError, match="stable"):
        sort.attributes([torch.zeros(3)], {"stable": True}, lambda v: isinstance(v, torch.Tensor))


def test_shapes_an_overload_refuses_are_a_value_error():
    attrs = {"bias": None, "stride": (1, 1), "padding": (0, 0), "dilation": (1, 1),
             "transposed": False, "output_padding": (0, 0), "groups": 1}
    with pytest.raises(ValueError, match="convolution"):
        infer_shape("convolution", [(1, 2, 5, 5), (3, 4, 3, 3)], attrs)


@pytest.mark.parametrize("op", ["rand", "randn", "randperm"])
def test_random_draws_have_their_shape_and_dtype(op):
    dtype = "int64" if op == "randperm" else "float32"
    value = OPS[op].run([], {"shape": (6,), "dtype": dtype, "draw": "a"})
    assert tuple(value.shape) == infer_shape(op, [], {"shape": (6,)}) == (6,)
    assert str(value.dtype) == f"torch.{dtype}"
    if op == "rand":
        assert bool(((value >= 0) & (value < 1)).all())
    if op == "randperm":
        assert sorted(value.tolist()) == list(range(6))


def test_a_random_draw_is_no_constant():
    graph = Graph()
    graph.add(Node("noise", "rand", (), (("draw", "a"), ("dtype", "float32"), ("shape", (4,))),
                   (4,), "float32"))
    graph.add(Node("twice", "mul_scalar", ("noise",), (("value", 2.0),), (4,), "float32"))
    graph.add(Node("ones", "full", (), (("dtype", "float32"), ("shape", (4,)), ("value", 1.0)),
                   (4,), "float32"))
    assert set(constant_keys(graph)) == {"ones"}
