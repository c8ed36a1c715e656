"""``common::fuse_layernorm_or_instancenorm``: coremltools' patterns 1-5 (same program), the written-out
PyTorch family, pre-norm roots, channels-first gamma, and the fusions that must not happen."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var
from layernorm_reference import (
    WRITTEN_OUT_PATTERNS,
    written_out_pattern,
)  # the 108 spellings, one program each

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import VerificationError, find_matches
from pattern_infra.testing.convert import convert_mil, convert_torch
from pattern_infra.testing.models import ChannelsFirstLayerNorm, InlineLayerNorm, WrittenLayerNorm
from pattern_infra.testing.passes import (
    assert_same_program,
    check_fused,
    near_one_f32,
    op_types,
    run_both,
    run_pass,
    same_name_counters,
)
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_layernorm_or_instancenorm"
rand = near_one_f32(np.random.default_rng(0))


def run_both_outcome(prog: Program) -> tuple[Program, Program]:
    """coremltools' pass and ours on copies of ``prog`` (``run_both``): (theirs, ours)."""
    outcome = run_both(PASS, prog)
    return outcome.coremltools, outcome.ours


def assert_as_coremltools(prog: Program, expected: list[str]) -> Program:
    """coremltools fuses ``prog``; ours gives the very same program, with op types ``expected``."""
    return check_fused(PASS, prog, expected)


def assert_beyond_coremltools(prog: Program, expected: list[str]) -> Program:
    """coremltools leaves ``prog`` alone; ours fuses it to ``expected`` and computes the same values."""
    theirs, ours = run_both_outcome(prog)
    assert op_types(theirs) == op_types(prog)
    assert op_types(ours) == expected
    assert_programs_equivalent(prog, ours, rtol=1e-5)
    return ours


def the_op(prog: Program, op_type: str):
    """The only op of type ``op_type`` in ``prog``."""
    ops = [op for op in prog.functions["main"].operations if op.op_type == op_type]
    assert len(ops) == 1, [op.op_type for op in prog.functions["main"].operations]
    return ops[0]


def assert_untouched(prog: Program) -> None:
    ours = run_pass(PASS, prog)
    assert_same_program(prog, ours)


def _mul(a, b, swap: bool, **kw) -> Var:
    return mb.mul(x=b, y=a, **kw) if swap else mb.mul(x=a, y=b, **kw)


def _add(a, b, swap: bool, **kw) -> Var:
    return mb.add(x=b, y=a, **kw) if swap else mb.add(x=a, y=b, **kw)


# -- program builders -------------------------------------------------------------------------------------


def pattern_1(
    shape=(3, 5, 6),
    axes=(-1,),
    gamma=None,
    beta=None,
    *,
    swap=False,
    residual=False,
    axes2=None,
    use_sub=False,
    split_root=False,
) -> Program:
    """``x * k + (beta - mean * k)``, ``k = gamma * rsqrt(var + eps)`` (TF BERT's layer norm)."""
    norm_shape = tuple(shape[a] for a in axes)
    gamma = rand(*norm_shape) if gamma is None else gamma
    beta = rand(*norm_shape) if beta is None else beta
    axes, axes2 = list(axes), list(axes2 or axes)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        outs = []
        if split_root:  # coremltools only looks at the first output of the root's producer
            x, other = mb.split(x=x, num_splits=2, axis=0, name="split")
            outs.append(other)
        mean = mb.reduce_mean(x=x, axes=axes, keep_dims=True, name="mean")
        sub = mb.sub(x=x, y=mean, name="sub")
        var = mb.reduce_mean(x=mb.square(x=sub, name="square"), axes=axes2, keep_dims=True, name="var")
        rsqrt = mb.rsqrt(x=_add(var, np.float32(1e-5), swap, name="add_eps"), name="rsqrt")
        k = _mul(rsqrt, gamma, swap, name="k")
        mul_x = _mul(x, k, swap, name="mul_x")
        mul_mean = _mul(mean, k, swap, name="mul_mean")
        y = _add(mul_x, mb.sub(x=beta, y=mul_mean, name="sub_beta"), swap, name="y")
        outs.insert(0, y)
        if residual:
            outs.append(mb.add(x=x, y=y, name="residual"))
        if use_sub:
            outs.append(mb.exp(x=sub, name="leak"))
        return tuple(outs)

    return prog


