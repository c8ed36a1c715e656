"""Equivalences the matcher knows (``equivalences=``): exactness, compiling, matching, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra import (
    Matcher,
    PatternDefinitionError,
    compile_pattern,
    find_matches,
    register_generic_pass,
)
from pattern_infra.authoring.find import find_in_program
from pattern_infra.language.equivalences import (
    DIV_RTOL,
    IDENTITIES,
    MAX_FACTORS,
    REASSOC_RTOL,
    RSQRT_RTOL,
    association_orders,
    chain_at,
    constant_value,
)
from pattern_infra.verification.evaluator import evaluate

SHAPE = (4, 64)
ANY = [mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))]


def reassoc_rtol(factors: int) -> float:
    """Relative tolerance of two orders of multiplication of ``factors`` (2 or more) float32 factors, each
    making ``factors - 1`` products: ``((1 + u) / (1 - u)) ** (factors - 1) - 1``, ``u = 2**-24``
    (docs/LANGUAGE.md)."""
    u = 2.0**-24
    return ((1 + u) / (1 - u)) ** (factors - 1) - 1


def _program(build):
    return mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])(build)


SPELLINGS = {
    "pow2": (lambda x: mb.pow(x=x, y=np.float32(2.0)), lambda x: mb.mul(x=x, y=x)),
    "square_pow": (lambda x: mb.mul(x=x, y=x), lambda x: mb.pow(x=x, y=np.float32(2.0))),
    "sub_const": (lambda x: mb.sub(x=x, y=np.float32(0.3)), lambda x: mb.add(x=x, y=np.float32(-0.3))),
    "add_const": (lambda x: mb.add(x=x, y=np.float32(0.3)), lambda x: mb.sub(x=x, y=np.float32(-0.3))),
    "div_const": (
        lambda x: mb.real_div(x=x, y=np.float32(3.0)),
        lambda x: mb.mul(x=x, y=np.float32(1.0) / np.float32(3.0)),
    ),
    "mul_const": (
        lambda x: mb.mul(x=x, y=np.float32(3.0)),
        lambda x: mb.real_div(x=x, y=np.float32(1.0) / np.float32(3.0)),
    ),
    "rsqrt": (
        lambda x: mb.rsqrt(x=mb.abs(x=x)),
        lambda x: mb.real_div(x=np.float32(1.0), y=mb.sqrt(x=mb.abs(x=x))),
    ),
    "reassoc": (
        lambda x: mb.mul(x=mb.mul(x=x, y=np.float32(0.3)), y=mb.sin(x=x)),
        lambda x: mb.mul(x=x, y=mb.mul(x=mb.sin(x=x), y=np.float32(0.3))),
    ),
}
TOLERANCE = {"div_const": DIV_RTOL, "mul_const": DIV_RTOL, "rsqrt": 2 * RSQRT_RTOL, "reassoc": REASSOC_RTOL}


def test_every_identity_has_its_spellings_tested():
    assert set(SPELLINGS) == set(IDENTITIES)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_identity_holds_in_float32_as_stated(name):
    written, other = (_program(f) for f in SPELLINGS[name])
    rng = np.random.default_rng(0)
    for scale in (1e-3, 1.0, 1e3):
        x = (rng.standard_normal(SHAPE) * scale).astype(np.float32) + np.float32(0.5 * scale)
        a = next(iter(evaluate(written, {"x": x}, precision="native").values()))
        b = next(iter(evaluate(other, {"x": x}, precision="native").values()))
        assert a.dtype == np.float32 and b.dtype == np.float32
        if IDENTITIES[name].exact:
            assert np.array_equal(a, b), name
        else:
            bound = TOLERANCE[name]
            if name == "rsqrt":  # plus rsqrt's own epsilon (1e-12): 1/sqrt(v + e) = 1/sqrt(v) (1 - e/(2v))
                bound = bound + 1e-12 / (2 * np.abs(x.astype(np.float64)))
            rel = np.abs(a.astype(np.float64) - b) / np.abs(a)
            assert np.all(rel <= bound), (name, np.max(rel / bound))
            if name != "rsqrt":
                assert np.max(rel) > 0  # 1/3 is not a power of two: not exact, which is why it is stated


def test_division_by_a_power_of_two_is_exact():
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    div = _program(lambda x: mb.real_div(x=x, y=np.float32(8.0)))
    mul = _program(lambda x: mb.mul(x=x, y=np.float32(0.125)))
    a, b = (next(iter(evaluate(p, {"x": x}, precision="native").values())) for p in (div, mul))
    assert np.array_equal(a, b)


@mb.program(input_specs=ANY)
def square_mean(x):
    sq = mb.pow(x=x, y=np.float32(2.0), name="sq")
    return mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean")


def choice_alternatives(compiled, name):
    """The alternatives of choice ``name`` the spellings take, in words, in order (none: no such choice)."""
    labels = {}
    for variant in compiled.variants:
        if name in variant.choices:
            end = next(op for op, choices in variant.aliases.items() if name in choices)
            labels.setdefault(variant.choices[name], variant.within[end][1])
    return [labels[k] for k in sorted(labels)]


def test_compiled_only_when_asked():
    assert choice_alternatives(compile_pattern(square_mean), "sq") == []
    assert choice_alternatives(compile_pattern(square_mean, equivalences=True), "sq") == [
        "pow(x, 2)",
        "mul(x, x)",
    ]
    assert choice_alternatives(compile_pattern(square_mean, equivalences=["sub_const"]), "sq") == []
    assert len(choice_alternatives(compile_pattern(square_mean, equivalences={"sq": ["pow2"]}), "sq")) == 2


def test_an_equivalence_where_it_does_not_hold_is_refused():
    with pytest.raises(PatternDefinitionError, match="does not hold.*Rule: pow2 is pow\\(x, 2\\) = mul"):
        compile_pattern(square_mean, equivalences={"mean": ["pow2"]})

    @mb.program(input_specs=ANY)
    def cube(x):
        return mb.pow(x=x, y=np.float32(3.0), name="cube")

    with pytest.raises(PatternDefinitionError, match="where it does not hold"):
        compile_pattern(cube, equivalences={"cube": ["pow2"]})
    with pytest.raises(PatternDefinitionError, match="unknown equivalence"):
        compile_pattern(square_mean, equivalences=["pow_two"])
    with pytest.raises(PatternDefinitionError, match="does not have"):
        compile_pattern(square_mean, equivalences={"nope": ["pow2"]})


def _mean_of(square):
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        return mb.reduce_mean(x=square(x), axes=[-1], keep_dims=True)

    return prog


@pytest.mark.parametrize("equivalences", [True, ["pow2"], {"sq": ["pow2"]}])
def test_pow_pattern_matches_mul_program_only_with_the_equivalence(equivalences):
    program = _mean_of(lambda x: mb.mul(x=x, y=x))
    assert list(find_matches(square_mean, program)) == []
    found = list(find_matches(square_mean, program, equivalences=equivalences))
    assert len(found) == 1
    match = found[0]
    assert match.sq.op_type == "mul" and match.choices == {"sq": 1}
    assert match.root_var is program.functions["main"].inputs["x"]


def test_the_written_spelling_still_matches_first():
    program = _mean_of(lambda x: mb.pow(x=x, y=np.float32(2.0)))
    (match,) = find_matches(square_mean, program, equivalences=True)
    assert match.sq.op_type == "pow" and match.choices == {"sq": 0}


def test_constants_of_the_other_spelling_follow_the_pattern_value():
    @mb.program(input_specs=ANY)
    def scaled(x):
        return mb.real_div(x=mb.relu(x=x, name="r"), y=np.float32(4.0), name="d")

    quarter = _mean_of(lambda x: mb.mul(x=mb.relu(x=x), y=np.float32(0.25)))
    third = _mean_of(lambda x: mb.mul(x=mb.relu(x=x), y=np.float32(1 / 3)))
    assert len(list(find_matches(scaled, quarter, constants="value", equivalences=True))) == 1
    assert list(find_matches(scaled, third, constants="value", equivalences=True)) == []
    assert list(find_matches(scaled, quarter, constants="value")) == []


@mb.program(input_specs=ANY)
def scaled_product(x):
    s = mb.sin(x=x, name="s")
    return mb.mul(x=mb.mul(x=x, y=np.float32(0.5), name="half"), y=s, name="out")


@pytest.mark.parametrize(
    "build, alternative",
    [
        (lambda x: mb.mul(x=mb.mul(x=np.float32(0.5), y=x), y=mb.sin(x=x)), 0),
        (lambda x: mb.mul(x=x, y=mb.mul(x=mb.sin(x=x), y=np.float32(0.5))), 1),
        (lambda x: mb.mul(x=mb.mul(x=mb.sin(x=x), y=x), y=np.float32(0.5)), 2),
    ],
    ids=["as-written", "a*(b*c)", "(a*b)*c"],
)
def test_a_constant_scaling_matches_in_every_association(build, alternative):
    prog = mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])(build)
    (match,) = find_matches(scaled_product, prog, equivalences=["reassoc"], constants="value")
    assert match.choices == {"out": alternative} and match.out is prog.functions["main"].operations[-1]
    assert match.half.op_type == "mul" and match.s.op_type == "sin"
    assert len(list(find_matches(scaled_product, prog, constants="value"))) == (1 if alternative == 0 else 0)
    other = mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])(
        lambda x: mb.mul(x=x, y=mb.mul(x=mb.sin(x=x), y=np.float32(0.25)))
    )
    assert list(find_matches(scaled_product, other, equivalences=["reassoc"], constants="value")) == []


def test_a_pattern_that_is_only_the_chain_matches_every_order():
    """The choice is then the anchor, with one output type (mul): the search checks that type, not the
    choice's own op type."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol())) for _ in range(2)])
    def chain_only(a, b):
        return mb.mul(x=mb.mul(x=a, y=np.float32(0.5), name="half"), y=b, name="out")

    orders = [
        lambda a, b: mb.mul(x=mb.mul(x=a, y=np.float32(0.5)), y=b),
        lambda a, b: mb.mul(x=mb.mul(x=a, y=b), y=np.float32(0.5)),
    ]
    for build, choice in zip(orders, (0, 2)):
        prog = mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))] * 2)(build)
        (match,) = find_matches(chain_only, prog, equivalences=["reassoc"], constants="value")
        assert match.choices == {"out": choice}


