"""Compressed weights are weights: the four weight folds fire on ``constexpr_*`` weights without
decompressing them.

``fuse_linear_bias``, ``fuse_matmul_weight_bias``, ``fuse_conv_scale`` and ``fuse_conv_batchnorm`` with a
palettized (``constexpr_lut_to_dense``) or int8 (``constexpr_blockwise_shift_scale``) weight: the fusion
happens (coremltools' passes leave these programs alone), the program computes the same (reference
evaluator, rtol 1e-5: the LUT entries, scales and factors are dyadic, so the folded values are exact in
fp32), the weight stays compressed (no plain ``const`` of the weight's size) and the saved weight file is
no larger. Where a fold is impossible the match is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types
from coremltools.converters.mil.mil.ops.defs.iOS18.compression import (
    constexpr_blockwise_shift_scale,
    constexpr_lut_to_dense,
)

import generic_passes  # noqa: F401  (registers the passes)
import pattern_infra
from pattern_infra.authoring.clone import clone_program
from pattern_infra.language import ConstRule, is_compressed
from pattern_infra.testing.passes import op_types, run_both, run_pass
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.verify import assert_programs_equivalent

RNG = np.random.default_rng(18)
C_IN, C_OUT, K = 4, 6, 3
D_IN, D_OUT = 32, 8


def dyadic(*shape: int) -> np.ndarray:
    return (RNG.integers(-8, 9, shape) / 4).astype(np.float32)


def positive_dyadic(*shape: int) -> np.ndarray:
    return (RNG.integers(1, 9, shape) / 4).astype(np.float32)


def compressed(kind: str, shape: tuple[int, ...]):
    """A compressed weight of ``shape`` (output channel on axis 0), built in the current program."""
    rank = len(shape)
    if kind.startswith("lut"):
        indices = RNG.integers(0, 16, shape).astype(types.np_uint4_dtype)
        palettes = shape[0] if kind == "lut_per_channel" else 1
        lut_shape = (palettes,) + (1,) * (rank - 1) + (16, 1)
        if kind == "lut_int8":  # the LUT itself int8, dequantized by a constexpr_blockwise_shift_scale
            lut = mb.constexpr_blockwise_shift_scale(
                data=RNG.integers(-8, 9, lut_shape).astype(np.int8),
                scale=np.full((1,) * (rank + 2), 0.25, np.float32),
            )
        else:
            lut = dyadic(*lut_shape)
        return mb.constexpr_lut_to_dense(indices=indices, lut=lut)
    block = (1,) * rank if kind == "int8_per_tensor" else (shape[0],) + (1,) * (rank - 1)
    offset = RNG.integers(-2, 3, block).astype(np.int8) if kind == "int8_per_tensor" else None
    data = RNG.integers(-128, 128, shape).astype(np.int8)
    kwargs = {} if offset is None else {"offset": offset}
    return mb.constexpr_blockwise_shift_scale(data=data, scale=positive_dyadic(*block) / 8, **kwargs)


KINDS = ["lut_per_channel", "lut_shared", "lut_int8", "int8_per_channel", "int8_per_tensor"]
SAVED = ("lut_shared", "int8_per_channel")  # saving takes ~2 s: one kind that adds an op, one that does not
WEIGHT_SIZE = {"conv": C_OUT * C_IN * K * K, "linear": D_OUT * D_IN}


def conv_prog(kind: str, after: str) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C_IN, 7, 7))], opset_version=ct.target.iOS18)
    def prog(x):
        conv = mb.conv(x=x, weight=compressed(kind, (C_OUT, C_IN, K, K)), bias=dyadic(C_OUT))
        if after == "scale":
            return mb.mul(x=conv, y=dyadic(C_OUT, 1, 1))
        return mb.batch_norm(
            x=conv,
            mean=dyadic(C_OUT),
            variance=RNG.choice([1.0, 4.0, 16.0], C_OUT).astype(np.float32) - 0.25,
            gamma=dyadic(C_OUT),
            beta=dyadic(C_OUT),
            epsilon=np.float32(0.25),
        )

    return prog


def linear_prog(kind: str, op: str) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=(3, D_IN))], opset_version=ct.target.iOS18)
    def prog(x):
        if op == "matmul":
            y = mb.matmul(x=x, y=compressed(kind, (D_OUT, D_IN)), transpose_y=True)
        else:
            y = mb.linear(x=x, weight=compressed(kind, (D_OUT, D_IN)), bias=dyadic(D_OUT))
        return mb.sub(x=dyadic(D_OUT), y=y) if op == "c - linear" else mb.add(x=y, y=dyadic(D_OUT))

    return prog


CASES: dict[str, tuple[str, Callable[[str], Program], str]] = {
    "conv_scale": ("common::fuse_conv_scale", lambda kind: conv_prog(kind, "scale"), "conv"),
    "conv_batchnorm": ("common::fuse_conv_batchnorm", lambda kind: conv_prog(kind, "bn"), "conv"),
    "linear_bias": ("common::fuse_linear_bias", lambda kind: linear_prog(kind, "linear"), "linear"),
    "c_minus_linear": ("common::fuse_linear_bias", lambda kind: linear_prog(kind, "c - linear"), "linear"),
    "matmul_bias": ("common::fuse_matmul_weight_bias", lambda kind: linear_prog(kind, "matmul"), "linear"),
}


def weight_bytes(prog: Program, tmp_path: Path, name: str) -> int:
    model = ct.convert(
        clone_program(prog),
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        pass_pipeline=ct.PassPipeline.EMPTY,
        skip_model_load=True,
    )
    path = tmp_path / f"{name}.mlpackage"
    model.save(str(path))
    return (path / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size


def cleaned(prog: Program) -> Program:
    """``prog`` after dead-code elimination (the old constexpr ops left without users go)."""
    ct.converters.mil.mil.passes.pass_registry.PASS_REGISTRY["common::dead_code_elimination"](prog)
    return prog


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_fold_into_a_compressed_weight(case, kind, tmp_path):
    pass_id, build, fused_op = CASES[case]
    prog = build(kind)
    outcome = run_both(pass_id, prog)
    assert op_types(outcome.coremltools) == op_types(prog)  # coremltools leaves it
    ours = cleaned(outcome.ours)
    ops = [t for t in op_types(ours) if not t.startswith("constexpr_")]
    assert ops == [fused_op]
    (fused,) = [op for op in ours.functions["main"].operations if op.op_type == fused_op]
    assert is_compressed(fused.weight)
    size = WEIGHT_SIZE[fused_op]
    consts = [op.outputs[0] for op in ours.functions["main"].operations if op.op_type == "const"]
    floats = [v for v in consts if v.dtype in (types.fp16, types.fp32, types.fp64)]
    assert all(np.size(v.val) < size for v in floats), "a weight was decompressed"
    assert any(np.size(v.val) == size for v in consts)  # the indices or int8 data, kept
    assert_programs_equivalent(prog, ours)
    if kind in SAVED:
        assert weight_bytes(ours, tmp_path, "ours") <= weight_bytes(prog, tmp_path, "before")


def test_a_chain_of_folds_stays_compressed():
    """``batch_norm(conv(x) * s)``: the second fold goes into the constexpr op the first one made."""
    prog = conv_prog("lut_shared", "scale")
    block = prog.functions["main"]
    with block:
        out = block.outputs[0]
        bn = mb.batch_norm(
            x=out, mean=dyadic(C_OUT), variance=np.ones(C_OUT, np.float32) - 0.25, epsilon=0.25
        )
    block.set_outputs([bn])
    ours = cleaned(run_pass("common::fuse_conv_batchnorm", run_pass("common::fuse_conv_scale", prog)))
    assert op_types(ours) == ["constexpr_lut_to_dense", "constexpr_blockwise_shift_scale", "conv"]
    assert_programs_equivalent(prog, ours)


def refusal(pass_id: str, prog: Program) -> str:
    assert op_types(run_pass(pass_id, prog)) == op_types(prog)
    return str(pattern_infra.explain(pass_id, prog))


def test_before_ios18_a_shared_lut_is_refused_with_the_reason():
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C_IN, 7, 7))], opset_version=ct.target.iOS17)
    def prog(x):
        n = C_OUT * C_IN * K * K
        weight = mb.constexpr_lut_to_dense(
            lut=dyadic(16),
            indices=RNG.integers(0, 256, n // 2).astype(np.uint8),
            shape=np.array([C_OUT, C_IN, K, K], np.uint32),
        )
        return mb.batch_norm(
            x=mb.conv(x=x, weight=weight), mean=dyadic(C_OUT), variance=np.ones(C_OUT, np.float32)
        )

    assert "needs iOS18 or later (constexpr_blockwise_shift_scale)" in refusal(
        "common::fuse_conv_batchnorm", prog
    )


def test_a_compressed_weight_the_linear_would_transpose_is_refused_with_the_reason():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3, D_IN))], opset_version=ct.target.iOS18)
    def prog(x):
        y = mb.matmul(x=x, y=compressed("int8_per_channel", (D_IN, D_OUT)))
        return mb.add(x=y, y=dyadic(D_OUT))

    reason = refusal("common::fuse_matmul_weight_bias", prog)
    assert (
        "weight compressed by constexpr_blockwise_shift_scale: the linear would need it transposed" in reason
    )


def test_const_rule_weight_accepts_constants_and_compressed_weights_only():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3, D_IN))], opset_version=ct.target.iOS18)
    def prog(x):
        w = compressed("lut_int8", (D_OUT, D_IN))
        return (
            mb.linear(x=x, weight=w),
            mb.linear(x=x, weight=dyadic(D_OUT, D_IN)),
            mb.matmul(x=x, y=x, transpose_y=True),
        )

    ops = [op for op in prog.functions["main"].operations if op.op_type in ("linear", "matmul")]
    rule = ConstRule("weight")
    assert rule.accepts(ops[0].weight, None) is None
    assert rule.accepts(ops[1].weight, None) is None
    assert "neither a compile-time constant nor a compressed weight" in rule.accepts(ops[2].y, None)
    assert ConstRule("const").accepts(ops[0].weight, None) is not None


@pytest.mark.parametrize("vector_size", [1, 2])
def test_the_evaluator_computes_lut_and_shift_scale_as_coremltools_defines_them(vector_size):
    indices = RNG.integers(0, 4, (4, 6)).astype(types.np_uint2_dtype)
    lut = RNG.standard_normal((2, 3, 4, vector_size)).astype(np.float32)
    data = RNG.integers(-128, 128, (4, 6 * vector_size)).astype(np.int8)
    scale = RNG.standard_normal((2, 3)).astype(np.float32)
    offset = RNG.integers(-3, 4, (2, 3)).astype(np.int8)
    vector_axis = {} if vector_size == 1 else {"vector_axis": 1}

    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 6 * vector_size))], opset_version=ct.target.iOS18)
    def prog(x):
        dense = mb.constexpr_lut_to_dense(indices=indices, lut=lut, **vector_axis)
        shifted = mb.constexpr_blockwise_shift_scale(data=data, scale=scale, offset=offset)
        chained = mb.constexpr_blockwise_shift_scale(data=dense, scale=np.float32([[2.0, -1.0, 0.5]]))
        return mb.add(x=mb.add(x=x, y=dense), y=mb.add(x=shifted, y=chained))

    want_dense = constexpr_lut_to_dense.decompress(indices, lut, None if vector_size == 1 else 1)
    want = (
        want_dense
        + constexpr_blockwise_shift_scale.decompress(data, scale, offset)
        + constexpr_blockwise_shift_scale.decompress(want_dense, np.float32([[2.0, -1.0, 0.5]]), None)
    )
    zeros = np.zeros((4, 6 * vector_size))
    (got,) = evaluate(prog, {"x": zeros}).values()
    np.testing.assert_allclose(got, want, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# Measured on the zoo's conv + batch norm models (slow: four conversions per model and compression)
# --------------------------------------------------------------------------------------------------


def compressing_pipeline(compression: str) -> ct.PassPipeline:
    """coremltools' default pipeline with its weights compressed first, before the fusion passes:
    ``DEFAULT_PALETTIZATION`` with a 4-bit uniform per-channel LUT (k-means needs scikit-learn), or the
    default pipeline after an int8 per-channel ``compression::linear_quantize_weights``."""
    from coremltools.optimize.coreml import (
        OpLinearQuantizerConfig,
        OpPalettizerConfig,
        OptimizationConfig,
    )

    if compression == "palettized":
        pipeline = ct.PassPipeline.DEFAULT_PALETTIZATION
        op_config = OpPalettizerConfig(
            mode="uniform", nbits=4, granularity="per_grouped_channel", group_size=1, weight_threshold=256
        )
        pipeline.set_options("compression::palettize_weights", {"config": OptimizationConfig(op_config)})
        return pipeline
    pipeline = ct.PassPipeline.DEFAULT
    pipeline.insert_pass(0, "compression::linear_quantize_weights")
    op_config = OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", weight_threshold=256)
    pipeline.set_options("compression::linear_quantize_weights", {"config": OptimizationConfig(op_config)})
    return pipeline


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["palettized", "int8"])
@pytest.mark.parametrize("model_name", ["resnet_stack", "mobilenet_block"])
def test_measure_zoo_models(model_name, compression, tmp_path):
    """Op counts plain / coremltools / ours, batch norms left and weight.bin bytes (printed; ``-s``)."""
    from pattern_infra.testing import models
    from pattern_infra.testing.convert import convert_torch_model, op_counts

    model, args = getattr(models, model_name)()
    rows, programs = {}, {}
    for label, override, pipeline in [
        ("plain", False, ct.PassPipeline.DEFAULT),
        ("coremltools", False, compressing_pipeline(compression)),
        ("ours", True, compressing_pipeline(compression)),
    ]:
        mlmodel = convert_torch_model(
            model, args, override=override, minimum_deployment_target=ct.target.iOS18, pass_pipeline=pipeline
        )
        path = tmp_path / f"{label}.mlpackage"
        mlmodel.save(str(path))
        programs[label] = mlmodel._mil_program
        counts = op_counts(mlmodel._mil_program)
        rows[label] = (
            sum(n for t, n in counts.items() if t != "const"),
            counts.get("batch_norm", 0),
            (path / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size,
            {t: n for t, n in counts.items() if t.startswith("constexpr_")},
        )
    print(f"\n{model_name} {compression}: label, ops (no const), batch_norm, weight.bin bytes, constexpr ops")
    for label, row in rows.items():
        print(f"  {label:12s} {row}")
    assert rows["ours"][1] == 0 < rows["coremltools"][1]
    # the folded LUT entries / scales are rounded to fp32 once more than coremltools' batch_norm
    assert_programs_equivalent(programs["coremltools"], programs["ours"], rtol=1e-4, atol=1e-5)
    assert rows["ours"][2] <= rows["coremltools"][2]


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("kind", ["lut_shared", "int8_per_channel"])
def test_conv_transpose_channels_of_a_compressed_weight(kind, groups):
    """``conv_transpose``'s weight is ``[Cin, Cout/groups, k...]``: the factors land on the right
    channels (axis 1, per group)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, C_IN, 5, 5))], opset_version=ct.target.iOS18)
    def prog(x):
        weight = compressed(kind, (C_IN, C_OUT // groups, K, K))
        conv = mb.conv_transpose(x=x, weight=weight, groups=groups)
        return mb.batch_norm(
            x=conv,
            mean=dyadic(C_OUT),
            variance=np.full(C_OUT, 3.75, np.float32),
            gamma=dyadic(C_OUT),
            epsilon=0.25,
        )

    ours = cleaned(run_pass("common::fuse_conv_batchnorm", prog))
    assert [t for t in op_types(ours) if not t.startswith("constexpr_")] == ["conv_transpose"]
    assert_programs_equivalent(prog, ours)