def pattern_3(shape=(3, 5, 6, 7), axes=(2, 3), *, neg=-1.0, swap=False, mul_mean_first=False, residual=False):
    """TensorFlow-Addons' instance norm without gamma/beta: ``x * r + (mean * r) * -1``."""
    axes = list(axes)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        mean = mb.reduce_mean(x=x, axes=axes, keep_dims=True, name="mean")
        sub = mb.sub(x=x, y=mean, name="sub")
        var = mb.reduce_mean(x=mb.square(x=sub), axes=axes, keep_dims=True, name="var")
        rsqrt = mb.rsqrt(x=mb.add(x=var, y=np.float32(1e-5)), name="rsqrt")
        if mul_mean_first:
            mul_mean = mb.mul(x=mean, y=rsqrt, name="mul_mean")
            mul_x = mb.mul(x=rsqrt, y=x, name="mul_x")
        else:
            mul_x = mb.mul(x=rsqrt, y=x, name="mul_x")
            mul_mean = mb.mul(x=mean, y=rsqrt, name="mul_mean")
        neg_mean = _mul(mul_mean, np.float32(neg), swap, name="neg")
        y = mb.add(x=mul_x, y=neg_mean, name="y")
        return (y, mb.add(x=x, y=y)) if residual else y

    return prog


def pattern_4(shape=(3, 5, 6, 7), *, scale=None, swap=False, residual=False) -> Program:
    """``E[x^2] - E[x]^2`` with ``reduce_sum * (1/N)``, then pattern 1's tail."""
    n = shape[2] * shape[3]
    scale = np.float32(1.0 / n) if scale is None else np.float32(scale)
    gamma, beta = rand(1, shape[1], 1, 1), rand(1, shape[1], 1, 1)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        sq = mb.mul(x=x, y=x, name="sq")
        mean = _mul(mb.reduce_sum(x=x, axes=[2, 3], keep_dims=True, name="sum"), scale, swap, name="m")
        mean_sq = mb.mul(x=mean, y=mean, name="m2")
        ex2 = _mul(mb.reduce_sum(x=sq, axes=[2, 3], keep_dims=True, name="sum_sq"), scale, swap, name="ex2")
        var = mb.sub(x=ex2, y=mean_sq, name="var")
        k = mb.mul(x=mb.rsqrt(x=mb.add(x=var, y=np.float32(1e-5))), y=gamma, name="k")
        mul_x = _mul(k, x, swap, name="mul_x")
        mul_m = mb.mul(x=mean, y=k, name="mul_m")
        y = mb.add(x=mul_x, y=mb.sub(x=beta, y=mul_m), name="y")
        return (y, mb.add(x=x, y=y)) if residual else y

    return prog


def pattern_5(
    shape=(3, 5, 1, 6),
    affine=True,
    *,
    axes=(1,),
    axes2=None,
    beta=None,
    gamma=None,
    residual=False,
    after=None,
) -> Program:
    """ml-ane-transformers: ``[(x - mean) * rsqrt(var + eps) + beta] * gamma``."""
    axes, axes2 = list(axes), list(axes2 or axes)
    beta = rand(1, shape[1], 1, 1) if beta is None else beta
    gamma = rand(1, shape[1], 1, 1) if gamma is None else gamma

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)], opset_version=ct.target.iOS16)
    def prog(x):
        mean = mb.reduce_mean(x=x, axes=axes, keep_dims=True, name="mean")
        sub = mb.sub(x=x, y=mean, name="sub")
        var = mb.reduce_mean(x=mb.mul(x=sub, y=sub, name="sq"), axes=axes2, keep_dims=True, name="var")
        y = mb.mul(x=sub, y=mb.rsqrt(x=mb.add(x=var, y=np.float32(1e-5)), name="rsqrt"), name="n")
        if affine:
            y = mb.add(x=y, y=beta, name="plus_beta")
            if after != "add":
                y = mb.mul(x=y, y=gamma, name="y")
        if after == "add":
            return mb.exp(x=y)
        return (y, mb.sub(x=x, y=y)) if residual else y

    return prog