@pytest.mark.parametrize("op_name", ["s", "half"])
def test_reassociation_where_there_is_no_constant_scaling_chain_is_refused(op_name):
    with pytest.raises(PatternDefinitionError, match="reassoc"):
        compile_pattern(scaled_product, equivalences={op_name: ["reassoc"]})


# -- reassoc on longer chains: the constant at any depth -------------------------------------------------

C = np.float32(0.3)
CHAIN_SHAPE = (4, 64)


def _inputs(n, fn):
    """``fn`` taking ``n`` named inputs (``mb.program`` reads the parameter names)."""
    return {
        3: lambda a, b, d: fn(a, b, d),
        4: lambda a, b, d, e: fn(a, b, d, e),
        5: lambda a, b, d, e, f: fn(a, b, d, e, f),
    }[n]


def _pattern(*names, const_at=None):
    """``mul(...mul(mul(f0, f1), f2)..., fk)`` over pattern inputs ``names`` with ``C`` inserted as factor
    ``const_at`` (None: no constant); the muls named ``m1``, ``m2``, ..., the last ``out``."""
    specs = [mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol())) for _ in names]

    def body(*xs):
        factors = list(xs)
        if const_at is not None:
            factors.insert(const_at, C)
        acc = factors[0]
        for k, f in enumerate(factors[1:], 1):
            acc = mb.mul(x=acc, y=f, name="out" if k == len(factors) - 1 else f"m{k}")
        return acc

    return mb.program(input_specs=specs)(_inputs(len(names), body))


