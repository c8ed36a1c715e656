"""Tests of the verification helpers (``pattern_infra.verification.verify``).

``verify_pass`` must pass a correct coremltools fusion, catch a hand-written wrong one, and leave the
original program untouched; ``prove_equivalent`` must prove the gelu decompositions coremltools
fuses (up to the float32 rounding of their constants) and refute a wrong one with a counterexample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import sympy as sp
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra.authoring.clone import clone_program
from pattern_infra.language.errors import PassRegistrationError
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.symbolic import ProofStatus, prove_equivalent, to_sympy
from pattern_infra.verification.verify import (
    NotElementwiseError,
    VerificationReport,
    assert_programs_equivalent,
    count_ops,
    random_inputs,
    verify_pass,
)

SHAPE = (4, 16)

# ----------------------------------------------------------------------------------------------
# Programs: decomposed gelu forms exactly as coremltools' fusion passes match them
# ----------------------------------------------------------------------------------------------


def _gelu_tanh_chain(x: Any) -> Any:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))): the fuse_gelu_tanh_approximation pattern."""
    cube = mb.pow(x=x, y=3.0, name="cube")
    scaled = mb.mul(x=0.044715, y=cube, name="scaled_cube")
    inner = mb.add(x=x, y=scaled, name="inner")
    arg = mb.mul(x=inner, y=np.sqrt(2 / np.pi), name="tanh_arg")
    tanh = mb.tanh(x=arg, name="tanh")
    one_plus = mb.add(x=1.0, y=tanh, name="one_plus")
    half = mb.mul(x=0.5, y=one_plus, name="half")
    return mb.mul(x=x, y=half, name="gelu_out")


def _gelu_erf_chain(x: Any) -> Any:
    """x * 0.5 * (1 + erf(x / sqrt(2))): the fuse_gelu_exact pattern."""
    erf = mb.erf(x=mb.real_div(x=x, y=1.4142135623730951))
    return mb.mul(x=mb.mul(x=x, y=0.5), y=mb.add(x=erf, y=1.0), name="gelu_out")


def _program(body: Callable[..., Any], *shapes: tuple, dtype: Any = types.fp32) -> Any:
    specs = [mb.TensorSpec(shape=shape, dtype=dtype) for shape in shapes]
    return mb.program(input_specs=specs)(body)


def _gelu(mode: str) -> Any:
    return _program(lambda x: mb.gelu(x=x, mode=mode, name="gelu_out"), SHAPE)


def _wrong_gelu_pass(prog: Any) -> None:
    """Replace the tanh-form gelu chain by gelu(mode="EXACT"): a plausible but wrong fusion."""
    block = prog.functions["main"]
    chain = [op for op in block.operations if op.op_type != "const"]
    root = chain[0].x
    last = chain[-1]
    with block:
        fused = mb.gelu(x=root, mode="EXACT", before_op=last, name=last.outputs[0].name + "_fused")
        block.replace_uses_of_var_after_op(anchor_op=last, old_var=last.outputs[0], new_var=fused)
        block.remove_ops(chain)


# ----------------------------------------------------------------------------------------------
# random_inputs and clone_program
# ----------------------------------------------------------------------------------------------


def test_random_inputs_follow_the_signature_and_the_seed() -> None:
    s, t = get_new_symbol(), get_new_symbol()

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(s, 3)),
            mb.TensorSpec(shape=(2, s, t), dtype=types.fp16),
            mb.TensorSpec(shape=(t,), dtype=types.int32),
            mb.TensorSpec(shape=(5,), dtype=types.bool),
        ]
    )
    def prog(a, b, n, flag):
        return mb.add(x=a, y=1.0), b, n, flag

    inputs = random_inputs(prog, seed=3)
    assert list(inputs) == ["a", "b", "n", "flag"]
    a, b, n, flag = inputs.values()
    assert (a.dtype, b.dtype, n.dtype, flag.dtype) == (np.float32, np.float16, np.int32, np.bool_)
    assert a.shape[0] == b.shape[1] and b.shape[2] == n.shape[0]  # one size per symbol
    assert a.shape[0] != b.shape[2]  # distinct symbols get distinct default sizes
    assert n.min() >= 0 and n.max() < 4
    for x, y in zip(inputs.values(), random_inputs(prog, seed=3).values()):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a, random_inputs(prog, seed=4)["a"])
    sized = random_inputs(prog, sizes_for_symbols={s: 7, str(t): 2})
    assert sized["a"].shape == (7, 3) and sized["b"].shape == (2, 7, 2)