def written(
    key: str,
    shape=(2, 3, 16),
    axes=(-1,),
    *,
    gamma=None,
    beta=None,
    residual=False,
    swap=False,
    eps=1e-5,
    pow_y=2.0,
    half=0.5,
    axes2=None,
) -> Program:
    """A program in the written-out form ``key`` (``<subs>_<square>_<normalizer>_<gamma>_<beta>``)."""
    subs, square, normalizer, g_at, b_at = key.split("_")
    norm_shape = tuple(shape[a] for a in axes)
    gamma = rand(*norm_shape) if gamma is None else gamma
    beta = rand(*norm_shape) if beta is None else beta
    axes, axes2 = list(axes), list(axes2 or axes)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        mean = mb.reduce_mean(x=x, axes=axes, keep_dims=True, name="u")
        d = mb.sub(x=x, y=mean, name="d")
        if square == "pow":
            sq = mb.pow(x=d, y=np.float32(pow_y), name="sq")
        elif square == "mul":
            sq = mb.mul(x=d, y=d, name="sq")
        else:
            sq = mb.square(x=d, name="sq")
        var = mb.reduce_mean(x=sq, axes=axes2, keep_dims=True, name="var")
        v = _add(var, np.float32(eps), swap, name="v")
        num = d if subs == "sub1" else mb.sub(x=x, y=mean, name="d2")
        if g_at == "before":
            num = _mul(gamma, num, swap, name="wd")
        if normalizer == "rsqrt":
            y = _mul(num, mb.rsqrt(x=v, name="r"), swap, name="n")
        elif normalizer == "sqrt":
            y = mb.real_div(x=num, y=mb.sqrt(x=v, name="s"), name="n")
        else:
            y = mb.real_div(x=num, y=mb.pow(x=v, y=np.float32(half), name="s"), name="n")
        if g_at == "after":
            y = _mul(y, gamma, swap, name="wn")
        if b_at == "beta":
            y = _add(y, beta, swap, name="y")
        return (y, mb.add(x=x, y=y, name="residual")) if residual else y

    return prog


# -- coremltools' patterns: the same program ----------------------------------------------------------------


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
@pytest.mark.parametrize("axes", [(-1,), (1, 2), (0, 1, 2)], ids=["1axis", "2axes", "3axes"])
def test_pattern_1_layer_norm_as_coremltools(axes, swap):
    ours = assert_as_coremltools(pattern_1(axes=axes, swap=swap), ["layer_norm"])
    ln = ours.functions["main"].operations[-1]
    assert ln.outputs[0].name == "y" and list(ln.axes.val) == list(axes)


@pytest.mark.parametrize(
    "axes, gamma_shape, expected",
    [
        ((2, 3), (1, 5, 1, 1), ["instance_norm"]),
        ((-2, -1), (5, 1, 1), ["instance_norm"]),
        ((1, 2), (7,), ["transpose", "instance_norm", "transpose"]),
        ((1, 2), (1, 1, 1, 7), ["transpose", "instance_norm", "transpose"]),
        ((2, 3), (6, 7), ["layer_norm"]),
    ],
    ids=["nchw", "nchw_c11", "nhwc", "nhwc_111c", "hw_gamma"],
)
def test_pattern_1_instance_norm_as_coremltools(axes, gamma_shape, expected):
    prog = pattern_1((3, 5, 6, 7), axes, rand(*gamma_shape), rand(*gamma_shape))
    ours = assert_as_coremltools(prog, expected)
    if expected[0] == "transpose":
        assert [op.name for op in ours.functions["main"].operations if op.op_type != "const"] == [
            "y_transpose_nhwc_nchw",
            "y_instancenorm",
            "y_transpose_nchw_nhwc",
        ]


def test_instance_norm_with_many_channels_keeps_coremltools_const_names():
    # 12 channels: the squeezed gamma/beta are printed by name ("y_gamma_<n>").
    prog = pattern_1((2, 12, 3, 4), (2, 3), rand(1, 12, 1, 1), rand(1, 12, 1, 1))
    assert "y_gamma_" in str(assert_as_coremltools(prog, ["instance_norm"]))