def _shapes(n):
    """Every binary tree over ``n`` leaves in a fixed leaf order (left and right kept apart)."""
    if n == 1:
        return ["leaf"]
    return [(left, right) for k in range(1, n) for left in _shapes(k) for right in _shapes(n - k)]


def _chain_program(shape, with_const_at, inputs, const=C):
    """A program multiplying its ``inputs`` inputs and ``const`` (inserted as factor ``with_const_at``) in
    the association ``shape``."""

    def body(*xs):
        factors = iter([*xs[:with_const_at], const, *xs[with_const_at:]])

        def build(node):
            if node == "leaf":
                return next(factors)
            left = build(node[0])
            return mb.mul(x=left, y=build(node[1]))

        return build(shape)

    specs = [mb.TensorSpec(shape=CHAIN_SHAPE) for _ in range(inputs)]
    return mb.program(input_specs=specs)(_inputs(inputs, body))


def _programs(factors):
    """(label, program) with the constant at each position of every association of ``factors`` factors."""
    return [
        (f"{shape}@{pos}", _chain_program(shape, pos, factors - 1))
        for shape in _shapes(factors)
        for pos in range(factors)
    ]


def _is_written(prog):
    """Whether ``prog`` multiplies as the patterns below are written, up to operand order: one mul after
    the other, ``C`` in the first."""
    ops = [op for op in prog.functions["main"].operations if op.op_type == "mul"]
    inner = ops[0]
    chained = all(any(v is prev.outputs[0] for v in op.inputs.values()) for prev, op in zip(ops, ops[1:]))
    return chained and any(v.op is not None and v.op.op_type == "const" for v in inner.inputs.values())


