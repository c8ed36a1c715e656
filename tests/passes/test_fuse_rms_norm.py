"""``generic::fuse_rms_norm``: RMSNorm written out into ``l2_norm`` with its rank padding and one scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_rms_norm import INV_SQRT_FORMS, SQUARE_FORMS
from pattern_infra.testing.convert import convert_torch, op_counts
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fuse_rms_norm"
FUSED = ["expand_dims", "l2_norm", "squeeze", "mul"]
B, L, D = 2, 5, 48
RNG = np.random.default_rng(7)
W = (1.0 + 0.1 * RNG.standard_normal(D)).astype(np.float32)
EPS = 1e-6


def rms_norm(
    square: str = "pow",
    inv_sqrt: str = "rsqrt",
    weight: str | None = "const",
    *,
    dtype=types.fp32,
    shape=(B, L, D),
    axis: int = -1,
    keep_dims: bool = True,
    exponent: float = 2.0,
    eps: float | None = EPS,
    inverse_eps: float = 0.0,
    swap: bool = False,
    other_x: bool = False,
    leak: bool = False,
) -> Program:
    """One RMSNorm spelling (see the pass docstring). ``weight``: "const", "input" or None.

    Near misses: ``axis``, ``keep_dims``, ``exponent``, ``eps=None`` (a runtime epsilon), ``inverse_eps``,
    ``other_x`` (the normalised tensor is not the squared one), ``leak`` (the rsqrt is also an output).
    ``swap`` writes every commutative operand the other way round.
    """
    np_dtype = np.float16 if dtype == types.fp16 else np.float32
    specs = [mb.TensorSpec(shape=shape, dtype=dtype)]
    if weight == "input":
        specs.append(mb.TensorSpec(shape=(shape[-1],), dtype=dtype))
    if eps is None:
        specs.append(mb.TensorSpec(shape=(1,), dtype=dtype))
    if other_x:
        specs.append(mb.TensorSpec(shape=shape, dtype=dtype))

    def mul(a, b):
        return mb.mul(x=b, y=a) if swap else mb.mul(x=a, y=b)

    def body(x, *rest):
        rest = list(rest)
        w = rest.pop(0) if weight == "input" else W.astype(np_dtype)
        e = rest.pop(0) if eps is None else np_dtype(eps)
        z = rest.pop(0) if other_x else x
        sq = mb.pow(x=x, y=np_dtype(exponent)) if square == "pow" else mul(x, x)
        v = mb.reduce_mean(x=sq, axes=[axis], keep_dims=keep_dims)
        if inv_sqrt != "rsqrt_no_add":
            v = mb.add(y=v, x=e) if swap else mb.add(x=v, y=e)
        if inv_sqrt.startswith("rsqrt"):
            r = mb.rsqrt(x=v) if inv_sqrt == "rsqrt" else mb.rsqrt(x=v, epsilon=np_dtype(EPS))
            y = mul(z, r)
        elif inv_sqrt == "div":
            r = None
            y = mb.real_div(x=z, y=mb.sqrt(x=v))
        elif inv_sqrt == "recip":
            r = mb.real_div(x=np_dtype(1.0), y=mb.sqrt(x=v))
            y = mul(z, r)
        else:
            r = mb.inverse(x=mb.sqrt(x=v), epsilon=np_dtype(inverse_eps))
            y = mul(z, r)
        out = y if weight is None else mul(y, w)
        return (out, r) if leak else out

    if len(specs) == 1:
        return mb.program(input_specs=specs)(lambda x: body(x))
    if len(specs) == 2:
        return mb.program(input_specs=specs)(lambda x, a: body(x, a))
    return mb.program(input_specs=specs)(lambda x, a, b: body(x, a, b))


def check(prog: Program, expected: list[str], rtol: float = 1e-5) -> Program:
    """Runs the pass, demands ``expected`` op types and the same outputs as before."""
    ours = run_pass(PASS, prog)
    assert op_types(ours) == expected, op_types(ours)
    assert_programs_equivalent(prog, ours, rtol=rtol, atol=1e-6)
    return ours


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("weight", ["const", None])
@pytest.mark.parametrize("inv_sqrt", INV_SQRT_FORMS)
@pytest.mark.parametrize("square", SQUARE_FORMS)
def test_every_spelling_fuses(square, inv_sqrt, weight, swap):
    ours = check(rms_norm(square, inv_sqrt, weight, swap=swap), FUSED)
    l2 = next(op for op in ours.functions["main"].operations if op.op_type == "l2_norm")
    # the add's EPS, plus rsqrt's default epsilon 1e-12; "rsqrt_no_add" has EPS inside the rsqrt only
    expected_eps = D * (EPS + 1e-12 if inv_sqrt == "rsqrt" else EPS)
    assert float(l2.epsilon.val) == pytest.approx(expected_eps, rel=1e-6)


def test_weight_absorbs_sqrt_d():
    ours = check(rms_norm(), FUSED)
    scale = ours.functions["main"].operations[-1].y.val
    np.testing.assert_array_equal(scale, (np.sqrt(D) * W.astype(np.float64)).astype(np.float32))


def test_symbolic_leading_dims():
    prog = rms_norm(shape=(get_new_symbol(), get_new_symbol(), D))
    check(prog, FUSED)


@pytest.mark.parametrize("shape", [(1, L, 4, D), (1, 2, L, 4, D)], ids=["rank4", "rank5"])
def test_rank_4_and_5_are_reshaped_not_padded_past_rank_5(shape):
    """Per-head q/k norms (Qwen3): two more axes would exceed Core ML's rank 5."""
    ours = check(rms_norm(shape=shape), ["reshape", "l2_norm", "reshape", "mul"])
    assert max(len(op.outputs[0].shape) for op in ours.functions["main"].operations) == len(shape)