def test_channels_last_between_transposes_as_coremltools():
    # coremltools' own test: TF's NHWC instance norm between NCHW<->NHWC transposes.
    gamma, beta = rand(1, 1, 1, 3), rand(1, 1, 1, 3)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 3, 5, 5))])
    def prog(x):
        x = mb.transpose(x=x, perm=[0, 2, 3, 1])
        mean = mb.reduce_mean(x=x, axes=[1, 2], keep_dims=True)
        var = mb.reduce_mean(x=mb.square(x=mb.sub(x=x, y=mean)), axes=[1, 2], keep_dims=True)
        k = mb.mul(x=gamma, y=mb.rsqrt(x=mb.add(x=var, y=1e-5)))
        y = mb.add(x=mb.sub(x=beta, y=mb.mul(x=k, y=mean)), y=mb.mul(x=x, y=k))
        return mb.transpose(x=y, perm=[0, 3, 1, 2])

    assert_as_coremltools(prog, ["transpose"] * 2 + ["instance_norm"] + ["transpose"] * 2)


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
def test_pattern_2_as_coremltools(swap):
    prog = written(
        "sub2_square_pow_after_beta",
        (3, 5, 6, 7),
        (2, 3),
        gamma=rand(1, 5, 1, 1),
        beta=rand(1, 5, 1, 1),
        swap=swap,
    )
    assert_as_coremltools(prog, ["instance_norm"])


def test_pattern_3_as_coremltools():
    assert_as_coremltools(pattern_3(), ["instance_norm"])


def test_pattern_4_as_coremltools():
    assert_as_coremltools(pattern_4(), ["instance_norm"])


@pytest.mark.parametrize("residual", [False, True], ids=["alone", "root_reused"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_pattern_5_as_coremltools(affine, residual):
    expected = ["layer_norm", "sub"] if residual else ["layer_norm"]
    ours = assert_as_coremltools(pattern_5(affine=affine, residual=residual), expected)
    assert list(the_op(ours, "layer_norm").axes.val) == [1]


def test_pattern_5_on_a_trailing_axis_is_valid_where_coremltools_breaks():
    # Rank 2, axes [1] is the trailing axis: coremltools appends its "_fuse_layernorm_gamma" const at the
    # end of the block, after the layer_norm reading it, and the program no longer validates.
    prog = pattern_5((4, 12), True, beta=rand(1, 12), gamma=rand(1, 12))
    with pytest.raises(ValueError, match="not visible"):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["layer_norm"]
    assert "_fuse_layernorm_gamma" in str(ours) and "_fuse_layernorm_beta" in str(ours)
    assert_programs_equivalent(prog, ours, rtol=1e-5)


def test_two_instance_norms_in_one_program_as_coremltools():
    g = rand(1, 4, 1, 1)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4, 5, 6))])
    def prog(x):
        for _ in range(2):
            mean = mb.reduce_mean(x=x, axes=[2, 3], keep_dims=True)
            s0, s1 = mb.sub(x=x, y=mean), mb.sub(x=x, y=mean)
            v = mb.add(x=mb.reduce_mean(x=mb.square(x=s0), axes=[2, 3], keep_dims=True), y=1e-5)
            x = mb.relu(x=mb.add(x=mb.mul(x=mb.real_div(x=s1, y=mb.pow(x=v, y=0.5)), y=g), y=g))
        return x

    assert_as_coremltools(prog, ["instance_norm", "relu", "instance_norm", "relu"])


@pytest.mark.parametrize(
    "build",
    [lambda: pattern_1(), lambda: pattern_5(), lambda: pattern_3()],
    ids=["pattern_1", "pattern_5", "pattern_3"],
)
def test_whole_default_pipeline_gives_the_same_program(build):
    prog = build()
    theirs, ours = same_name_counters(
        lambda: convert_mil(prog, override=False), lambda: convert_mil(prog, override=True)
    )
    assert_same_program(theirs, ours)


# -- beyond coremltools: pre-norm roots, operand and child order, the written-out family ---------------------


