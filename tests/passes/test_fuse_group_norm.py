"""``generic::fuse_group_norm``: group norms written out into ``layer_norm`` / ``instance_norm``."""

from __future__ import annotations

import itertools
import sys
import types as pytypes

import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_group_norm import AFFINE_FORMS, INV_FORMS, NUMERATOR_FORMS, SQUARE_FORMS
from pattern_infra import assert_programs_equivalent, evaluate
from pattern_infra.testing.convert import convert_mil, convert_torch_model, count_ops, op_counts
from pattern_infra.testing.passes import op_types, run_pass

PASS = "generic::fuse_group_norm"
UNRESHAPED = "generic::fuse_group_norm_unreshaped"
"""The pass of the spellings without reshapes, which runs after the layer-norm pass."""
N, C, H, W = 2, 8, 5, 6
EPS = 1e-5
RNG = np.random.default_rng(3)
GAMMA = (1.0 + 0.5 * RNG.standard_normal(C)).astype(np.float32)
BETA = (0.5 * RNG.standard_normal(C)).astype(np.float32)
BN = [np.abs(RNG.standard_normal(C)).astype(np.float32) + 0.5 for _ in range(4)]  # mean, var, gamma, beta
AFFINE_OPS = {
    "mul_add": ["mul", "add"],
    "batch_norm": ["batch_norm"],
    "mul": ["mul"],
    "add": ["add"],
    None: [],
}