DEPTH3 = _pattern("a", "b", "d", const_at=1)  # mul(mul(mul(a, C), b), d): 4 factors, 3 mul
DEPTH4 = _pattern("a", "b", "d", "e", const_at=1)  # 5 factors, 4 mul


@pytest.mark.parametrize(
    "pattern, factors, alternatives", [(DEPTH3, 4, 15), (DEPTH4, 5, 105)], ids=["depth3", "depth4"]
)
def test_one_pattern_matches_the_constant_at_every_depth_of_every_association(pattern, factors, alternatives):
    compiled = compile_pattern(pattern, equivalences=["reassoc"], constants="value")
    assert len(choice_alternatives(compiled, "out")) == alternatives
    reassociating, as_written_only = Matcher(compiled), Matcher(compile_pattern(pattern, constants="value"))
    programs = _programs(factors)
    assert len(programs) == {4: 20, 5: 70}[factors]
    written = 0
    for label, prog in programs:
        main = prog.functions["main"]
        (match,) = find_in_program(prog, reassociating)
        assert match.out is main.operations[-1], label
        assert {op for op in match.op_set} == {op for op in main.operations if op.op_type == "mul"}, label
        assert set(map(id, match.root_vars)) == set(map(id, main.inputs.values())), label
        assert match.consts and all(v.val == C for v in match.consts.values()), label
        as_written = _is_written(prog)
        written += as_written
        assert (match.choices == {"out": 0}) == as_written, label
        assert len(list(find_in_program(prog, as_written_only))) == as_written, label
    assert written == {4: 8, 5: 16}[factors]  # linear associations with C in the innermost mul


@pytest.mark.parametrize("pattern, factors", [(DEPTH3, 4), (DEPTH4, 5)], ids=["depth3", "depth4"])
def test_another_constant_value_or_no_constant_is_not_matched(pattern, factors):
    by_value = Matcher(compile_pattern(pattern, equivalences=["reassoc"], constants="value"))
    for shape in _shapes(factors):
        same = _chain_program(shape, 0, factors - 1)
        other = _chain_program(shape, 0, factors - 1, const=np.float32(0.25))
        assert len(list(find_in_program(same, by_value))) == 1
        assert list(find_in_program(other, by_value)) == []

    def right_to_left(*xs):  # the factors, none of them a constant
        acc = xs[-1]
        for x in reversed(xs[:-1]):
            acc = mb.mul(x=x, y=acc)
        return acc

    no_const = mb.program(input_specs=[mb.TensorSpec(shape=CHAIN_SHAPE) for _ in range(factors)])(
        _inputs(factors, right_to_left)
    )

    assert list(find_matches(pattern, no_const, equivalences=["reassoc"], constants="const")) == []