def test_pattern_1_prenorm_root_is_fused():
    ours = assert_beyond_coremltools(pattern_1(residual=True), ["layer_norm", "add"])
    assert the_op(ours, "add").y.op is the_op(ours, "layer_norm")


@pytest.mark.parametrize(
    "prog, expected",
    [
        (lambda: pattern_1((4, 5, 6), split_root=True), ["split", "layer_norm"]),
        (lambda: pattern_3(swap=True), ["instance_norm"]),
        (lambda: pattern_3(mul_mean_first=True), ["instance_norm"]),
        (lambda: pattern_3(residual=True), ["instance_norm", "add"]),
        (lambda: pattern_4(swap=True), ["instance_norm"]),
        (lambda: pattern_4(residual=True), ["instance_norm", "add"]),
        (
            lambda: written(
                "sub2_square_pow_after_beta",
                (3, 5, 6, 7),
                (2, 3),
                gamma=rand(1, 5, 1, 1),
                beta=rand(1, 5, 1, 1),
                residual=True,
            ),
            ["instance_norm", "add"],
        ),
    ],
    ids=[
        "p1_root_from_split",
        "p3_neg_first",
        "p3_child_order",
        "p3_prenorm",
        "p4_scale_first",
        "p4_prenorm",
        "p2_prenorm",
    ],
)
def test_coremltools_patterns_fused_where_its_matcher_is_too_narrow(prog, expected):
    assert_beyond_coremltools(prog(), expected)


def test_pattern_3_channels_last_gets_channel_sized_ones():
    # coremltools sizes pattern 3's ones by x.shape[1] (H for NHWC) and fuses an instance_norm whose gamma
    # does not have C elements; ours gives gamma of size C.
    prog = pattern_3((2, 6, 5, 4), (1, 2))
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["transpose", "instance_norm", "transpose"]
    norm = the_op(ours, "instance_norm")
    assert norm.gamma.shape == (4,) and norm.beta.shape == (4,)
    assert_programs_equivalent(prog, ours, rtol=1e-5)


KEYS = sorted(WRITTEN_OUT_PATTERNS)


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
def test_every_written_out_form_is_fused(swap):
    # The 108 forms, each in a pre-norm residual block; one test keeps the run short.
    for key in KEYS:
        prog = written(key, residual=True, swap=swap)
        ours = run_pass(PASS, prog)
        assert op_types(ours) == ["layer_norm", "add"], key
        ln = the_op(ours, "layer_norm")
        assert (ln.gamma is not None) == ("none" not in key or key.endswith("_beta")), key
        assert_programs_equivalent(prog, ours, rtol=1e-5, trials=1)


@pytest.mark.parametrize(
    "key", ["sub2_pow_sqrt_after_beta", "sub1_mul_rsqrt_before_beta", "sub2_pow_sqrt_none_beta"]
)
def test_written_out_keeps_program_gamma_and_names(key):
    prog = written(key)
    ours = run_pass(PASS, prog)
    ln = ours.functions["main"].operations[-1]
    assert ln.op_type == "layer_norm" and ln.outputs[0].name == "y" and list(ln.axes.val) == [-1]
    if "none" in key:  # beta alone: layer_norm needs a gamma to type-check its beta; it is all ones
        np.testing.assert_array_equal(ln.gamma.val, np.ones(16, np.float32))
    else:
        assert ln.gamma.op.op_type == "const" and ln.gamma.shape == (16,)
    assert_programs_equivalent(prog, ours, rtol=1e-5)


@pytest.mark.parametrize(
    "key", ["sub2_pow_sqrt_after_beta", "sub1_square_rsqrt_before_nobeta", "sub2_mul_pow_after_beta"]
)
def test_channels_first_layer_norm(key):
    # ConvNeXt: axis 1 of NCHW, gamma/beta [C, 1, 1] become layer_norm(axes=[1]) with gamma/beta [C].
    prog = written(key, (2, 8, 5, 6), (1,), gamma=rand(8, 1, 1), beta=rand(8, 1, 1))
    ours = assert_beyond_coremltools(prog, ["layer_norm"])
    ln = ours.functions["main"].operations[-1]
    assert list(ln.axes.val) == [1] and ln.gamma.shape == (8,)
    if key.endswith("_beta"):
        assert ln.beta.shape == (8,)


