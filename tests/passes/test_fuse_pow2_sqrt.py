"""``mil_backend::fuse_pow2_sqrt``: ``sqrt(pow(x, 2))`` into ``abs(x)``, ``pow(sqrt(x), 2)`` into
``identity(x)``.

coremltools turns both into ``identity``; ours differs on purpose for ``sqrt(pow(x, 2))`` (``|x|``, not
``x``). Programs are compared with coremltools' output op for op, ``abs`` standing where coremltools has
its sign-losing ``identity``. ``pow(sqrt(x), 2)`` is only defined for ``x >= 0``, so programs holding that
form are checked on non-negative inputs; the others on inputs of both signs.
"""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_pow2_sqrt import pow2_sqrt_pattern, sqrt_pow2_pattern
from pattern_infra.testing.passes import assert_same_program, op_types, run_both, run_pass
from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.symbolic import ProofStatus, prove_equivalent
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "mil_backend::fuse_pow2_sqrt"
SHAPE = (2, 3, 4)


def chain(ops: str, *, exponent=2.0, extra: str | None = None) -> Program:
    """A chain of ``p`` (``pow(., exponent)``) and ``s`` (``sqrt``) ops, e.g. ``"ps"`` or ``"sps"``.

    ``extra``: ``"use_first"`` (first op used elsewhere), ``"out_first"`` (first op a block output),
    ``"use_root"`` (``x`` used elsewhere).
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        y, outs = x, []
        for i, kind in enumerate(ops):
            y = mb.pow(x=y, y=exponent, name=f"pow{i}") if kind == "p" else mb.sqrt(x=y, name=f"sqrt{i}")
            outs.append(y)
        if extra == "use_first":
            return y, mb.exp(x=outs[0])
        if extra == "out_first":
            return y, outs[0]
        if extra == "use_root":
            return y, mb.exp(x=x)
        return y

    return prog


def non_negative_inputs(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": np.abs(rng.standard_normal(SHAPE)) + 0.1} for _ in range(3)]


def signed_inputs(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(SHAPE)} for _ in range(3)]


def check_against_coremltools(prog: Program, expected: list[str]) -> Program:
    """Ours has op types ``expected``; coremltools' program is the same but with ``identity`` where
    ours has ``abs``; ours equals ``prog`` numerically (on inputs of both signs when it can)."""
    outcome = run_both(PASS, prog)
    assert op_types(outcome.ours) == expected
    if "abs" in expected:
        ours_ops, their_ops = (
            [op for op in p.functions["main"].operations if op.op_type != "const"]
            for p in (outcome.ours, outcome.coremltools)
        )
        assert [(op.op_type, op.name) for op in ours_ops] == [
            ("abs" if (mine.op_type == "abs" and op.op_type == "identity") else op.op_type, op.name)
            for mine, op in zip(ours_ops, their_ops, strict=True)
        ]
    else:
        assert_same_program(outcome.coremltools, outcome.ours)
    domain_limited = "identity" in expected
    inputs = non_negative_inputs() if domain_limited else signed_inputs()
    assert_programs_equivalent(prog, outcome.ours, inputs=inputs, rtol=1e-5)
    return outcome.ours


@pytest.mark.parametrize("ops, op_type", [("ps", "abs"), ("sp", "identity")])
def test_pair_becomes_one_op(ops, op_type):
    ours = check_against_coremltools(chain(ops), [op_type])
    (new,) = [op for op in ours.functions["main"].operations if op.op_type == op_type]
    assert new.x.name == "x" and new.outputs[0].name == f"{'sqrt' if ops == 'ps' else 'pow'}1"


@pytest.mark.parametrize(
    "ops, expected",
    [
        ("sps", ["identity", "sqrt"]),
        ("psp", ["abs", "pow"]),
        ("spsp", ["identity", "identity"]),
        ("pspsp", ["abs", "abs", "pow"]),
        ("spsps", ["identity", "identity", "sqrt"]),
    ],
)
def test_chains_pair_up_in_program_order_as_coremltools_does(ops, expected):
    check_against_coremltools(chain(ops), expected)


def test_exponent_tensor_of_twos_is_fused():
    check_against_coremltools(chain("ps", exponent=np.full((4,), 2.0, dtype=np.float32)), ["abs"])


def test_root_with_other_consumers_is_fused():
    check_against_coremltools(chain("sp", extra="use_root"), ["identity", "exp"])


@pytest.mark.parametrize(
    "ops, kwargs",
    [
        ("ps", {"extra": "use_first"}),
        ("sp", {"extra": "use_first"}),
        ("ps", {"extra": "out_first"}),
        ("sp", {"extra": "out_first"}),
        ("ps", {"exponent": 3.0}),
        ("sp", {"exponent": 2.001}),
    ],
    ids=[
        "pow_used_elsewhere",
        "sqrt_used_elsewhere",
        "pow_is_block_output",
        "sqrt_is_block_output",
        "cube",
        "nearly_two",
    ],
)
def test_not_fused(ops, kwargs):
    prog = chain(ops, **kwargs)
    check_against_coremltools(prog, op_types(prog))


def test_broadcasting_exponent_is_declined():
    """An exponent of shape (1, 1, 1, 1) makes the output rank 4: ``identity(x)`` is rank 3.

    coremltools fuses anyway and silently changes the output shape; we decline.
    """
    prog = chain("ps", exponent=np.full((1, 1, 1, 1), 2.0, dtype=np.float32))
    assert run_pass(PASS, prog, generic=False).functions["main"].outputs[0].shape == SHAPE
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["pow", "sqrt"]
    assert ours.functions["main"].outputs[0].shape == (1, *SHAPE)


def test_symbolic_proofs_and_coremltools_sign_loss():
    """Both rewrites are proven; coremltools' ``identity`` for ``sqrt(pow(x, 2))`` is refuted."""
    sp_prog = chain("sp")
    assert (proof := prove_equivalent(sp_prog, run_pass(PASS, sp_prog))).proven, proof
    assert prove_equivalent(sqrt_pow2_pattern, run_pass(PASS, sqrt_pow2_pattern)).proven
    assert (proof := prove_equivalent(pow2_sqrt_pattern, run_pass(PASS, pow2_sqrt_pattern))).proven, proof
    ps_prog = chain("ps")
    negative = {"x": -np.ones(SHAPE)}
    assert_programs_equivalent(ps_prog, run_pass(PASS, ps_prog), inputs=negative)
    theirs = run_pass(PASS, ps_prog, generic=False)
    assert prove_equivalent(ps_prog, theirs).status is ProofStatus.COUNTEREXAMPLE
    with pytest.raises(VerificationError):
        assert_programs_equivalent(ps_prog, theirs, inputs=negative)