def test_a_rule_given_by_const_name_holds_in_every_order():
    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol())) for _ in range(3)])
    def named(a, b, d):
        c = mb.const(val=C, name="scale")
        return mb.mul(x=mb.mul(x=mb.mul(x=a, y=c, name="m1"), y=b, name="m2"), y=d, name="out")

    by_name = Matcher(compile_pattern(named, equivalences=["reassoc"], const_rules={"scale": "value"}))
    balanced = _shapes(4)[2]  # (f0 * f1) * (f2 * f3): never the order as written
    for value, found in ((C, 1), (np.float32(0.25), 0)):
        for pos in range(4):
            prog = _chain_program(balanced, pos, 3, const=value)
            assert len(list(find_in_program(prog, by_name))) == found, (value, pos)


def test_a_chain_without_a_constant_is_not_reassociated():
    plain = _pattern("a", "b", "d", "e")  # ((a * b) * d) * e
    assert choice_alternatives(compile_pattern(plain, equivalences=["reassoc"]), "out") == []
    with pytest.raises(PatternDefinitionError, match="where it does not hold"):
        compile_pattern(plain, equivalences={"out": ["reassoc"]})

    def program(associate):
        return mb.program(input_specs=[mb.TensorSpec(shape=CHAIN_SHAPE) for _ in range(4)])(associate)

    linear = program(lambda a, b, d, e: mb.mul(x=a, y=mb.mul(x=b, y=mb.mul(x=d, y=e))))
    balanced = program(lambda a, b, d, e: mb.mul(x=mb.mul(x=a, y=b), y=mb.mul(x=d, y=e)))
    assert len(list(find_matches(plain, linear, equivalences=True))) == 1  # the same tree up to operand order
    assert list(find_matches(plain, balanced, equivalences=True)) == []


def test_a_longer_mul_tree_is_cut_at_max_factors_and_its_inner_part_reassociated():
    six = _pattern("a", "b", "d", "e", "f", const_at=1)  # ((((a * C) * b) * d) * e) * f: 6 factors
    compiled = compile_pattern(six, equivalences=["reassoc"])
    assert MAX_FACTORS == 5
    assert choice_alternatives(compiled, "out") == []  # the outer 5 factors hold no constant
    assert len(choice_alternatives(compiled, "m4")) == 105  # (((a * C) * b) * d) * e


@pytest.mark.parametrize("second_use", ["op", "output"])
def test_an_inner_mul_read_elsewhere_ends_the_chain(second_use):
    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),)) for _ in range(2)])
    def shared(a, b):
        p = mb.mul(x=a, y=b, name="p")  # read by the chain and by another op, or a pattern output
        r = mb.relu(x=p if second_use == "op" else a, name="r")
        out = mb.mul(x=mb.mul(x=p, y=C, name="m"), y=r, name="out")
        return out if second_use == "op" else (out, p)

    chain = chain_at(shared.functions["main"].find_ops(op_type="mul")[-1])
    assert [v.op.name for v in chain.factors] == ["p", chain.factors[1].op.name, "r"]
    assert [op.name for op in chain.inner] == ["m"]
    assert len(choice_alternatives(compile_pattern(shared, equivalences=["reassoc"]), "out")) == 3