@pytest.mark.parametrize(
    "gamma, beta",
    [(np.float32(1.7), np.float32(-0.3)), (rand(1, 1, 16), rand(1, 16)), (rand(1), rand(16))],
    ids=["scalars", "padded", "size1_gamma"],
)
def test_gamma_beta_of_other_shapes_acting_along_the_axes(gamma, beta):
    prog = written("sub1_pow_sqrt_after_beta", gamma=gamma, beta=beta)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["layer_norm"]
    ln = ours.functions["main"].operations[-1]
    assert ln.gamma.shape == (16,) and ln.beta.shape == (16,)
    assert_programs_equivalent(prog, ours, rtol=1e-5)


def test_rank_4_layer_norm_over_hw_without_gamma():
    prog = written("sub1_pow_sqrt_none_nobeta", (2, 3, 4, 5), (-2, -1))
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["layer_norm"]
    assert_programs_equivalent(prog, ours, rtol=1e-5)


def test_pattern_5_beta_without_gamma_and_ambiguous_add_are_fused():
    # coremltools refuses (n + beta) when no gamma mul follows; it is layer_norm with beta.
    prog = pattern_5(affine=True, after="add")
    assert_beyond_coremltools(prog, ["layer_norm", "exp"])


@pytest.mark.parametrize("reused", ["normalized", "plus_beta"])
def test_pattern_5_affine_with_an_intermediate_reused_fuses_the_norm(reused):
    # coremltools fuses nothing; the norm (and, if its sum is private, beta) still fuse exactly.
    shape, beta, gamma = (3, 5, 1, 6), rand(1, 5, 1, 1), rand(1, 5, 1, 1)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        d = mb.sub(x=x, y=mb.reduce_mean(x=x, axes=[1], keep_dims=True))
        var = mb.reduce_mean(x=mb.mul(x=d, y=d), axes=[1], keep_dims=True)
        n = mb.mul(x=d, y=mb.rsqrt(x=mb.add(x=var, y=1e-5)))
        b = mb.add(x=n, y=beta)
        return mb.sub(x=n if reused == "normalized" else b, y=mb.mul(x=b, y=gamma))

    expected = ["layer_norm", "add", "mul", "sub"] if reused == "normalized" else ["layer_norm", "mul", "sub"]
    assert_beyond_coremltools(prog, expected)


def test_constexpr_beta_is_not_absorbed():
    # Compressed (constexpr) weights stay out of the fused op, as in coremltools; the norm itself fuses.
    shape = (3, 5, 1, 6)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)], opset_version=ct.target.iOS16)
    def prog(x):
        d = mb.sub(x=x, y=mb.reduce_mean(x=x, axes=[1], keep_dims=True))
        var = mb.reduce_mean(x=mb.mul(x=d, y=d), axes=[1], keep_dims=True)
        n = mb.mul(x=d, y=mb.rsqrt(x=mb.add(x=var, y=1e-5)))
        beta = mb.constexpr_lut_to_dense(
            lut=np.arange(2, dtype=np.float32),
            indices=np.full((1,), 0b10110, dtype=np.uint8),
            shape=np.array([1, 5, 1, 1], dtype=np.uint32),
        )
        return mb.mul(x=mb.add(x=n, y=beta), y=rand(1, 5, 1, 1))

    assert_beyond_coremltools(prog, ["layer_norm", "constexpr_lut_to_dense", "add", "mul"])


def test_pattern_4_with_a_scale_that_is_not_1_over_n_is_refused():
    # coremltools' own test of pattern 4 uses such dummy scales and fuses: the result differs.
    prog = pattern_4(scale=3.3333334e-05)
    theirs, ours = run_both_outcome(prog)
    assert op_types(theirs) == ["instance_norm"]
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, theirs, rtol=1e-3)
    assert_same_program(prog, ours)


# -- from PyTorch, as coremltools 9.0 hands the program to this pass -----------------------------------------