def group_norm(
    numerator: str = "own_mean",
    square: str = "square",
    inv: str = "div",
    affine: str | None = "mul_add",
    *,
    groups: int | None = 4,
    axes: list[int] | None = None,
    dtype=types.fp32,
    swap: bool = False,
    gamma: np.ndarray | None = None,
    exponent: float = 2.0,
    eps_input: bool = False,
    leak: bool = False,
    sq_axes: list[int] | None = None,
    reshape_to: tuple | None = None,
) -> Program:
    """One spelling (see the pass docstring) of a group norm of ``x`` (N, C, H, W).

    ``groups=None``: no reshapes, the reductions over ``axes`` of ``x`` itself. Near misses: ``gamma``
    (another affine constant), ``exponent``, ``eps_input`` (a runtime epsilon), ``leak`` (the ``sqrt``
    is also an output), ``sq_axes`` (the second reduction over other axes), ``reshape_to`` (another
    grouping shape). ``swap`` writes every commutative operand the other way round.
    """
    np_dtype = np.float16 if dtype == types.fp16 else np.float32
    specs = [mb.TensorSpec(shape=(N, C, H, W), dtype=dtype)]
    if eps_input:
        specs.append(mb.TensorSpec(shape=(1,), dtype=dtype))

    def mul(a, b):
        return mb.mul(x=b, y=a) if swap else mb.mul(x=a, y=b)

    def body(x, e=None):
        if groups is None:
            xr, red = x, axes
        else:
            xr = mb.reshape(x=x, shape=reshape_to or (N, groups, C // groups, H, W))
            red = [2, 3, 4]
        mean = mb.reduce_mean(x=xr, axes=red, keep_dims=True)
        d = mb.sub(x=xr, y=mean)
        if square == "square":
            sq = mb.square(x=d)
        elif square == "pow":
            sq = mb.pow(x=d, y=np_dtype(exponent))
        else:
            sq = mul(d, d)
        v = mb.reduce_mean(x=sq, axes=sq_axes or red, keep_dims=True)
        e = np_dtype(EPS) if e is None else e
        if inv != "rsqrt_eps":
            v = mb.add(x=e, y=v) if swap else mb.add(x=v, y=e)
        if numerator == "shared":
            num = d
        elif numerator == "sub2":
            num = mb.sub(x=xr, y=mean)
        else:
            num = mb.sub(x=xr, y=mb.reduce_mean(x=xr, axes=red, keep_dims=True))
        if inv == "rsqrt_eps":  # the epsilon folded into rsqrt (generic::fold_add_into_epsilon's form)
            std = mb.rsqrt(x=v, epsilon=e)
        else:
            std = mb.sqrt(x=v) if inv == "div" else mb.rsqrt(x=v)
        n = mb.real_div(x=num, y=std) if inv == "div" else mul(num, std)
        y = n if groups is None else mb.reshape(x=n, shape=(N, C, H, W))
        g = (GAMMA.reshape(C, 1, 1) if gamma is None else gamma).astype(np_dtype)
        b = BETA.reshape(1, C, 1, 1).astype(np_dtype)
        if affine == "mul_add":
            y = mb.add(x=b, y=mul(y, g)) if swap else mb.add(x=mul(y, g), y=b)
        elif affine == "mul":
            y = mul(y, g)
        elif affine == "add":
            y = mb.add(x=y, y=b)
        elif affine == "batch_norm":
            mean_, var_, g_, b_ = (p.astype(np_dtype) for p in BN)
            y = mb.batch_norm(x=y, mean=mean_, variance=var_, gamma=g_, beta=b_, epsilon=np_dtype(1e-3))
        return (y, std) if leak else y

    if eps_input:
        return mb.program(input_specs=specs)(lambda x, e: body(x, e))
    return mb.program(input_specs=specs)(lambda x: body(x))


def expected(groups: int | None, affine: str | None, axes: list[int] | None = None) -> list[str]:
    """The op types the pass leaves: the fused op, and the affine when the op cannot hold it."""
    if groups == C or (groups is None and axes == [2, 3]):
        return ["instance_norm"]
    if groups == 1 or groups is None:
        return ["layer_norm", *AFFINE_OPS[affine]]
    return ["reshape", "layer_norm", "reshape", *AFFINE_OPS[affine]]


def pass_of(prog: Program) -> str:
    """The pass whose spellings ``prog`` is written in: with reshapes or without."""
    reshaped = any(op.op_type == "reshape" for op in prog.functions["main"].operations)
    return PASS if reshaped else UNRESHAPED


def check(prog: Program, types_after: list[str], rtol: float = 1e-5, atol: float = 1e-5) -> Program:
    """Runs the pass, demands ``types_after`` and the same outputs as before (outputs are O(1))."""
    ours = run_pass(pass_of(prog), prog)
    assert op_types(ours) == types_after, op_types(ours)
    assert_programs_equivalent(prog, ours, rtol=rtol, atol=atol)
    return ours


def unchanged(prog: Program) -> None:
    assert op_types(run_pass(pass_of(prog), prog)) == op_types(prog)


def the_op(prog: Program, op_type: str):
    (op,) = [op for op in prog.functions["main"].operations if op.op_type == op_type]
    return op


@pytest.mark.parametrize("groups", [4, C])
@pytest.mark.parametrize(
    ("numerator", "square", "inv"), itertools.product(NUMERATOR_FORMS, SQUARE_FORMS, INV_FORMS)
)
def test_every_spelling_fuses(numerator, square, inv, groups):
    check(group_norm(numerator, square, inv, groups=groups), expected(groups, "mul_add"))


@pytest.mark.parametrize("affine", [*AFFINE_FORMS, None])
@pytest.mark.parametrize(
    ("groups", "axes"), [(1, None), (4, None), (C, None), (None, [1, 2, 3]), (None, [2, 3])]
)
def test_every_group_count_and_affine(groups, axes, affine):
    check(group_norm(groups=groups, axes=axes, affine=affine), expected(groups, affine, axes))


@pytest.mark.parametrize(("groups", "axes"), [(1, None), (C, None), (None, [2, 3])])
def test_swapped_operands(groups, axes):
    prog = group_norm("sub2", "mul", "rsqrt", groups=groups, axes=axes, swap=True)
    check(prog, expected(groups, "mul_add", axes))


def test_instance_norm_absorbs_the_affine():
    ours = check(group_norm(groups=C), ["instance_norm"])
    norm = the_op(ours, "instance_norm")
    np.testing.assert_array_equal(norm.gamma.val, GAMMA)
    np.testing.assert_array_equal(norm.beta.val, BETA)
    assert float(norm.epsilon.val) == pytest.approx(EPS, rel=1e-6)


def test_batch_norm_folded_into_instance_norm():
    ours = check(group_norm(groups=C, affine="batch_norm"), ["instance_norm"])
    mean, var, gamma, beta = (p.astype(np.float64) for p in BN)
    scale = gamma / np.sqrt(var + np.float64(np.float32(1e-3)))
    np.testing.assert_allclose(the_op(ours, "instance_norm").gamma.val, scale, rtol=1e-7)
    np.testing.assert_allclose(the_op(ours, "instance_norm").beta.val, beta - mean * scale, rtol=1e-6)


def test_rsqrt_epsilon_is_added():
    ours = check(group_norm(inv="rsqrt", groups=1, affine=None), ["layer_norm"])
    assert float(the_op(ours, "layer_norm").epsilon.val) == pytest.approx(EPS + 1e-12, rel=1e-6)
    assert predicates_axes(the_op(ours, "layer_norm")) == [1, 2, 3]


def predicates_axes(op) -> list[int]:
    return [int(a) for a in op.axes.val]


def test_full_size_gamma_folds_into_layer_norm():
    gamma = (1.0 + RNG.standard_normal((C, H, W))).astype(np.float32)
    ours = check(group_norm(groups=None, axes=[1, 2, 3], affine="mul", gamma=gamma), ["layer_norm"])
    np.testing.assert_array_equal(the_op(ours, "layer_norm").gamma.val, gamma)


@pytest.mark.parametrize("groups", [1, 4, C])
def test_float16(groups):
    # A batch_norm folded into instance_norm rounds its scale and shift to float16 (2**-11 each, relative):
    # about 1e-3 of the output's size where scale * n and shift cancel; the rest is exact up to 1e-5.
    for affine in ("mul_add", "batch_norm"):
        tolerance = 4e-3 if affine == "batch_norm" and groups == C else 1e-5
        prog = group_norm(groups=groups, affine=affine, dtype=types.fp16)
        ours = check(prog, expected(groups, affine), rtol=tolerance, atol=tolerance)
        ops = [op for op in ours.functions["main"].operations if op.op_type != "const"]
        assert {op.outputs[0].dtype for op in ops} == {types.fp16}
        norm = ops[1] if groups == 4 else ops[0]
        assert norm.epsilon.dtype == types.fp16 and (norm.gamma is None or norm.gamma.dtype == types.fp16)


@pytest.mark.parametrize("inv", ["div", "rsqrt"])
@pytest.mark.parametrize("numerator", NUMERATOR_FORMS)
@pytest.mark.parametrize("axes", [[1, 2, 3], [2, 3]])
def test_unreshaped_spellings_are_the_layer_norm_pass_s_first(numerator, axes, inv):
    """A whole conversion, override on. Without reshapes the layer-norm pass runs first: where it fuses a
    norm over ``[1, 2, 3]`` it makes one ``layer_norm`` (gamma repeated over space), and nothing of the
    affine is left after it; what it leaves (the numerator with its own mean), the unreshaped pass fuses
    right after it, the affine after the norm (a ``batch_norm`` by then), with ``rsqrt`` too, whose ``add``
    ``generic::fold_add_into_epsilon`` has folded by then."""
    prog = group_norm(numerator, inv=inv, groups=None, axes=axes)
    ours = convert_mil(prog, override=True)
    assert_programs_equivalent(prog, ours, rtol=1e-5, atol=1e-5)
    left = op_types(ours)
    if axes == [2, 3]:
        assert left == ["instance_norm"]
    else:
        assert left == (["layer_norm", "batch_norm"] if numerator == "own_mean" else ["layer_norm"])


# -- left alone ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axes", [[1, 2], [3], [1, 3]])
def test_other_axes_left_to_the_layer_norm_pass(axes):
    unchanged(group_norm(groups=None, axes=axes, affine=None))


def test_reductions_over_different_axes():
    unchanged(group_norm(groups=None, axes=[1, 2, 3], sq_axes=[2, 3]))
    unchanged(group_norm(groups=4, sq_axes=[3, 4]))


def test_reshape_that_is_not_n_g_c_over_g_spatial():
    unchanged(group_norm(groups=4, reshape_to=(N, 4, 2, W, H)))


def test_intermediate_used_elsewhere():
    unchanged(group_norm(groups=1, leak=True))


def test_runtime_epsilon():
    unchanged(group_norm(groups=C, eps_input=True))


def test_exponent_other_than_two():
    unchanged(group_norm(square="pow", exponent=3.0, groups=C))


@pytest.mark.parametrize("gamma_shape", [(C, H, 1), (1, 1, W)])
def test_gamma_not_per_channel_stays_after_instance_norm(gamma_shape):
    gamma = (1.0 + RNG.standard_normal(gamma_shape)).astype(np.float32)
    check(group_norm(groups=C, gamma=gamma), ["instance_norm", "mul", "add"])


def test_second_run_changes_nothing():
    once = run_pass(PASS, group_norm(groups=4))
    assert str(run_pass(PASS, once)) == str(once)


# -- real models --------------------------------------------------------------------------------------------


def _tiny_poolformer() -> torch.nn.Module:
    """timm's poolformer (``GroupNorm1`` around every token mixer and MLP) at a tiny size, random weights,
    its norms' weights and biases randomised too."""
    sys.modules.setdefault(
        "torchvision._meta_registrations", pytypes.ModuleType("torchvision._meta_registrations")
    )
    from timm.layers import GroupNorm1
    from timm.models.metaformer import MetaFormer

    torch.manual_seed(0)
    model = MetaFormer(
        depths=(1, 1, 1, 1),
        dims=(16, 24, 32, 40),
        downsample_norm=None,
        mlp_act=torch.nn.GELU,
        mlp_bias=True,
        norm_layers=GroupNorm1,
        layer_scale_init_values=1e-5,
        res_scale_init_values=None,
        use_mlp_head=False,
        num_classes=10,
    )
    for module in model.modules():
        if isinstance(module, torch.nn.GroupNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.5)
            torch.nn.init.normal_(module.bias, 0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def poolformer():
    model = _tiny_poolformer()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        reference = model(x).numpy()
    converted = {on: convert_torch_model(model, (x,), override=on)._mil_program for on in (False, True)}
    return x, reference, converted


def test_poolformer_group_norms_fused_and_equal_to_pytorch(poolformer):
    x, reference, converted = poolformer
    off, on = op_counts(converted[False]), op_counts(converted[True])
    assert off["sqrt"] > 0 and on["sqrt"] == 0  # coremltools writes each GroupNorm1 out
    assert on["layer_norm"] == off["layer_norm"] + 8
    assert count_ops(converted[True]) < count_ops(converted[False])
    for prog in converted.values():
        (out,) = evaluate(prog, {"x": x.numpy()}).values()
        np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-5 * np.abs(reference).max())


def test_saved_float16_group_norm_package(tmp_path):
    """A float16 package saved by coremltools (the norm after CSE, its affine a ``batch_norm``) optimized
    the way ``mil-patterns optimize`` does it: ``instance_norm`` (G = C), ``layer_norm`` (G = 1) and a
    ``layer_norm`` between the reshapes (G = 2)."""
    import coremltools as ct

    from pattern_infra.cli.mlpackage import load_mlpackage, run_passes

    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.GroupNorm(C, C), torch.nn.Conv2d(C, C, 1), torch.nn.GroupNorm(1, C), torch.nn.GroupNorm(2, C)
    )
    for module in model.modules():
        if isinstance(module, torch.nn.GroupNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.5)
            torch.nn.init.normal_(module.bias, 0.0, 0.5)
    x = torch.randn(N, C, H, W)
    mlmodel = convert_torch_model(model.eval(), (x,), override=False, compute_precision=ct.precision.FLOAT16)
    mlmodel.save(str(tmp_path / "gn.mlpackage"))
    saved = load_mlpackage(tmp_path / "gn.mlpackage").program
    prog = load_mlpackage(tmp_path / "gn.mlpackage").program
    run_passes(prog, passes=[PASS])
    before, after = op_counts(saved), op_counts(prog)
    assert before["sqrt"] > 0 and after["sqrt"] == 0
    assert after["instance_norm"] == 1 and after["layer_norm"] == 2 and after["reshape"] == 2
    assert count_ops(prog) < count_ops(saved)
    (name,) = prog.functions["main"].inputs
    (out,) = evaluate(prog, {name: x.numpy()}).values()
    with torch.no_grad():
        reference = model(x).numpy()
    # the batch_norm folded into instance_norm rounds its scale and shift to float16 (see test_float16)
    assert_programs_equivalent(saved, prog, rtol=4e-3, atol=4e-3)
    # against PyTorch in float32: the saved model's own float16 constants and intermediates
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-2 * np.abs(reference).max())