@pytest.mark.parametrize("pattern, factors", [(DEPTH3, 4), (DEPTH4, 5)], ids=["depth3", "depth4"])
def test_every_association_order_stays_within_the_stated_tolerance(pattern, factors):
    """Every order the choice holds, built as a program and evaluated with the reference evaluator on
    random float32 inputs, against the pattern as written: within ``reassoc_rtol(factors)``."""
    func = pattern.functions["main"]
    chain = chain_at(func.find_ops(op_type="mul")[-1])
    orders = association_orders(chain)
    assert len(orders) == {4: 15, 5: 105}[factors] and orders[0] == chain.written
    inputs = [i for i, v in enumerate(chain.factors) if constant_value(v) is None]

    def program(tree):
        def body(*xs):
            leaves = dict(zip(inputs, xs))

            def build(node):
                if isinstance(node, int):
                    return leaves.get(node, C)
                return mb.mul(x=build(node[0]), y=build(node[1]))

            return build(tree)

        return mb.program(input_specs=[mb.TensorSpec(shape=CHAIN_SHAPE) for _ in inputs])(
            _inputs(len(inputs), body)
        )

    rng = np.random.default_rng(factors)
    bound = reassoc_rtol(factors)
    worst = 0.0
    progs = [program(tree) for tree in orders]
    names = list(progs[0].functions["main"].inputs)
    for scale in (1e-3, 1.0, 1e3):
        for _ in range(4):
            feed = {n: (rng.standard_normal(CHAIN_SHAPE) * scale).astype(np.float32) for n in names}
            want = next(iter(evaluate(progs[0], feed, precision="native").values())).astype(np.float64)
            for prog in progs[1:]:
                got = next(iter(evaluate(prog, feed, precision="native").values()))
                assert got.dtype == np.float32
                rel = np.abs(got - want) / np.abs(want)
                worst = max(worst, float(np.max(rel)))
    assert 0 < worst <= bound, (worst, bound)
    assert worst > bound / 2  # seen: 3.8 units of 2**-24 for 4 factors (bound 6), 5.0 for 5 (bound 8)


def test_the_tolerance_per_depth():
    u = 2.0**-24
    assert reassoc_rtol(3) <= REASSOC_RTOL < 4.1 * u  # depth 2, as before
    assert 6 * u < reassoc_rtol(4) < 6.01 * u and 8 * u < reassoc_rtol(5) < 8.01 * u


def _scaled_to_division(pattern):
    """Rewrites ``a * b * d * C`` into ``((a * b) * d) / (1 / C)``: no constant left in a mul chain."""
    a, b, d = pattern.root_vars
    at = pattern.final_op
    product = mb.mul(x=mb.mul(x=a, y=b, before_op=at), y=d, before_op=at)
    pattern.replace_outputs([mb.real_div(x=product, y=np.float32(1) / C, before_op=at)])


_passes = iter(range(10**6))


@pytest.mark.parametrize("off", [False, [], ["pow2", "mul_const"], {"m1": ["mul_const"]}])
def test_reassoc_is_switched_on_and_off_per_pass(off):
    namespace = f"reassoc_test{next(_passes)}"
    on_pass = register_generic_pass(
        DEPTH3, None, _scaled_to_division, "on", namespace, constants="value", equivalences=["reassoc"]
    )
    off_pass = register_generic_pass(
        DEPTH3, None, _scaled_to_division, "off", namespace, constants="value", equivalences=off
    )
    try:
        for label, prog in _programs(4):
            written = _is_written(prog)
            feed = {
                n: np.random.default_rng(0).standard_normal(CHAIN_SHAPE).astype(np.float32)
                for n in prog.functions["main"].inputs
            }
            before = next(iter(evaluate(prog, feed, precision="native").values()))
            counts = off_pass.stats.rewrites, on_pass.stats.rewrites
            off_pass(prog)  # only the association as written
            on_pass(prog)  # the others
            assert (off_pass.stats.rewrites - counts[0], on_pass.stats.rewrites - counts[1]) == (
                (1, 0) if written else (0, 1)
            ), label
            types = [op.op_type for op in prog.functions["main"].operations if op.op_type != "const"]
            assert types == ["mul", "mul", "real_div"], label
            after = next(iter(evaluate(prog, feed, precision="native").values()))
            assert np.all(np.abs(after - before) <= (reassoc_rtol(4) + DIV_RTOL) * np.abs(before)), label
    finally:
        for key in [k for k in PASS_REGISTRY.passes if k.startswith(namespace)]:
            del PASS_REGISTRY.passes[key]