class RsqrtLayerNorm(torch.nn.Module):
    """``w * d * rsqrt(mean(d * d) + eps) + b``, one ``d``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.bias = torch.nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x - x.mean(-1, keepdim=True)
        return self.weight * d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-6) + self.bias


class PreNorm(torch.nn.Module):
    """``x + ln(x)`` with a written-out layer norm: x feeds the norm and the residual add."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = InlineLayerNorm(dim)
        with torch.no_grad():
            self.ln.weight.normal_(1.0, 0.1)
            self.ln.bias.normal_(0.0, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ln(x)


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((1.0 if "weight" in name else 0.0) + 0.1 * torch.randn_like(p))
    return module


def _pipeline_before_pass() -> ct.PassPipeline:
    names = list(ct.PassPipeline.DEFAULT.passes)
    return ct.PassPipeline(names[: names.index(PASS)], "up_to_fuse_layernorm_or_instancenorm")


@pytest.mark.parametrize(
    "module, args, expected",
    [
        (lambda: _randomized(InlineLayerNorm(16)), (2, 3, 16), ["layer_norm"]),
        (lambda: _randomized(WrittenLayerNorm(16)), (2, 3, 16), ["layer_norm"]),
        (lambda: RsqrtLayerNorm(16), (2, 3, 16), ["layer_norm"]),
        (lambda: _randomized(ChannelsFirstLayerNorm(8)), (2, 8, 5, 6), ["layer_norm"]),
        (lambda: PreNorm(16), (2, 3, 16), ["layer_norm", "add"]),
    ],
    ids=["inline", "written", "rsqrt", "channels_first", "prenorm"],
)
def test_torch_export_forms_reaching_the_pass(module, args, expected):
    torch.manual_seed(0)
    prog = convert_torch(
        module(),
        (torch.randn(*args),),
        override=False,
        pass_pipeline=_pipeline_before_pass(),
        minimum_deployment_target=ct.target.iOS17,
    )
    assert_beyond_coremltools(prog, expected)


def test_default_pipeline_with_override_fuses_inline_layer_norm():
    torch.manual_seed(0)
    module, args = PreNorm(16), (torch.randn(2, 3, 16),)
    theirs = convert_torch(module, args, override=False, minimum_deployment_target=ct.target.iOS17)
    ours = convert_torch(module, args, override=True, minimum_deployment_target=ct.target.iOS17)
    assert "layer_norm" not in op_types(theirs)
    assert op_types(ours) == ["layer_norm", "add"]
    assert_programs_equivalent(theirs, ours, rtol=1e-5)


# -- what must not be fused ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prog",
    [
        lambda: pattern_1(use_sub=True),  # x - mean used elsewhere
        lambda: pattern_1(axes=(-1,), axes2=(-2,)),  # the reductions differ
        lambda: pattern_1(gamma=rand(6), beta=rand(5, 6)),  # beta also varies along axis 1
        lambda: pattern_3(neg=-2.0),  # wrong constant
        lambda: pattern_4(scale=0.01),  # not 1/N
        lambda: pattern_5(affine=False, axes=(1,), axes2=(2,), shape=(3, 5, 4, 6)),
        lambda: written("sub1_pow_sqrt_none_nobeta", pow_y=3.0),
        lambda: written("sub1_mul_pow_none_nobeta", half=0.4),
        lambda: written("sub1_pow_sqrt_none_nobeta", (2, 3, 16), (1,)),  # axis 1 of rank 3: not trailing
        lambda: written("sub1_pow_sqrt_none_nobeta", (2, 3, 4, 16), (1, 2)),  # not trailing, not rank-4 [-3]
    ],
    ids=[
        "p1_sub_used",
        "p1_axes_differ",
        "p1_beta_shape",
        "p3_wrong_neg",
        "p4_wrong_scale",
        "p5_axes_differ",
        "pow_3",
        "pow_0.4",
        "rank3_axis1",
        "rank4_axes12",
    ],
)
def test_not_fused(prog):
    assert_untouched(prog())


def test_intermediate_block_output_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 16))])
    def prog(x):
        d = mb.sub(x=x, y=mb.reduce_mean(x=x, axes=[-1], keep_dims=True))
        var = mb.reduce_mean(x=mb.square(x=d), axes=[-1], keep_dims=True)
        s = mb.sqrt(x=mb.add(x=var, y=1e-5))
        return mb.real_div(x=d, y=s), s

    assert_untouched(prog)