def test_clone_program_is_independent_even_for_deep_chains() -> None:
    # copy.deepcopy alone exceeds the default recursion limit on a chain this long.
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        for _ in range(300):
            x = mb.add(x=x, y=1.0)
        return x

    copy = clone_program(prog)
    before = count_ops(prog)
    block = copy.functions["main"]
    assert block.operations[-1] is not prog.functions["main"].operations[-1]
    last = block.operations[-1]
    with block:  # rewrite the copy: double its output
        doubled = mb.mul(x=last.outputs[0], y=2.0, before_op=None, name="doubled")
    block.set_outputs([doubled])
    assert count_ops(prog) == before and count_ops(copy)["mul"] == 1
    x = np.zeros((2, 3), dtype=np.float32)
    np.testing.assert_array_equal(next(iter(evaluate(prog, {"x": x}).values())), np.full((2, 3), 300.0))
    np.testing.assert_array_equal(next(iter(evaluate(copy, {"x": x}).values())), np.full((2, 3), 600.0))


# ----------------------------------------------------------------------------------------------
# verify_pass and assert_programs_equivalent
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "graph_pass, chain, fused_mode",
    [
        ("common::fuse_gelu_tanh_approximation", _gelu_tanh_chain, "TANH_APPROXIMATION"),
        (PASS_REGISTRY["common::fuse_gelu_tanh_approximation"], _gelu_tanh_chain, "TANH_APPROXIMATION"),
        ("common::fuse_gelu_exact", _gelu_erf_chain, "EXACT"),
    ],
    ids=["tanh-by-id", "tanh-by-instance", "exact-by-id"],
)
def test_verify_pass_accepts_a_correct_fusion(
    graph_pass: Any, chain: Callable[..., Any], fused_mode: str
) -> None:
    prog = _program(chain, SHAPE)
    before = count_ops(prog)
    report = verify_pass(graph_pass, prog, trials=3)
    assert isinstance(report, VerificationReport) and report.passed
    assert report.op_counts_before == before and count_ops(prog) == before  # original untouched
    assert report.op_counts_after["gelu"] == 1 and report.changed
    assert not set(report.op_counts_after) & {"tanh", "erf", "pow", "mul", "add", "real_div"}
    gelu = report.transformed.functions["main"].find_ops(op_type="gelu")[0]
    assert gelu.mode.val == fused_mode
    # The pattern's constants are float32-rounded, the fused op is exact: ~1e-8, far inside 1e-5.
    assert 0 < report.max_rel_diff < 1e-6
    assert report.equivalence.trials == 3


def test_verify_pass_catches_a_wrong_fusion() -> None:
    prog = _program(_gelu_tanh_chain, SHAPE)
    with pytest.raises(VerificationError) as info:
        verify_pass(_wrong_gelu_pass, prog)
    message = str(info.value)
    assert "pass '_wrong_gelu_pass'" in message
    assert "output 'gelu_out'" in message
    assert "differs by" in message
    report = info.value.report
    assert isinstance(report, VerificationReport) and not report.passed
    assert report.op_counts_after["gelu"] == 1 and report.op_counts_after["tanh"] == 0
    assert 1e-4 < report.max_abs_diff < 1e-2  # EXACT vs TANH gelu differ by a few 1e-4
    worst = report.equivalence.worst
    assert worst is not None and worst.violation > 1
    assert abs(worst.actual - worst.expected) == pytest.approx(worst.max_abs_diff)


def test_verification_report_repr_is_one_short_line() -> None:
    report = verify_pass("common::fuse_gelu_tanh_approximation", _program(_gelu_tanh_chain, SHAPE), trials=1)
    text = repr(report)
    assert "\n" not in text and len(text) < 400, text  # the rewritten program is not printed
    assert "passed=True" in text and "main[" not in str(text)


def test_verify_pass_rejects_unknown_pass_ids() -> None:
    with pytest.raises(PassRegistrationError, match="common::no_such_pass"):
        verify_pass("common::no_such_pass", _gelu("EXACT"))


