"""Polynomial value numbering: the same real-number value written other ways gets one id, and
ids never merge values that differ (a random-expression property test evaluates both)."""
import random
from fractions import Fraction

from scalify.verify.polynomials import EXPANSION_LIMIT, Polynomials


def test_a_contraction_split_in_two_and_summed_is_the_whole_contraction():
    poly = Polynomials()
    a, b = poly.fresh(4), poly.fresh(4)
    xs, ys = list(range(a, a + 4)), list(range(b, b + 4))
    whole = poly.dot(xs, ys)
    halves = poly.elementwise("psum", (), (poly.dot(xs[:2], ys[:2]), poly.dot(xs[2:], ys[2:])))
    assert whole == halves


def test_a_bias_added_to_both_parts_of_a_partial_sum_as_half_of_itself():
    poly = Polynomials()
    p0 = poly.fresh(3)
    p1, bias = p0 + 1, p0 + 2
    half = poly.elementwise("unary", ("div_scalar|value=2",), (bias,))
    parts = [poly.elementwise("binary", ("add",), (p, half)) for p in (p0, p1)]
    summed_then_added = poly.elementwise("binary", ("add",), (
        poly.elementwise("psum", (), (p0, p1)), bias))
    assert poly.elementwise("psum", (), tuple(parts)) == summed_then_added


def test_a_gradient_averaged_before_or_after_its_sum_is_one_value():
    poly = Polynomials()
    g0 = poly.fresh(2)
    g1 = g0 + 1
    mean_of_sum = poly.elementwise("unary", ("mul_scalar|value=0.5",),
                                   (poly.elementwise("psum", (), (g0, g1)),))
    halves = [poly.elementwise("unary", ("div_scalar|value=2",), (g,)) for g in (g0, g1)]
    assert poly.elementwise("psum", (), tuple(halves)) == mean_of_sum
    assert mean_of_sum != poly.elementwise("psum", (), (g0, g1))


def test_constant_masks_and_conditions_fold():
    poly = Polynomials()
    x = poly.fresh(2)
    y = x + 1
    true, false = poly.constant(True), poly.constant(False)
    assert poly.elementwise("masked_fill", ("0.0",), (x, false)) == x
    assert poly.elementwise("masked_fill", ("0.0",), (x, true)) == poly.zero
    assert poly.elementwise("where3", (), (true, x, y)) == x
    assert poly.elementwise("masked_fill", ("-inf",), (x, true)) == poly.constant(
        float("-inf"))
    assert poly.elementwise("binary", ("mul",), (x, poly.constant(0))) == poly.zero


def test_large_products_stay_exact_without_expanding():
    poly = Polynomials()
    start = poly.fresh(2 * EXPANSION_LIMIT)
    left = poly.linear((1, v) for v in range(start, start + EXPANSION_LIMIT))
    right = poly.linear((1, v) for v in range(start + EXPANSION_LIMIT, start + 2 * EXPANSION_LIMIT))
    twice = poly.linear([(2, left)])
    assert poly.product(twice, right) == poly.linear([(2, poly.product(left, right))])
    assert poly.product(left, right) == poly.product(right, left)


_OPS = [("psum", ()), ("unary", ("neg",)), ("unary", ("mul_scalar|value=0.5",)),
        ("unary", ("div_scalar|value=3",)), ("binary", ("add",)), ("binary", ("sub",)),
        ("binary", ("mul",)), ("unary", ("exp",))]


def _apply(head: str, attrs: tuple, values: list[Fraction]) -> Fraction:
    key = attrs[0] if attrs else ""
    if head == "psum" or key == "add":
        return values[0] + values[1]
    if key == "sub":
        return values[0] - values[1]
    if key == "mul":
        return values[0] * values[1]
    if key == "neg":
        return -values[0]
    if key.startswith("mul_scalar"):
        return values[0] / 2
    if key.startswith("div_scalar"):
        return values[0] / 3
    return Fraction(round(float(values[0]) * 7 + 1) % 11)  # an opaque function


def test_equal_ids_are_equal_values_on_random_expressions():
    rng = random.Random(0)
    for trial in range(40):
        poly = Polynomials()
        start = poly.fresh(3)
        # two assignments of the atoms: equal ids must agree under both
        points = [{start + i: Fraction(rng.randint(-5, 5)) for i in range(3)} for _ in range(2)]
        ids, values = [start, start + 1, start + 2], [[p[start + i] for i in range(3)]
                                                      for p in points]
        for _ in range(25):
            head, attrs = rng.choice(_OPS)
            arity = 1 if head == "unary" else 2
            picks = [rng.randrange(len(ids)) for _ in range(arity)]
            if head == "unary" and attrs[0] == "exp":
                new = poly.code(("unary", "exp", ids[picks[0]]))
            else:
                new = poly.elementwise(head, attrs, tuple(ids[i] for i in picks))
            ids.append(new)
            for point in values:
                point.append(_apply(head, attrs, [point[i] for i in picks]))
        seen: dict[int, list[Fraction]] = {}
        for index, value in enumerate(ids):
            here = [point[index] for point in values]
            assert seen.setdefault(value, here) == here, (trial, index)


def test_a_norm_squared_is_the_sum_of_squares_it_roots():
    poly = Polynomials()
    g = poly.fresh(3)
    squares = [poly.elementwise("unary", ("pow_scalar|value=2",), (g + i,)) for i in range(3)]
    local = poly.linear((1, s) for s in squares[:2])
    norm = poly.elementwise("unary", ("pow_scalar|value=0.5",), (local,))
    assert poly.elementwise("unary", ("pow_scalar|value=2",), (norm,)) == local
    assert poly.elementwise("unary", ("sqrt",), (local,)) == norm
    difference = poly.elementwise("binary", ("sub",), (squares[0], squares[1]))
    root = poly.square_root(difference)  # may be negative: its square is not the difference
    assert poly.product(root, root) != difference


def test_a_dot_products_size_counts_the_monomials_it_multiplies_out():
    p = Polynomials()
    first = p.fresh(3)
    x, y, w = first, first + 1, first + 2
    projected = p.dot([x, y], [w, w])  # two monomials
    assert p.product_size([x, y], [w, w]) == 2
    assert p.product_size([projected, projected], [x, y]) == 4


def test_a_large_contraction_split_in_two_and_summed_is_the_whole_one_unexpanded():
    poly = Polynomials()
    start = poly.fresh(8)
    wide = poly.linear((1, v) for v in range(start, start + 4))  # a row too long to multiply out
    scaled = poly.linear([(3, wide)])
    weights = poly.fresh(4)
    xs, ys = [wide, scaled, wide, start + 4], list(range(weights, weights + 4))
    whole = poly.unexpanded_dot(xs, ys)
    halves = poly.linear([(1, poly.unexpanded_dot(xs[:2], ys[:2])),
                          (1, poly.unexpanded_dot(xs[2:], ys[2:]))])
    assert whole == halves
    assert len(poly.terms(whole)) == 4  # a term per pair, none multiplied out
    assert poly.unexpanded_dot(xs, ys[::-1]) != whole
    assert poly.unexpanded_dot([poly.zero, *xs], [weights, *ys]) == whole  # a zero adds nothing