def test_keep_dims_false_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 3, 3))])
    def prog(x):
        d = mb.sub(x=x, y=mb.reduce_mean(x=x, axes=[-1], keep_dims=False))  # broadcasts along axis 0
        var = mb.reduce_mean(x=mb.square(x=d), axes=[-1], keep_dims=True)
        return mb.real_div(x=d, y=mb.sqrt(x=mb.add(x=var, y=1e-5)))

    assert_untouched(prog)


def test_non_const_gamma_stays_a_mul():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 16)), mb.TensorSpec(shape=(16,))])
    def prog(x, w):
        d = mb.sub(x=x, y=mb.reduce_mean(x=x, axes=[-1], keep_dims=True))
        var = mb.reduce_mean(x=mb.pow(x=d, y=2.0), axes=[-1], keep_dims=True)
        n = mb.real_div(x=d, y=mb.sqrt(x=mb.add(x=var, y=1e-5)))
        return mb.add(x=mb.mul(x=n, y=w), y=rand(16))

    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["layer_norm", "mul", "add"]
    assert_programs_equivalent(prog, ours, rtol=1e-5)

    # coremltools' pattern 1 with a runtime gamma: nothing at all.
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 16)), mb.TensorSpec(shape=(16,))])
    def p1(x, w):
        mean = mb.reduce_mean(x=x, axes=[-1], keep_dims=True)
        var = mb.reduce_mean(x=mb.square(x=mb.sub(x=x, y=mean)), axes=[-1], keep_dims=True)
        k = mb.mul(x=mb.rsqrt(x=mb.add(x=var, y=1e-5)), y=w)
        return mb.add(x=mb.mul(x=x, y=k), y=mb.sub(x=rand(16), y=mb.mul(x=mean, y=k)))

    assert_untouched(p1)


def test_gamma_along_another_axis_is_not_absorbed():
    # Channels-first norm (axis 1 of NCHW) whose gamma [W] scales the last axis: the norm is fused, the
    # gamma stays a mul.
    prog = written("sub2_pow_sqrt_after_nobeta", (2, 6, 5, 6), (1,), gamma=rand(6))
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["layer_norm", "mul"]
    assert_programs_equivalent(prog, ours, rtol=1e-5)


def test_coremltools_wrong_fusion_is_refused():
    # Pattern 1 on NCHW, axes [1], gamma of shape [C] with C == W: coremltools makes layer_norm(axes=[1],
    # gamma) although gamma scales the last axis; the result is numerically different. Ours leaves it.
    prog = pattern_1((2, 6, 5, 6), (1,), rand(6), rand(6))
    theirs, ours = run_both_outcome(prog)
    assert op_types(theirs) == ["layer_norm"]
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, theirs, rtol=1e-3)
    assert_same_program(prog, ours)


def test_instance_norm_gamma_along_width_is_not_instance_norm():
    # coremltools squeezes a [1,1,1,W] gamma into an instance_norm per-channel gamma; ours builds the
    # layer_norm over [H, W] it really is.
    prog = pattern_1((2, 7, 5, 7), (2, 3), rand(1, 1, 1, 7), rand(1, 1, 1, 7))
    theirs, ours = run_both_outcome(prog)
    assert op_types(theirs) == ["instance_norm"]
    with pytest.raises(VerificationError):
        assert_programs_equivalent(prog, theirs, rtol=1e-3)
    assert op_types(ours) == ["layer_norm"]
    assert_programs_equivalent(prog, ours, rtol=1e-5)


def test_pattern_programs_are_exported_and_match():
    prog = written("sub2_pow_sqrt_after_beta")
    found = list(find_matches(WRITTEN_OUT_PATTERNS["sub2_pow_sqrt_after_beta"], prog))
    assert len(found) == 1 and found[0].final_op.name == "y"
    assert len(WRITTEN_OUT_PATTERNS) == 108
    assert isinstance(written_out_pattern("sub1", "mul", "rsqrt", "none", "nobeta"), Program)