def test_assert_programs_equivalent_with_explicit_inputs_and_mismatches() -> None:
    x = np.array([[0.0, 1.0, -2.0, 3.0]], dtype=np.float32)
    double = _program(lambda x: mb.mul(x=x, y=2.0, name="out"), (1, 4))
    twice = _program(lambda x: mb.add(x=x, y=x), (1, 4))
    report = assert_programs_equivalent(double, twice, inputs=[{"x": x}, {"x": -x}])
    assert report.passed and report.trials == 2 and report.max_abs_diff == 0.0
    off_by_one = _program(lambda x: mb.add(x=mb.add(x=x, y=x), y=np.float32(1e-3)), (1, 4))
    with pytest.raises(VerificationError, match=r"output 'out' differs by 0\.001 \(expected 0, got 0\.001"):
        assert_programs_equivalent(double, off_by_one, inputs={"x": x})
    # The tolerance is atol + rtol * |expected|: 1e-3 passes with atol=2e-3.
    assert assert_programs_equivalent(double, off_by_one, atol=2e-3).passed
    renamed = _program(lambda y: mb.mul(x=y, y=2.0), (1, 4))
    with pytest.raises(VerificationError, match="changed the function inputs"):
        assert_programs_equivalent(double, renamed)
    reshaped = _program(lambda x: mb.reshape(x=mb.mul(x=x, y=2.0), shape=[4, 1]), (1, 4))
    with pytest.raises(
        VerificationError, match=r"changed the shape of output 'out' from \(1, 4\) to \(4, 1\)"
    ):
        assert_programs_equivalent(double, reshaped)


def test_nan_and_inf_outputs_compare_equal_only_to_themselves() -> None:
    x = np.array([[0.0, -1.0, 4.0]], dtype=np.float32)
    log = _program(lambda x: mb.log(x=x, epsilon=0.0), (1, 3))  # -inf, nan, finite
    same = _program(lambda x: mb.log(x=mb.mul(x=x, y=1.0), epsilon=0.0), (1, 3))
    assert assert_programs_equivalent(log, same, inputs={"x": x}).passed
    shifted = _program(lambda x: mb.log(x=mb.abs(x=x), epsilon=0.0), (1, 3))  # nan -> 0
    with pytest.raises(VerificationError):
        assert_programs_equivalent(log, shifted, inputs={"x": x})


# ----------------------------------------------------------------------------------------------
# prove_equivalent
# ----------------------------------------------------------------------------------------------


def test_prove_tanh_decomposition_equals_tanh_gelu_up_to_float32_constants() -> None:
    result = prove_equivalent(_program(_gelu_tanh_chain, SHAPE), _gelu("TANH_APPROXIMATION"))
    assert result.status is ProofStatus.PROVEN_UP_TO_ROUNDING and result.proven
    proof = result.outputs[0]
    assert proof.name == "gelu_out"
    # float32(sqrt(2/pi)) and float32(0.044715) are within ~3e-8 of the exact constants.
    assert 1e-9 < result.constant_gap < 1e-7
    replaced = {str(new) for _, new, _ in proof.substitutions}
    assert "sqrt(2)/sqrt(pi)" in replaced


def test_prove_erf_decomposition_equals_exact_gelu() -> None:
    result = prove_equivalent(_program(_gelu_erf_chain, SHAPE), _gelu("EXACT"))
    assert result.status is ProofStatus.PROVEN_UP_TO_ROUNDING
    assert result.constant_gap < 1e-7


@pytest.mark.parametrize(
    "left, right",
    [
        (lambda x: mb.mul(x=x, y=2.0), lambda x: mb.add(x=x, y=x)),
        (lambda x: mb.relu(x=x), lambda x: mb.mul(x=mb.add(x=x, y=mb.abs(x=x)), y=0.5)),
        (lambda x: mb.silu(x=x), lambda x: mb.mul(x=x, y=mb.sigmoid(x=x))),
        (
            lambda x: mb.sigmoid(x=x),
            lambda x: mb.mul(x=mb.add(x=mb.tanh(x=mb.mul(x=x, y=0.5)), y=1.0), y=0.5),
        ),
    ],
    ids=["double", "relu", "silu", "sigmoid-via-tanh"],
)
def test_prove_exact_identities(left: Callable[..., Any], right: Callable[..., Any]) -> None:
    result = prove_equivalent(_program(left, (3,)), _program(right, (3,)))
    assert result.status is ProofStatus.PROVEN
    assert result.outputs[0].constant_gap == 0.0


