"""Op keys each rule template ranges over (a sample of attribute values for parametric ops)."""

UNARY_KEYS = (
    "neg", "exp", "log", "rsqrt", "sqrt", "sin", "cos", "tanh", "sigmoid", "silu", "relu",
    "gelu|approximate='none'", "gelu|approximate='tanh'", "reciprocal", "abs",
    "cast|dtype='float32'", "add_scalar|value=1.5", "mul_scalar|value=0.125",
    "div_scalar|value=3.0", "rsub_scalar|value=2.0", "pow_scalar|value=2", "lt_scalar|value=1.0",
    "le_scalar|value=1.0", "gt_scalar|value=1.0", "ge_scalar|value=1.0", "eq_scalar|value=1.0",
    "ne_scalar|value=1.0",
)
LINEAR_UNARY_OPS = ("neg", "mul_scalar", "div_scalar")
LINEAR_UNARY_KEYS = ("neg", "mul_scalar|value=0.125", "div_scalar|value=3.0")
BINARY_KEYS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le",
               "gt", "ge", "logaddexp")
COMMUTATIVE = ("add", "mul", "maximum", "minimum", "eq", "ne", "logaddexp")
ADDITIVE = ("add", "sub")
SCALES_LEFT = ("mul", "div")
SCALES_RIGHT = ("mul",)
REDUCTIONS = ("sum", "amax", "logsumexp")
NORMALIZATIONS = ("softmax", "log_softmax")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")  # of integer comparisons (`cmp_int`)
# Every key of each kind. A rule's egglog text does not name the family it was written for: a
# family variable that no condition tests (with a trait fact) matches every key of its kind.
KINDS = (UNARY_KEYS, BINARY_KEYS, REDUCTIONS, NORMALIZATIONS, COMPARISONS)

# Uninterpreted ops applied along the last dim alone (each row on its own).
LAST_DIM_OPS = ("topk", "topk_index")
LAST_DIM_KEYS = ("topk|k=1", "topk_index|k=2")

# Static trait facts loaded into every e-graph; the keys of parametric traits (their
# attribute values vary) are added per window for the ops it holds (WINDOW_TRAITS).
FACTS = {"commutative": set(COMMUTATIVE), "additive": set(ADDITIVE),
         "scales_left": set(SCALES_LEFT), "scales_right": set(SCALES_RIGHT),
         "linear_unary": set(LINEAR_UNARY_KEYS), "last_dim": set(LAST_DIM_KEYS)}
WINDOW_TRAITS = {"linear_unary": LINEAR_UNARY_OPS, "last_dim": LAST_DIM_OPS}
# Traits of scalings, stated per window for the scalar ops it holds (never loaded into every
# e-graph: `world_share` depends on the session's world size): `halves` scales by 1/2 (one of a
# partial sum's two parts), `world_share` by 1/world, `positive_scale` by a positive factor
# (a fill of -inf stays one).
SHARE_TRAITS = ("halves", "world_share", "positive_scale")
POSITIVE_SCALE_KEYS = ("mul_scalar|value=0.125", "div_scalar|value=3.0")


def share_keys(parts: int) -> set[str]:
    """Keys of the scalings by 1/parts, in the spellings an audit example uses."""
    return {f"mul_scalar|value={1 / parts!r}", f"div_scalar|value={float(parts)!r}"}


def share_facts(world: int) -> dict[str, set[str]]:
    """The members of each share trait for examples evaluated on `world` ranks."""
    return {"halves": share_keys(2), "world_share": share_keys(world),
            "positive_scale": set(POSITIVE_SCALE_KEYS)}


def example_traits(world: int) -> dict[str, set[str]]:
    """Every trait's members where a rule's examples run on `world` ranks."""
    return {**FACTS, **share_facts(world)}
