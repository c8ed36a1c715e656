"""``generic::remove_channels_last_round_trip``: ConvNeXt's channels-last norm and MLP, channels-first."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import evaluate, explain
from pattern_infra.testing.convert import convert_torch, count_ops, op_counts
from pattern_infra.testing.passes import check_new_pass, op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::remove_channels_last_round_trip"
RNG = np.random.default_rng(38)
C, HIDDEN = 6, 12


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def check(prog: Program, expected: list[str]) -> Program:
    """Runs the pass; demands op types ``expected`` (``op_types(prog)``: untouched) and equal outputs."""
    return check_new_pass(PASS, prog, expected)  # rtol 1e-5, atol 1e-6; the float64 sums differ in order


def round_trip(
    *,
    norm: bool = True,
    mlp: str | None = "gelu",
    single_linear: bool = False,
    scale: str | None = None,
    scale_shape: tuple[int, ...] = (C,),
    rank: int = 4,
    to_last: list[int] | None = None,
    axes: list[int] | None = None,
    extra: str | None = None,
) -> Program:
    """``transpose(channels last) -> [layer_norm] -> [linear -> f -> linear | linear] -> [mul | add]
    -> transpose(back)``, then a ``relu``; ``extra`` adds a decoy."""
    shape = (2, C) + (5, 4, 3)[: rank - 2]
    to_last = [0, *range(2, rank), 1] if to_last is None else to_last
    to_first = [0, rank - 1, *range(1, rank - 1)]

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)], opset_version=ct.target.iOS16)
    def prog(x):
        h = t = mb.transpose(x=x, perm=to_last, name="t_in")
        if norm:
            normalized = [h.shape[a] for a in sorted(a % rank for a in axes or [-1])]
            h = mb.layer_norm(
                x=h, axes=axes or [-1], gamma=f32(*normalized), beta=f32(*normalized), name="ln"
            )
        inner = h
        if single_linear:
            h = mb.linear(x=h, weight=f32(C, C), bias=f32(C), name="fc")
        elif mlp is not None:
            h = mb.linear(x=h, weight=f32(HIDDEN, C), bias=f32(HIDDEN), name="fc1")
            h = getattr(mb, mlp)(x=h, name="act")
            h = mb.linear(x=h, weight=f32(C, HIDDEN), bias=f32(C), name="fc2")
        if scale is not None:
            h = getattr(mb, scale)(x=f32(*scale_shape), y=h, name="gamma")
        out = mb.relu(x=mb.transpose(x=h, perm=to_first, name="t_out"), name="out")
        if extra == "inner_used_elsewhere":
            return out, mb.exp(x=inner)
        if extra == "inner_is_output":
            return out, inner
        if extra == "transpose_used_elsewhere":
            return out, mb.exp(x=t)
        return out

    return prog


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mlp": None}, ["layer_norm", "relu"]),  # timm / torchvision LayerNorm2d
        ({}, ["layer_norm", "conv", "gelu", "conv", "relu"]),  # torchvision / timm ConvNeXt block
        ({"scale": "mul"}, ["layer_norm", "conv", "gelu", "conv", "mul", "relu"]),  # original ConvNeXt
        (
            {"scale": "add", "scale_shape": (1, 1, 1, C)},
            ["layer_norm", "conv", "gelu", "conv", "add", "relu"],
        ),
        ({"scale": "mul", "scale_shape": (1,)}, ["layer_norm", "conv", "gelu", "conv", "mul", "relu"]),
        ({"norm": False, "mlp": "relu"}, ["conv", "relu", "conv", "relu"]),
        ({"norm": False, "single_linear": True}, ["conv", "relu"]),
        ({"mlp": "silu", "scale": "mul"}, ["layer_norm", "conv", "silu", "conv", "mul", "relu"]),
    ],
    ids=["norm", "block", "block_scale", "block_shift_rank4", "block_scalar", "mlp", "linear", "silu"],
)
def test_fused(kwargs, expected):
    ours = check(round_trip(**kwargs), expected)
    last = ours.functions["main"].find_ops(op_type="relu")[-1].x.op
    assert last.outputs[0].name == "t_out"
    norms = ours.functions["main"].find_ops(op_type="layer_norm")
    assert all(list(n.axes.val) == [1] for n in norms)


@pytest.mark.parametrize("rank", [3, 5])
def test_ranks(rank):
    check(round_trip(rank=rank, scale="mul"), ["layer_norm", "conv", "gelu", "conv", "mul", "relu"])


def test_conv_kernel_is_the_linear_weight():
    prog = round_trip(norm=False, single_linear=True)
    ours = run_pass(PASS, prog)
    (linear,) = prog.functions["main"].find_ops(op_type="linear")
    (conv,) = ours.functions["main"].find_ops(op_type="conv")
    np.testing.assert_array_equal(conv.weight.val, linear.weight.val[:, :, None, None])
    np.testing.assert_array_equal(conv.bias.val, linear.bias.val)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "inner_used_elsewhere"},
        {"extra": "inner_is_output"},
        {"extra": "transpose_used_elsewhere"},
        {"to_last": [0, 3, 2, 1]},  # another permutation
        {"axes": [-2, -1]},  # a norm over more than the channels
        {"axes": [2]},  # over another axis
        {"scale": "mul", "scale_shape": (4, 1)},  # a constant along the width
        {"mlp": None, "norm": False},  # nothing between: merge_consecutive_transposes' business
    ],
    ids=[
        "norm_used_elsewhere",
        "norm_is_output",
        "transpose_used_elsewhere",
        "perm",
        "two_axes",
        "other_axis",
        "scale_along_width",
        "empty",
    ],
)
def test_not_fused(kwargs):
    prog = round_trip(**kwargs)
    check(prog, op_types(prog))


def test_refusals_say_why():
    assert "normalises over axes" in str(explain(PASS, round_trip(axes=[-2, -1])))
    assert "is not [0, 2, 3, 1]" in str(explain(PASS, round_trip(to_last=[0, 3, 2, 1])))
    assert "not one value per channel" in str(explain(PASS, round_trip(scale="mul", scale_shape=(4, 1))))


def test_compressed_linear_weight_is_refused_with_the_reason():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C, 5, 4))], opset_version=ct.target.iOS18)
    def prog(x):
        weight = mb.constexpr_blockwise_shift_scale(
            data=RNG.integers(-8, 8, (C, C)).astype(np.int8), scale=f32(C, 1)
        )
        t = mb.transpose(x=x, perm=[0, 2, 3, 1])
        norm = mb.layer_norm(x=t, axes=[-1], gamma=f32(C), beta=f32(C))
        lin = mb.linear(x=norm, weight=weight, bias=f32(C))
        return mb.transpose(x=lin, perm=[0, 3, 1, 2])

    check(prog, op_types(prog))
    assert "is compressed or not a constant" in str(explain(PASS, prog, top=10))


def test_fp16():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, C, 5, 4))], opset_version=ct.target.iOS16)
    def prog(x):
        h = mb.transpose(x=mb.cast(x=x, dtype="fp16"), perm=[0, 2, 3, 1])
        h16 = {name: f32(*shape).astype(np.float16) for name, shape in [("g", (C,)), ("b", (C,))]}
        h = mb.layer_norm(x=h, axes=[-1], gamma=h16["g"], beta=h16["b"], epsilon=np.float16(1e-3))
        h = mb.linear(x=h, weight=f32(HIDDEN, C).astype(np.float16), bias=f32(HIDDEN).astype(np.float16))
        h = mb.linear(
            x=mb.gelu(x=h), weight=f32(C, HIDDEN).astype(np.float16), bias=f32(C).astype(np.float16)
        )
        h = mb.mul(x=h, y=f32(C).astype(np.float16))
        return mb.cast(x=mb.transpose(x=h, perm=[0, 3, 1, 2]), dtype="fp32")

    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["cast", "layer_norm", "conv", "gelu", "conv", "mul", "cast"]
    (conv, _) = ours.functions["main"].find_ops(op_type="conv")
    assert (
        conv.weight.val.dtype == np.float16
        and conv.outputs[0].dtype == prog.functions["main"].find_ops(op_type="linear")[0].outputs[0].dtype
    )
    assert_programs_equivalent(prog, ours)  # the float16 constants, evaluated in float64


# ---- PyTorch: a ConvNeXt block, tiny torchvision and timm ConvNeXts, converted both ways ------------


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights and biases, layer scales and biases random (a fresh model holds them constant)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "layer_scale" in name or "gamma" in name:
                base = 1.0 if name.endswith("weight") and p.ndim == 1 else 0.0
                p.copy_(torch.randn_like(p) * 0.5 + base)
    return model.eval()


def _torchvision_convnext() -> torch.nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 2)], num_classes=10)


def _torchvision_block() -> torch.nn.Module:
    from torchvision.models.convnext import CNBlock

    return CNBlock(8, layer_scale=1e-6, stochastic_depth_prob=0.0)


def _timm_convnext(conv_mlp: bool) -> torch.nn.Module:
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(depths=(1, 1, 2, 1), dims=(8, 16, 24, 32), conv_mlp=conv_mlp, num_classes=10)


class OriginalBlock(torch.nn.Module):
    """The block of the original ConvNeXt code: the layer scale inside, channels last."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dwconv = torch.nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.pwconv2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.gamma = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).permute(0, 2, 3, 1)
        h = self.gamma * self.pwconv2(torch.nn.functional.gelu(self.pwconv1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


MODELS = {
    "torchvision_block": (_torchvision_block, (1, 8, 8, 8)),
    "original_block": (OriginalBlock, (1, 8, 8, 8)),
    "torchvision_convnext": (_torchvision_convnext, (1, 3, 32, 32)),
    "timm_convnext": (lambda: _timm_convnext(False), (1, 3, 64, 64)),
    "timm_convnext_conv_mlp": (lambda: _timm_convnext(True), (1, 3, 64, 64)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_convnext_loses_every_transpose_and_layer_scale(name):
    build, shape = MODELS[name]
    model, x = _randomised(build()), torch.randn(*shape)
    kwargs = {"minimum_deployment_target": ct.target.iOS18}
    off = convert_torch(model, (x,), override=False, **kwargs)
    on = convert_torch(model, (x,), override=True, **kwargs)
    before, after = op_counts(off), op_counts(on)
    assert before["transpose"] > 0 and after["transpose"] == 0
    assert after["mul"] == 0
    assert count_ops(on) < count_ops(off)
    expected = model(x).detach().numpy()
    errors = []
    for prog in (off, on):
        (name,) = prog.functions["main"].inputs
        (out,) = evaluate(prog, {name: x.numpy()}).values()
        errors.append(float(np.max(np.abs(out - expected))))
    scale = float(np.max(np.abs(expected)))
    assert errors[1] <= max(2 * errors[0], 1e-6 * scale), errors  # float32 rounding, not a wrong rewrite
    assert errors[1] <= 1e-5 * scale, errors


@pytest.mark.parametrize("name", ["torchvision_convnext", "timm_convnext"])
def test_convnext_at_float16(name):
    """At coremltools' default float16 the rewrite holds too, evaluated op by op in float16."""
    build, shape = MODELS[name]
    model, x = _randomised(build()), torch.randn(*shape)
    kwargs = {"minimum_deployment_target": ct.target.iOS18, "compute_precision": ct.precision.FLOAT16}
    off = convert_torch(model, (x,), override=False, **kwargs)
    on = convert_torch(model, (x,), override=True, **kwargs)
    assert op_counts(off)["transpose"] > 0 and op_counts(on)["transpose"] == 0
    assert count_ops(on) < count_ops(off)
    expected = model(x).detach().numpy()
    errors = []
    for prog in (off, on):
        (name_in,) = prog.functions["main"].inputs
        (out,) = evaluate(prog, {name_in: x.numpy()}, precision="native").values()
        errors.append(float(np.max(np.abs(out - expected))))
    assert errors[1] <= 2 * errors[0], errors  # float16 rounding of other sums, as large as coremltools'


def test_the_project_pipeline_gives_the_same_program():
    """``pattern_infra.pipeline()`` runs both passes where the default pipeline does, with the override."""
    from pattern_infra import pipeline
    from pattern_infra.testing.pipelines import converted, program_signature

    def source():
        model, x = _randomised(_timm_convnext(False)), torch.randn(1, 3, 64, 64)
        return torch.export.export(model, (x,)).run_decompositions({})

    options = {"compute_precision": ct.precision.FLOAT32, "minimum_deployment_target": ct.target.iOS18}
    by_pass = converted(source, **options)
    swept = converted(source, pipeline, **options)
    assert program_signature(swept) == program_signature(by_pass)
    assert op_counts(swept)["transpose"] == 0