def test_prove_reports_a_counterexample_for_exact_versus_tanh_gelu() -> None:
    result = prove_equivalent(_gelu("EXACT"), _gelu("TANH_APPROXIMATION"))
    assert result.status is ProofStatus.COUNTEREXAMPLE and not result.proven
    proof = result.outputs[0]
    point = result.counterexample
    assert point is not None and set(point) == {"x"}
    x = point["x"]
    exact = 0.5 * x * (1 + math.erf(x / math.sqrt(2)))
    approx = 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert proof.value_a == pytest.approx(exact, rel=1e-12, abs=1e-15)
    assert proof.value_b == pytest.approx(approx, rel=1e-12, abs=1e-15)
    assert abs(proof.value_a - proof.value_b) > 1e-9 + 1e-6 * abs(proof.value_a)
    assert "counterexample" in str(result)


def test_prove_reports_not_proven_when_sympy_cannot_simplify() -> None:
    # floor(x) == -ceil(-x) holds for every real x, but sympy does not reduce it.
    floor = _program(lambda x: mb.floor(x=x), (3,))
    neg_ceil_neg = _program(lambda x: mb.mul(x=mb.ceil(x=mb.mul(x=x, y=-1.0)), y=-1.0), (3,))
    result = prove_equivalent(floor, neg_ceil_neg, samples=8)
    assert result.status is ProofStatus.NOT_PROVEN
    assert result.outputs[0].samples == 8 and result.counterexample is None


def test_prove_small_coefficient_gap_is_rounding() -> None:
    # x*a + x*b against x*(a+b) with every constant float32-rounded: equal up to 1e-8 in the coefficient.
    a, b = 0.1, 0.7
    two_terms = _program(lambda x: mb.add(x=mb.mul(x=x, y=a), y=mb.mul(x=x, y=b)), (3,))
    one_term = _program(lambda x: mb.mul(x=x, y=a + b), (3,))
    result = prove_equivalent(two_terms, one_term)
    assert result.status is ProofStatus.PROVEN_UP_TO_ROUNDING
    assert 0 < result.constant_gap < 1e-6


def test_to_sympy_uses_exact_constants_and_rejects_non_elementwise_programs() -> None:
    expr = to_sympy(_program(lambda x: mb.mul(x=x, y=0.044715, name="out"), (2,)))["out"]
    assert 12003091 / 2**28 == float(np.float32(0.044715))
    assert expr == sp.Rational(12003091, 2**28) * sp.Symbol("x", real=True)  # the stored float32, exactly
    uniform = _program(lambda x: mb.add(x=x, y=np.full((2,), 3.0, dtype=np.float32), name="out"), (2,))
    assert str(to_sympy(uniform)["out"]) == "x + 3"
    varying = _program(lambda x: mb.add(x=x, y=np.array([1.0, 2.0], dtype=np.float32), name="shift"), (2,))
    with pytest.raises(
        NotElementwiseError, match=r"not purely elementwise: op 'shift' \(add\) uses constant"
    ):
        prove_equivalent(varying, varying)
    reduce = _program(lambda x: mb.reduce_sum(x=x, name="total"), (2,))
    with pytest.raises(NotElementwiseError, match="op 'total' of type 'reduce_sum'"):
        to_sympy(reduce)


def test_verify_pass_descends_into_nested_blocks() -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        positive = mb.greater(x=mb.reduce_sum(x=x), y=0.0)
        # identity: coremltools' generic matcher requires the pattern's root var to have no other
        # consumers, and x is also read by reduce_sum and by the false branch.
        return mb.cond(
            pred=positive,
            _true_fn=lambda: _gelu_tanh_chain(mb.identity(x=x)),
            _false_fn=lambda: mb.mul(x=x, y=2.0),
        )

    sums = [float(random_inputs(prog, seed=s)["x"].sum()) for s in range(4)]
    assert min(sums) < 0 < max(sums)  # both branches run across the trials
    report = verify_pass("common::fuse_gelu_tanh_approximation", prog, trials=4)
    assert report.op_counts_before["tanh"] == 1 and report.op_counts_after["gelu"] == 1
    assert report.op_counts_after["tanh"] == 0 and report.passed