def test_rank_4_with_a_symbolic_dim_left_alone():
    prog = rms_norm(shape=(get_new_symbol(), L, 4, D))
    assert op_types(run_pass(PASS, prog)) == op_types(prog)


def test_runtime_weight_stays_a_mul():
    check(rms_norm(weight="input"), FUSED + ["mul"])


def test_float16_magnitude_300_where_the_square_overflows():
    """Written out in float16, x^2 = 90000 overflows to inf and the norm returns 0; fused, it is right."""
    x = 300.0 * np.sign(RNG.standard_normal((B, L, D))) * (0.9 + 0.1 * RNG.random((B, L, D)))
    prog16 = rms_norm(dtype=types.fp16)
    fused16 = run_pass(PASS, prog16)
    assert op_types(fused16) == FUSED
    reference = next(iter(evaluate(rms_norm(), {"x": x.astype(np.float32)}, precision="native").values()))
    (written,) = evaluate(prog16, {"x": x.astype(np.float16)}, precision="native").values()
    (fused,) = evaluate(fused16, {"x": x.astype(np.float16)}, precision="native").values()
    assert written.dtype == fused.dtype == np.float16
    assert np.all(written == 0)  # the overflow: every row normalised to 0
    np.testing.assert_allclose(fused.astype(np.float32), reference, rtol=2e-3, atol=0)


@pytest.mark.parametrize(
    "near_miss",
    [
        dict(axis=-2),  # RMSNorm over a non-last axis
        dict(axis=0),
        dict(exponent=3.0),
        dict(eps=None),  # runtime epsilon
        dict(inv_sqrt="inverse", inverse_eps=1e-4),  # 1 / (sqrt(v) + 1e-4): not an RMSNorm
        dict(other_x=True),  # z * rsqrt(mean(x^2)): another tensor normalised
        dict(leak=True),  # the rsqrt is also used elsewhere
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_near_misses_are_left_alone(near_miss):
    prog = rms_norm(**near_miss)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


def test_keep_dims_false_left_alone():
    prog = rms_norm(weight=None, shape=(6, 6, 6), keep_dims=False)  # mean [6, 6] broadcasts along axis 0
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


class _Written(torch.nn.Module):
    """RMSNorm as hand-written PyTorch code writes it."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.weight = torch.nn.Parameter(torch.from_numpy(W.copy()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "rsqrt_pow":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight
        if self.form == "div_sqrt_square":
            return self.weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS))
        return x * (1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)) * self.weight  # "reciprocal"


@pytest.mark.parametrize("form", ["rsqrt_pow", "div_sqrt_square", "reciprocal"])
def test_pytorch_spellings_through_coremltools(form):
    module, x = _Written(form).eval(), torch.randn(B, L, D)
    off = convert_torch(module, (x,), override=False)
    on = convert_torch(module, (x,), override=True)
    with torch.no_grad():
        expected = module(x).numpy()
    (got,) = evaluate(on, {"x": x.numpy()}).values()
    if form == "reciprocal":  # coremltools writes 1/s as inverse(s, epsilon=1e-4): left as it is
        assert op_counts(on) == op_counts(off)
        return
    assert op_counts(on)["l2_norm"] == 1 and "reduce_mean" not in op_counts(on)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
