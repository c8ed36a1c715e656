"""Equivalences the matcher knows (``equivalences=``): exactness, compiling, matching, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import PatternDefinitionError, compile_pattern, find_matches
from pattern_infra.equivalences import DIV_RTOL, IDENTITIES, REASSOC_RTOL, RSQRT_RTOL
from pattern_infra.verification.evaluator import evaluate

SHAPE = (4, 64)
ANY = [mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))]


def _program(build):
    return mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])(build)


SPELLINGS = {
    "pow2": (lambda x: mb.pow(x=x, y=np.float32(2.0)), lambda x: mb.mul(x=x, y=x)),
    "square_pow": (lambda x: mb.mul(x=x, y=x), lambda x: mb.pow(x=x, y=np.float32(2.0))),
    "sub_const": (lambda x: mb.sub(x=x, y=np.float32(0.3)), lambda x: mb.add(x=x, y=np.float32(-0.3))),
    "add_const": (lambda x: mb.add(x=x, y=np.float32(0.3)), lambda x: mb.sub(x=x, y=np.float32(-0.3))),
    "div_const": (lambda x: mb.real_div(x=x, y=np.float32(3.0)),
                  lambda x: mb.mul(x=x, y=np.float32(1.0) / np.float32(3.0))),
    "mul_const": (lambda x: mb.mul(x=x, y=np.float32(3.0)),
                  lambda x: mb.real_div(x=x, y=np.float32(1.0) / np.float32(3.0))),
    "rsqrt": (lambda x: mb.rsqrt(x=mb.abs(x=x)), lambda x: mb.real_div(x=np.float32(1.0), y=mb.sqrt(x=mb.abs(x=x)))),
    "reassoc": (lambda x: mb.mul(x=mb.mul(x=x, y=np.float32(0.3)), y=mb.sin(x=x)),
                lambda x: mb.mul(x=x, y=mb.mul(x=mb.sin(x=x), y=np.float32(0.3)))),
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


def test_compiled_only_when_asked():
    assert compile_pattern(square_mean).node("sq").choice is None
    node = compile_pattern(square_mean, equivalences=True).node("sq")
    assert [a.label for a in node.choice.alternatives] == ["pow(x, 2)", "mul(x, x)"]
    assert compile_pattern(square_mean, equivalences=["sub_const"]).node("sq").choice is None
    assert compile_pattern(square_mean, equivalences={"sq": ["pow2"]}).node("sq").choice is not None


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
        lambda x: mb.mul(x=x, y=mb.mul(x=mb.sin(x=x), y=np.float32(0.25))))
    assert list(find_matches(scaled_product, other, equivalences=["reassoc"], constants="value")) == []


def test_a_pattern_that_is_only_the_chain_matches_every_order(monkeypatch):
    """The choice is then the anchor, with one output type (mul): the compiled search checks that type,
    not the choice's own op type, and agrees with the interpreter."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol())) for _ in range(2)])
    def chain_only(a, b):
        return mb.mul(x=mb.mul(x=a, y=np.float32(0.5), name="half"), y=b, name="out")

    orders = [lambda a, b: mb.mul(x=mb.mul(x=a, y=np.float32(0.5)), y=b),
              lambda a, b: mb.mul(x=mb.mul(x=a, y=b), y=np.float32(0.5))]
    for interpret in ("0", "1"):
        monkeypatch.setenv("PATTERN_INFRA_INTERPRET", interpret)
        for build, choice in zip(orders, (0, 2)):
            prog = mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))] * 2)(build)
            (match,) = find_matches(chain_only, prog, equivalences=["reassoc"], constants="value")
            assert match.choices == {"out": choice}, interpret


@pytest.mark.parametrize("op_name", ["s", "half"])
def test_reassociation_where_there_is_no_constant_scaling_chain_is_refused(op_name):
    with pytest.raises(PatternDefinitionError, match="reassoc"):
        compile_pattern(scaled_product, equivalences={op_name: ["reassoc"]})
