"""Tests of the numpy reference evaluator (``pattern_infra.verification.evaluator``).

Every op family is checked against an independent computation: numpy in float64 for elementwise,
shape and indexing ops, torch (CPU, float64) for convolutions, pooling, normalizations, gelu modes,
softmax and attention. Inputs are float32 (the program's dtype) and the oracle runs on their exact
float64 values, so the default tolerance is 1e-12; where torch accumulates in a different order the
tolerance is 1e-10.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import coremltools as ct
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

from pattern_infra.verification.errors import UnsupportedOpError
from pattern_infra.verification.evaluator import (
    EvaluationError,
    OpContext,
    evaluate,
    register_op_semantics,
    supported_op_types,
    unregister_op_semantics,
)

RNG = np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _reseed_rng(request: pytest.FixtureRequest) -> None:
    """Each test draws the same numbers whichever tests ran before it (-k, reordering)."""
    RNG.bit_generator.state = np.random.default_rng(
        zlib.crc32(request.node.nodeid.encode())
    ).bit_generator.state


_BUILTIN = {
    np.dtype(np.float32): types.fp32,
    np.dtype(np.float16): types.fp16,
    np.dtype(np.int32): types.int32,
    np.dtype(np.bool_): types.bool,
}


def _randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _t(array: np.ndarray) -> torch.Tensor:
    """The exact float64 value of a float32 test input, as a torch tensor."""
    return torch.from_numpy(np.asarray(array, dtype=np.float64))


def _build(fn: Callable[..., Any], inputs: Sequence[np.ndarray], opset: Any = None) -> Any:
    specs = [mb.TensorSpec(shape=a.shape, dtype=_BUILTIN[a.dtype]) for a in inputs]
    return mb.program(input_specs=specs, opset_version=opset)(fn)


def assert_evaluates_to(
    fn: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    expected: Any,
    *,
    opset: Any = None,
    rtol: float = 1e-12,
    atol: float = 1e-12,
    precision: str = "float64",
) -> list[np.ndarray]:
    """Build ``fn`` as an ``mb.program`` over ``inputs``, evaluate it, compare every output."""
    prog = _build(fn, inputs, opset)
    names = list(prog.functions["main"].inputs)
    outputs = list(evaluate(prog, dict(zip(names, inputs)), precision=precision).values())
    wanted = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    assert len(outputs) == len(wanted)
    for got, want in zip(outputs, wanted):
        want = want.numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return outputs


# ----------------------------------------------------------------------------------------------
# Elementwise
# ----------------------------------------------------------------------------------------------

UNARY_CASES = [
    ("abs", np.abs, (-3, 3)),
    ("acos", np.arccos, (-0.9, 0.9)),
    ("asin", np.arcsin, (-0.9, 0.9)),
    ("atan", np.arctan, (-3, 3)),
    ("atanh", np.arctanh, (-0.9, 0.9)),
    ("ceil", np.ceil, (-3, 3)),
    ("cos", np.cos, (-3, 3)),
    ("cosh", np.cosh, (-3, 3)),
    ("erf", lambda x: torch.special.erf(_t(x)).numpy(), (-3, 3)),
    ("exp", np.exp, (-3, 3)),
    ("exp2", np.exp2, (-3, 3)),
    ("floor", np.floor, (-3, 3)),
    ("round", lambda x: torch.round(_t(x)).numpy(), (-3, 3)),
    ("sign", np.sign, (-3, 3)),
    ("sin", np.sin, (-3, 3)),
    ("sinh", np.sinh, (-3, 3)),
    ("sqrt", np.sqrt, (0.01, 3)),
    ("square", np.square, (-3, 3)),
    ("tan", np.tan, (-1.2, 1.2)),
    ("tanh", np.tanh, (-3, 3)),
    ("relu", lambda x: F.relu(_t(x)).numpy(), (-3, 3)),
    ("relu6", lambda x: F.relu6(_t(x)).numpy(), (-8, 8)),
    ("sigmoid", lambda x: torch.sigmoid(_t(x)).numpy(), (-8, 8)),
    ("silu", lambda x: F.silu(_t(x)).numpy(), (-8, 8)),
    ("softplus", lambda x: F.softplus(_t(x)).numpy(), (-8, 8)),
    ("softsign", lambda x: F.softsign(_t(x)).numpy(), (-8, 8)),
]


@pytest.mark.parametrize("op_type, oracle, domain", UNARY_CASES, ids=[c[0] for c in UNARY_CASES])
def test_unary(op_type: str, oracle: Callable[[np.ndarray], np.ndarray], domain: tuple[float, float]) -> None:
    x = RNG.uniform(*domain, size=(3, 7)).astype(np.float32)
    if op_type == "round":
        x[0, :4] = [0.5, 1.5, -0.5, 2.5]  # half-way cases round to even
    assert_evaluates_to(lambda x: getattr(mb, op_type)(x=x), [x], oracle(x.astype(np.float64)), rtol=1e-10)


@pytest.mark.parametrize(
    "op_type, epsilon, oracle",
    [
        ("inverse", None, lambda x, e: 1 / (x + e)),
        ("inverse", 0.5, lambda x, e: 1 / (x + e)),
        ("rsqrt", None, lambda x, e: 1 / np.sqrt(x + e)),
        ("rsqrt", 0.25, lambda x, e: 1 / np.sqrt(x + e)),
        ("log", None, lambda x, e: np.log(x + e)),
        ("log", 2.0, lambda x, e: np.log(x + e)),
    ],
)
def test_unary_with_epsilon(op_type: str, epsilon: float | None, oracle: Callable[..., np.ndarray]) -> None:
    defaults = {"inverse": 1e-4, "rsqrt": 1e-12, "log": 1e-45}
    x = RNG.uniform(0.1, 3, size=(2, 5)).astype(np.float32)
    kwargs = {} if epsilon is None else {"epsilon": epsilon}
    # The definition's default is a constant of x's dtype (fp32), hence float32(eps) in the oracle.
    eps = float(np.float32(defaults[op_type] if epsilon is None else epsilon))
    assert_evaluates_to(lambda x: getattr(mb, op_type)(x=x, **kwargs), [x], oracle(x.astype(np.float64), eps))


def test_epsilon_actually_matters() -> None:
    x = np.zeros((1, 2), dtype=np.float32)
    assert_evaluates_to(lambda x: mb.inverse(x=x, epsilon=0.5), [x], np.full((1, 2), 2.0))


BINARY_CASES = [
    ("add", np.add),
    ("sub", np.subtract),
    ("mul", np.multiply),
    ("real_div", np.divide),
    ("floor_div", np.floor_divide),
    ("mod", np.mod),
    ("maximum", np.maximum),
    ("minimum", np.minimum),
    ("pow", np.power),
    ("equal", np.equal),
    ("not_equal", np.not_equal),
    ("less", np.less),
    ("less_equal", np.less_equal),
    ("greater", np.greater),
    ("greater_equal", np.greater_equal),
]


@pytest.mark.parametrize("op_type, oracle", BINARY_CASES, ids=[c[0] for c in BINARY_CASES])
@pytest.mark.parametrize("shape_x, shape_y", [((2, 3, 4), (3, 1)), ((4,), (2, 3, 4)), ((2, 1, 4), (1, 3, 1))])
def test_binary_broadcasting(
    op_type: str, oracle: Callable[..., np.ndarray], shape_x: tuple, shape_y: tuple
) -> None:
    x, y = _randn(*shape_x), _randn(*shape_y)
    if op_type == "pow":
        x = np.abs(x) + 0.1
    if op_type in ("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"):
        x, y = np.round(x), np.round(y)  # small integers: plenty of ties
    expected = oracle(x.astype(np.float64), y.astype(np.float64))
    assert_evaluates_to(lambda x, y: getattr(mb, op_type)(x=x, y=y), [x, y], expected)


@pytest.mark.parametrize(
    "op_type, oracle",
    [("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor)],
)
def test_logical(op_type: str, oracle: Callable[..., np.ndarray]) -> None:
    x, y = RNG.random((3, 4)) < 0.5, RNG.random((1, 4)) < 0.5
    outputs = assert_evaluates_to(lambda x, y: getattr(mb, op_type)(x=x, y=y), [x, y], oracle(x, y))
    assert outputs[0].dtype == np.bool_
    assert_evaluates_to(lambda x: mb.logical_not(x=x), [x], ~x)


def test_integer_arithmetic_keeps_python_semantics() -> None:
    x = np.array([-7, -3, 3, 7], dtype=np.int32)
    y = np.array([2, 2, -2, 3], dtype=np.int32)
    outputs = assert_evaluates_to(
        lambda x, y: (mb.floor_div(x=x, y=y), mb.mod(x=x, y=y), mb.add(x=x, y=y)),
        [x, y],
        [np.floor_divide(x, y), np.mod(x, y), x + y],
    )
    assert all(o.dtype == np.int32 for o in outputs)


def test_select_and_cast() -> None:
    cond = RNG.random((2, 3)) < 0.5
    a, b = _randn(2, 3), _randn(1, 3)
    assert_evaluates_to(lambda c, a, b: mb.select(cond=c, a=a, b=b), [cond, a, b], np.where(cond, a, b))
    x = np.array([[-2.7, -0.2, 0.0, 1.9]], dtype=np.float32)
    outputs = assert_evaluates_to(
        lambda x: (mb.cast(x=x, dtype="int32"), mb.cast(x=x, dtype="bool"), mb.cast(x=x, dtype="fp16")),
        [x],
        [np.array([[-2, 0, 0, 1]]), x != 0, x.astype(np.float64)],
    )
    assert [o.dtype for o in outputs] == [np.int32, np.bool_, np.float64]


# ----------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------

ACTIVATION_CASES = [
    ("leaky_relu", dict(alpha=0.2), lambda t, p: F.leaky_relu(t, p["alpha"])),
    ("elu", dict(alpha=0.7), lambda t, p: F.elu(t, alpha=p["alpha"])),
    ("thresholded_relu", dict(alpha=0.3), lambda t, p: torch.where(t >= p["alpha"], t, torch.zeros_like(t))),
    (
        "clamped_relu",
        dict(alpha=0.1, beta=1.5),
        lambda t, p: torch.clamp(F.leaky_relu(t, p["alpha"]), max=p["beta"]),
    ),
    # beta < 0: the docstring's min(beta, .) on both sides (coremltools' value inference differs).
    (
        "clamped_relu",
        dict(alpha=0.1, beta=-0.25),
        lambda t, p: torch.clamp(F.leaky_relu(t, p["alpha"]), max=p["beta"]),
    ),
    ("linear_activation", dict(alpha=1.5, beta=-0.5), lambda t, p: p["alpha"] * t + p["beta"]),
    ("scaled_tanh", dict(alpha=1.5, beta=0.5), lambda t, p: p["alpha"] * torch.tanh(p["beta"] * t)),
    ("sigmoid_hard", dict(alpha=0.2, beta=0.5), lambda t, p: torch.clamp(p["alpha"] * t + p["beta"], 0, 1)),
    ("clip", dict(alpha=-0.5, beta=0.75), lambda t, p: torch.clamp(t, p["alpha"], p["beta"])),
    ("threshold", dict(alpha=0.25), lambda t, p: torch.clamp(t, min=p["alpha"])),
]


@pytest.mark.parametrize("op_type, params, oracle", ACTIVATION_CASES, ids=[c[0] for c in ACTIVATION_CASES])
def test_parametric_activation(op_type: str, params: dict, oracle: Callable[..., torch.Tensor]) -> None:
    x = (RNG.standard_normal((2, 3, 5)) * 2).astype(np.float32)
    # Parameters are fp32 constants: the oracle uses the same float32-rounded values.
    rounded = {k: float(np.float32(v)) for k, v in params.items()}
    assert_evaluates_to(lambda x: getattr(mb, op_type)(x=x, **params), [x], oracle(_t(x), rounded))


def test_prelu_and_softplus_parametric_are_per_channel() -> None:
    x = _randn(2, 3, 4, 5)
    alpha = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    beta = np.array([1.0, 2.0, 0.5], dtype=np.float32)
    assert_evaluates_to(lambda x: mb.prelu(x=x, alpha=alpha), [x], F.prelu(_t(x), _t(alpha)))
    expected = _t(alpha).view(1, 3, 1, 1) * torch.log1p(torch.exp(_t(beta).view(1, 3, 1, 1) * _t(x)))
    assert_evaluates_to(lambda x: mb.softplus_parametric(x=x, alpha=alpha, beta=beta), [x], expected)


@pytest.mark.parametrize(
    "mode, oracle",
    [
        ("EXACT", lambda t: F.gelu(t)),
        ("TANH_APPROXIMATION", lambda t: F.gelu(t, approximate="tanh")),
        ("SIGMOID_APPROXIMATION", lambda t: t * torch.sigmoid(1.702 * t)),
    ],
)
def test_gelu_modes_match_torch(mode: str, oracle: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x = (RNG.standard_normal((4, 33)) * 3).astype(np.float32)
    assert_evaluates_to(lambda x: mb.gelu(x=x, mode=mode), [x], oracle(_t(x)), rtol=1e-12, atol=1e-14)


def test_gelu_default_mode_is_exact() -> None:
    x = _randn(3, 4)
    assert_evaluates_to(lambda x: mb.gelu(x=x), [x], F.gelu(_t(x)), atol=1e-14)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax(axis: int) -> None:
    x = (_randn(3, 4, 5) * 10).astype(np.float32)
    assert_evaluates_to(lambda x: mb.softmax(x=x, axis=axis), [x], torch.softmax(_t(x), dim=axis), atol=1e-15)


def test_softmax_default_axis_is_last() -> None:
    x = _randn(2, 6)
    assert_evaluates_to(lambda x: mb.softmax(x=x), [x], torch.softmax(_t(x), dim=-1), atol=1e-15)


# ----------------------------------------------------------------------------------------------
# Reductions and linear algebra
# ----------------------------------------------------------------------------------------------

REDUCTIONS = {
    "reduce_sum": lambda x, a, k: np.sum(x, axis=a, keepdims=k),
    "reduce_mean": lambda x, a, k: np.mean(x, axis=a, keepdims=k),
    "reduce_prod": lambda x, a, k: np.prod(x, axis=a, keepdims=k),
    "reduce_max": lambda x, a, k: np.max(x, axis=a, keepdims=k),
    "reduce_min": lambda x, a, k: np.min(x, axis=a, keepdims=k),
    "reduce_l1_norm": lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k),
    "reduce_l2_norm": lambda x, a, k: np.sqrt(np.sum(x * x, axis=a, keepdims=k)),
    "reduce_sum_square": lambda x, a, k: np.sum(x * x, axis=a, keepdims=k),
    "reduce_log_sum_exp": lambda x, a, k: torch.logsumexp(
        _t(x), dim=a if a is not None else tuple(range(x.ndim)), keepdim=k
    ).numpy(),
}


@pytest.mark.parametrize("op_type", sorted(REDUCTIONS))
@pytest.mark.parametrize("axes, keep_dims", [(None, False), (None, True), ((1,), False), ((0, -1), True)])
def test_reductions(op_type: str, axes: tuple | None, keep_dims: bool) -> None:
    x = _randn(2, 3, 4)
    kwargs = {"keep_dims": keep_dims} | ({} if axes is None else {"axes": list(axes)})
    expected = REDUCTIONS[op_type](x.astype(np.float64), axes, keep_dims)
    assert_evaluates_to(lambda x: getattr(mb, op_type)(x=x, **kwargs), [x], expected, rtol=1e-12)


def test_reduce_log_sum() -> None:
    x = RNG.uniform(0.5, 2, (2, 3)).astype(np.float32)
    assert_evaluates_to(lambda x: mb.reduce_log_sum(x=x, axes=[1]), [x], np.log(x.astype(np.float64).sum(1)))


@pytest.mark.parametrize("op_type, oracle", [("reduce_argmax", np.argmax), ("reduce_argmin", np.argmin)])
@pytest.mark.parametrize("axis, keep_dims", [(-1, False), (0, True), (1, False)])
def test_reduce_arg(op_type: str, oracle: Callable[..., np.ndarray], axis: int, keep_dims: bool) -> None:
    x = _randn(3, 4, 5)
    outputs = assert_evaluates_to(
        lambda x: getattr(mb, op_type)(x=x, axis=axis, keep_dims=keep_dims),
        [x],
        oracle(x, axis=axis, keepdims=keep_dims),
    )
    assert outputs[0].dtype == np.int32


@pytest.mark.parametrize("tx, ty", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_transposes_and_broadcast(tx: bool, ty: bool) -> None:
    x = _randn(2, 1, 4, 3) if tx else _randn(2, 1, 3, 4)
    y = _randn(5, 6, 4) if ty else _randn(5, 4, 6)
    xt = np.swapaxes(x, -1, -2) if tx else x
    yt = np.swapaxes(y, -1, -2) if ty else y
    expected = np.matmul(xt.astype(np.float64), yt.astype(np.float64))
    assert_evaluates_to(lambda x, y: mb.matmul(x=x, y=y, transpose_x=tx, transpose_y=ty), [x, y], expected)


def test_matmul_with_vectors() -> None:
    # (A 1-D y, which the definition also describes, crashes coremltools' type inference.)
    v, m = _randn(4), _randn(4, 2)
    assert_evaluates_to(lambda v, m: mb.matmul(x=v, y=m), [v, m], v.astype(np.float64) @ m.astype(np.float64))


@pytest.mark.parametrize(
    "build, inputs, declared",
    [
        # matmul of a vector with a batch of matrices: coremltools drops the batch dimension
        # instead of the prepended one, declaring (1, 2) where the definition says (3, 2).
        (lambda v, m: mb.matmul(x=v, y=m), [_randn(4), _randn(3, 4, 2)], r"\(1, 2\)"),
        # slice_by_size with a negative begin and size -1: declared as shape - begin = 3 + 2.
        (lambda x: mb.slice_by_size(x=x, begin=[0, -2], size=[-1, -1]), [_randn(2, 3)], r"\(2, 5\)"),
    ],
    ids=["matmul_vector_batch", "slice_by_size_negative_begin"],
)
def test_shape_check_exposes_coremltools_type_inference(
    build: Callable[..., Any], inputs: list, declared: str
) -> None:
    prog = _build(build, inputs)
    names = list(prog.functions["main"].inputs)
    with pytest.raises(EvaluationError, match=f"but the program declares {declared}"):
        evaluate(prog, dict(zip(names, inputs)))


def test_linear_and_einsum() -> None:
    x = _randn(2, 3, 4)
    w, b = _randn(5, 4), _randn(5)
    assert_evaluates_to(lambda x: mb.linear(x=x, weight=w, bias=b), [x], F.linear(_t(x), _t(w), _t(b)))
    assert_evaluates_to(lambda x: mb.linear(x=x, weight=w), [x], F.linear(_t(x), _t(w)))
    a, c = _randn(2, 3, 1, 4), _randn(2, 4, 5, 6)
    expected = np.einsum(
        "nchw,nwhu->nchu", np.broadcast_to(a, (2, 3, 5, 4)).astype(np.float64), c.astype(np.float64)
    )
    assert_evaluates_to(lambda a, c: mb.einsum(values=(a, c), equation="nchw,nwhu->nchu"), [a, c], expected)


# ----------------------------------------------------------------------------------------------
# Convolution and pooling (torch oracle)
# ----------------------------------------------------------------------------------------------


def _tf_same_pads(
    sizes: Sequence[int], kernels: Sequence[int], strides: Sequence[int], lower: bool
) -> list[int]:
    """TensorFlow's SAME padding (extra element after; before with same_lower), as torch pad list."""
    pads: list[int] = []
    for size, k, s in reversed(list(zip(sizes, kernels, strides))):
        total = max(0, (math.ceil(size / s) - 1) * s + k - size)
        small = total // 2
        pads += [total - small, small] if lower else [small, total - small]
    return pads


CONV_CASES = [
    # spatial sizes, C_in, C_out, kernel, strides, dilations, groups, pad_type, pad
    ((9,), 4, 6, (3,), (1,), (1,), 1, "valid", None),
    ((10,), 4, 4, (4,), (2,), (1,), 2, "same", None),
    ((7, 8), 3, 5, (3, 2), (1, 1), (1, 1), 1, "same", None),
    ((7, 8), 3, 6, (3, 3), (2, 1), (1, 2), 3, "custom", (1, 0, 2, 1)),
    ((8, 9), 4, 4, (2, 4), (2, 3), (1, 1), 4, "same_lower", None),
    ((6, 7), 2, 4, (3, 3), (1, 1), (2, 2), 1, "valid", None),
    ((5, 6, 4), 2, 3, (3, 2, 2), (1, 2, 1), (1, 1, 2), 1, "custom", (1, 1, 0, 1, 1, 0)),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=[f"{c[7]}-{len(c[0])}d-g{c[6]}" for c in CONV_CASES])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_matches_torch(case: tuple, with_bias: bool) -> None:
    sizes, c_in, c_out, kernel, strides, dilations, groups, pad_type, pad = case
    x = _randn(2, c_in, *sizes)
    w = _randn(c_out, c_in // groups, *kernel)
    b = _randn(c_out)
    rank = len(sizes)
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if pad_type == "custom":
        torch_pad = [p for i in reversed(range(rank)) for p in (pad[2 * i], pad[2 * i + 1])]
    elif pad_type == "valid":
        torch_pad = [0] * 2 * rank
    else:
        torch_pad = _tf_same_pads(sizes, effective, strides, lower=pad_type == "same_lower")
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]
    expected = conv(
        F.pad(_t(x), torch_pad),
        _t(w),
        _t(b) if with_bias else None,
        stride=strides,
        dilation=dilations,
        groups=groups,
    )
    kwargs = dict(
        weight=w, strides=list(strides), dilations=list(dilations), groups=groups, pad_type=pad_type
    )
    if pad is not None:
        kwargs["pad"] = list(pad)
    if with_bias:
        kwargs["bias"] = b
    assert_evaluates_to(
        lambda x: mb.conv(x=x, **kwargs), [x], expected, opset=ct.target.iOS17, rtol=1e-10, atol=1e-10
    )


def test_conv_same_with_even_kernel_matches_torch_same() -> None:
    # torch's padding="same" pads the odd element after: the definition's docstring formula says
    # before, but frontends map torch's "same" to MIL "same".
    x, w = _randn(1, 2, 9, 8), _randn(3, 2, 4, 2)
    expected = F.conv2d(_t(x), _t(w), padding="same")
    assert_evaluates_to(
        lambda x: mb.conv(x=x, weight=w, pad_type="same"), [x], expected, rtol=1e-10, atol=1e-10
    )


def test_conv_with_dynamic_weight() -> None:
    x, w = _randn(1, 2, 6, 6), _randn(4, 2, 3, 3)
    assert_evaluates_to(
        lambda x, w: mb.conv(x=x, weight=w), [x, w], F.conv2d(_t(x), _t(w)), rtol=1e-10, atol=1e-10
    )


CONV_TRANSPOSE_CASES = [
    # spatial sizes, C_in, C_out, kernel, strides, dilations, groups, torch padding, output_padding
    ((5,), 4, 6, (3,), (2,), (1,), 2, (1,), (1,)),
    ((4, 5), 2, 3, (3, 3), (2, 2), (1, 1), 1, (1, 1), (0, 1)),
    ((4, 5), 4, 4, (2, 3), (1, 2), (2, 1), 2, (0, 2), (0, 0)),
    ((3, 4, 3), 2, 2, (2, 3, 2), (2, 1, 2), (1, 1, 1), 1, (0, 1, 0), (1, 0, 0)),
]


@pytest.mark.parametrize(
    "case", CONV_TRANSPOSE_CASES, ids=[f"{len(c[0])}d-g{c[6]}" for c in CONV_TRANSPOSE_CASES]
)
def test_conv_transpose_matches_torch(case: tuple) -> None:
    sizes, c_in, c_out, kernel, strides, dilations, groups, padding, output_padding = case
    x = _randn(2, c_in, *sizes)
    w = _randn(c_in, c_out // groups, *kernel)  # layout [C_in, C_out / groups, *K]
    b = _randn(c_out)
    conv_t = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[len(sizes)]
    expected = conv_t(
        _t(x),
        _t(w),
        _t(b),
        stride=strides,
        padding=padding,
        output_padding=output_padding,
        groups=groups,
        dilation=dilations,
    )
    kwargs = dict(
        weight=w,
        bias=b,
        strides=list(strides),
        dilations=list(dilations),
        groups=groups,
        pad_type="custom",
        pad=[p for p in padding for _ in range(2)],
    )
    if any(output_padding):
        kwargs["output_shape"] = list(expected.shape)
    assert_evaluates_to(lambda x: mb.conv_transpose(x=x, **kwargs), [x], expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pad_type, torch_padding", [("valid", 0), ("same", 1)])
def test_conv_transpose_pad_types(pad_type: str, torch_padding: int) -> None:
    # kernel 4, stride 2: "same" gives D * stride outputs, cropping one element on each side.
    x, w = _randn(1, 3, 4, 5), _randn(3, 2, 4, 4)
    expected = F.conv_transpose2d(_t(x), _t(w), stride=2, padding=torch_padding)
    assert_evaluates_to(
        lambda x: mb.conv_transpose(x=x, weight=w, strides=[2, 2], pad_type=pad_type),
        [x],
        expected,
        rtol=1e-10,
        atol=1e-10,
    )


@pytest.mark.parametrize("output_shape", [None, (1, 2, 9, 11)])
def test_conv_transpose_same_with_odd_crop_follows_tensorflow(output_shape: tuple | None) -> None:
    # kernel 3, stride 2: the full output has 2 * D + 1 elements, "same" keeps 2 * D (or output_shape).
    # TensorFlow's conv2d_transpose SAME crops (full - out) // 2 before and the rest after.
    x, w = _randn(1, 3, 4, 5), _randn(3, 2, 3, 3)
    full = F.conv_transpose2d(_t(x), _t(w), stride=2).numpy()
    out_h, out_w = (8, 10) if output_shape is None else output_shape[2:]
    top, left = (full.shape[2] - out_h) // 2, (full.shape[3] - out_w) // 2
    expected = full[:, :, top : top + out_h, left : left + out_w]
    kwargs = {} if output_shape is None else {"output_shape": list(output_shape)}
    assert_evaluates_to(
        lambda x: mb.conv_transpose(x=x, weight=w, strides=[2, 2], pad_type="same", **kwargs),
        [x],
        expected,
        rtol=1e-10,
        atol=1e-10,
    )


POOL_CASES = [
    # spatial sizes, kernel, strides, pad_type, pad, ceil_mode
    ((9,), (3,), (2,), "valid", None, False),
    ((7, 8), (3, 2), (2, 2), "custom", (1, 1, 1, 1), False),
    ((7, 8), (3, 3), (2, 2), "custom", (1, 1, 1, 1), True),
    ((8, 7), (2, 2), (2, 2), "valid", None, True),
    ((5, 5), (3, 3), (3, 3), "custom", (1, 1, 1, 1), True),  # last ceil window would start in the padding
    ((7, 8), (3, 2), (2, 3), "same", None, False),
    ((7, 8), (2, 2), (2, 2), "same_lower", None, False),
    ((4, 5, 6), (2, 3, 2), (1, 2, 2), "custom", (1, 1, 0, 0, 1, 1), False),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=[f"{c[3]}-{len(c[0])}d-ceil{c[5]}" for c in POOL_CASES])
@pytest.mark.parametrize("kind", ["max", "avg_include_pad", "avg_exclude_pad"])
def test_pooling_matches_torch(case: tuple, kind: str) -> None:
    sizes, kernel, strides, pad_type, pad, ceil_mode = case
    rank = len(sizes)
    x = _randn(2, 3, *sizes)
    kwargs = dict(kernel_sizes=list(kernel), strides=list(strides), pad_type=pad_type, ceil_mode=ceil_mode)
    if pad is not None:
        kwargs["pad"] = list(pad)
    t = _t(x)
    exclude = kind == "avg_exclude_pad"
    if pad_type.startswith("same"):
        pads = _tf_same_pads(sizes, kernel, strides, lower=pad_type == "same_lower")
        if kind == "max":
            expected = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[rank](
                F.pad(t, pads, value=-math.inf), kernel, strides
            )
        else:
            avg = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[rank]
            summed = avg(F.pad(t, pads), kernel, strides) * math.prod(kernel)
            counts = avg(F.pad(torch.ones_like(t), pads, value=0.0 if exclude else 1.0), kernel, strides)
            counts = counts * math.prod(kernel)
            expected = summed / counts
    else:
        padding = [0] * rank if pad is None else [pad[2 * i] for i in range(rank)]
        if kind == "max":
            expected = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[rank](
                t, kernel, strides, padding=padding, ceil_mode=ceil_mode
            )
        else:
            expected = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[rank](
                t, kernel, strides, padding=padding, ceil_mode=ceil_mode, count_include_pad=not exclude
            )
    if kind == "max":
        fn = lambda x: mb.max_pool(x=x, **kwargs)  # noqa: E731
    else:
        fn = lambda x: mb.avg_pool(x=x, exclude_padding_from_average=exclude, **kwargs)  # noqa: E731
    assert_evaluates_to(fn, [x], expected, opset=ct.target.iOS17, rtol=1e-12, atol=1e-12)


def test_l2_pool_matches_torch_lp_pool() -> None:
    x = _randn(2, 3, 6, 7)
    expected = F.lp_pool2d(_t(x), 2, (2, 3), stride=(2, 2))
    assert_evaluates_to(
        lambda x: mb.l2_pool(x=x, kernel_sizes=[2, 3], strides=[2, 2], pad_type="valid"),
        [x],
        expected,
        rtol=1e-12,
    )


# ----------------------------------------------------------------------------------------------
# Normalization (torch oracle)
# ----------------------------------------------------------------------------------------------


def test_batch_norm() -> None:
    x = _randn(2, 3, 4, 5)
    mean, var, gamma, beta = _randn(3), np.abs(_randn(3)) + 0.5, _randn(3), _randn(3)
    expected = F.batch_norm(_t(x), _t(mean), _t(var), _t(gamma), _t(beta), eps=float(np.float32(1e-3)))
    assert_evaluates_to(
        lambda x: mb.batch_norm(x=x, mean=mean, variance=var, gamma=gamma, beta=beta, epsilon=1e-3),
        [x],
        expected,
        rtol=1e-12,
    )
    no_affine = F.batch_norm(_t(x), _t(mean), _t(var), eps=float(np.float32(1e-5)))
    assert_evaluates_to(lambda x: mb.batch_norm(x=x, mean=mean, variance=var), [x], no_affine, rtol=1e-12)


@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 3, 4, 5)])
def test_instance_norm(shape: tuple) -> None:
    x, gamma, beta = _randn(*shape), _randn(3), _randn(3)
    expected = F.instance_norm(_t(x), weight=_t(gamma), bias=_t(beta), eps=float(np.float32(1e-5)))
    assert_evaluates_to(
        lambda x: mb.instance_norm(x=x, gamma=gamma, beta=beta), [x], expected, rtol=1e-10, atol=1e-12
    )


def test_layer_norm_trailing_axes_match_torch() -> None:
    x, gamma, beta = _randn(2, 3, 4, 5), _randn(4, 5), _randn(4, 5)
    expected = F.layer_norm(_t(x), (4, 5), _t(gamma), _t(beta), eps=float(np.float32(1e-4)))
    assert_evaluates_to(
        lambda x: mb.layer_norm(x=x, axes=[-2, -1], gamma=gamma, beta=beta, epsilon=1e-4),
        [x],
        expected,
        rtol=1e-10,
        atol=1e-12,
    )


def test_layer_norm_without_affine_and_non_trailing_axes() -> None:
    x = _randn(2, 3, 4).astype(np.float64)
    mean = x.mean(axis=(0, 2), keepdims=True)
    expected = (x - mean) / np.sqrt(
        ((x - mean) ** 2).mean(axis=(0, 2), keepdims=True) + float(np.float32(1e-5))
    )
    assert_evaluates_to(
        lambda x: mb.layer_norm(x=x, axes=[2, 0]), [x.astype(np.float32)], expected, rtol=1e-10
    )
    # (coremltools cannot build layer_norm without axes: its default range(rank) is not a const.)
    all_axes = (x - x.mean()) / np.sqrt(x.var() + float(np.float32(1e-5)))
    assert_evaluates_to(
        lambda x: mb.layer_norm(x=x, axes=[0, 1, 2]), [x.astype(np.float32)], all_axes, rtol=1e-10
    )


def test_l2_norm_normalizes_the_last_three_axes() -> None:
    x = _randn(2, 3, 4, 5)
    d = x.astype(np.float64)
    eps = float(np.float32(1e-6))
    expected = d / np.sqrt((d**2).sum(axis=(1, 2, 3), keepdims=True) + eps)
    assert_evaluates_to(lambda x: mb.l2_norm(x=x), [x], expected)


def test_local_response_norm_matches_torch() -> None:
    x = _randn(2, 7, 4, 5)
    expected = F.local_response_norm(_t(x), size=5, alpha=float(np.float32(1e-2)), beta=0.75, k=2.0)
    assert_evaluates_to(
        lambda x: mb.local_response_norm(x=x, size=5, alpha=1e-2, beta=0.75, k=2.0), [x], expected, rtol=1e-10
    )


# ----------------------------------------------------------------------------------------------
# Shape manipulation, indexing, misc tensor ops (numpy / torch oracle)
# ----------------------------------------------------------------------------------------------

X234 = np.arange(24, dtype=np.float32).reshape(2, 3, 4)

TENSOR_CASES = [
    ("reshape_neg_one", lambda x: mb.reshape(x=x, shape=[-1, 4]), lambda x: x.reshape(-1, 4)),
    ("reshape_zero", lambda x: mb.reshape(x=x, shape=[0, -1, 2]), lambda x: x.reshape(2, -1, 2)),
    ("transpose", lambda x: mb.transpose(x=x, perm=[2, 0, 1]), lambda x: x.transpose(2, 0, 1)),
    ("expand_dims", lambda x: mb.expand_dims(x=x, axes=[0, -1]), lambda x: x[None, ..., None]),
    (
        "squeeze_ignores_non_unit",
        lambda x: mb.squeeze(x=mb.expand_dims(x=x, axes=[1]), axes=[0, 1]),
        lambda x: x,
    ),
    ("squeeze_all", lambda x: mb.squeeze(x=mb.expand_dims(x=x, axes=[0, 2])), lambda x: x),
    ("tile", lambda x: mb.tile(x=x, reps=[1, 2, 3]), lambda x: np.tile(x, (1, 2, 3))),
    ("reverse_axes", lambda x: mb.reverse(x=x, axes=[0, 2]), lambda x: x[::-1, :, ::-1]),
    ("reverse_all", lambda x: mb.reverse(x=x), lambda x: x[::-1, ::-1, ::-1]),
    ("flatten2d", lambda x: mb.flatten2d(x=x, axis=2), lambda x: x.reshape(6, 4)),
    ("flatten2d_neg", lambda x: mb.flatten2d(x=x, axis=-1), lambda x: x.reshape(6, 4)),
    ("shape", lambda x: mb.shape(x=x), lambda x: np.array([2, 3, 4])),
    (
        "concat",
        lambda x: mb.concat(values=[x, mb.mul(x=x, y=2.0)], axis=1),
        lambda x: np.concatenate([x, 2 * x], 1),
    ),
    (
        "concat_interleave",
        lambda x: mb.concat(values=[x, mb.mul(x=x, y=2.0)], axis=1, interleave=True),
        lambda x: np.stack([x, 2 * x], 2).reshape(2, 6, 4),
    ),
    ("stack", lambda x: mb.stack(values=[x, mb.mul(x=x, y=-1.0)], axis=-1), lambda x: np.stack([x, -x], -1)),
    ("split_num", lambda x: mb.split(x=x, num_splits=2, axis=-1), lambda x: tuple(np.split(x, 2, -1))),
    ("split_sizes", lambda x: mb.split(x=x, split_sizes=[1, 2], axis=1), lambda x: (x[:, :1], x[:, 1:])),
    (
        "slice_by_index",
        lambda x: mb.slice_by_index(x=x, begin=[1, 0, 3], end=[2, 3, 0], stride=[1, 2, -1]),
        lambda x: x[1:2, 0:3:2, 3:0:-1],
    ),
    (
        "slice_by_index_masks",
        lambda x: mb.slice_by_index(
            x=x,
            begin=[0, 1, -1],
            end=[1, 0, 0],
            begin_mask=[True, False, False],
            end_mask=[False, True, True],
            squeeze_mask=[False, False, True],
        ),
        lambda x: x[:1, 1:, -1],
    ),
    (
        "slice_by_index_neg_stride_masks",
        lambda x: mb.slice_by_index(
            x=x,
            begin=[0, 0, 0],
            end=[0, 0, 0],
            stride=[-1, 1, -2],
            begin_mask=[True] * 3,
            end_mask=[True] * 3,
        ),
        lambda x: x[::-1, :, ::-2],
    ),
    (
        "slice_by_size",
        lambda x: mb.slice_by_size(x=x, begin=[1, 1, 1], size=[1, -1, 2]),
        lambda x: x[1:2, 1:, 1:3],
    ),
    (
        "slice_by_size_negative_begin",
        lambda x: mb.slice_by_size(x=x, begin=[-1, -2, 0], size=[1, 2, -1]),
        lambda x: x[1:2, 1:3, :],
    ),
    ("crop", lambda x: mb.crop(x=x, crop_height=[1, 1], crop_width=[0, 2]), lambda x: x[:, 1:2, 0:2]),
    (
        "band_part",
        lambda x: mb.band_part(x=x, lower=1, upper=0),
        lambda x: np.stack([np.tril(np.triu(m, -1)) for m in x]),
    ),
    ("cumsum", lambda x: mb.cumsum(x=x, axis=2), lambda x: np.cumsum(x, 2)),
    (
        "cumsum_exclusive_reverse",
        lambda x: mb.cumsum(x=x, axis=1, exclusive=True, reverse=True),
        lambda x: np.flip(np.cumsum(np.flip(x, 1), 1), 1) - x,
    ),
    ("fill", lambda x: mb.add(x=x, y=mb.fill(shape=[3, 4], value=2.5)), lambda x: x + 2.5),
    ("range_1d", lambda x: mb.range_1d(start=1.0, end=4.0, step=0.5), lambda x: np.arange(1.0, 4.0, 0.5)),
    ("identity", lambda x: mb.identity(x=x), lambda x: x),
]


@pytest.mark.parametrize("name, build, oracle", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_tensor_ops(name: str, build: Callable[..., Any], oracle: Callable[[np.ndarray], Any]) -> None:
    expected = oracle(X234.astype(np.float64))
    assert_evaluates_to(
        build, [X234], list(expected) if isinstance(expected, tuple) else expected, opset=ct.target.iOS17
    )


def test_concat_interleave_is_computed_not_read_from_coremltools_value_inference() -> None:
    # coremltools folds concat(interleave=True) of constants as a plain concat (its value inference
    # ignores `interleave`); the evaluator computes the op instead of trusting var.val.
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    b = np.array([[5.0, 6.0], [7.0, 8.0]], dtype=np.float32)
    x = np.zeros((1,), dtype=np.float32)
    outputs = assert_evaluates_to(
        lambda x: mb.add(x=mb.concat(values=[a, b], axis=0, interleave=True), y=x),
        [x],
        np.array([[1, 2], [5, 6], [3, 4], [7, 8]], dtype=np.float64),
    )
    assert outputs[0].shape == (4, 2)


INDEX_CASES = [
    (
        "gather",
        lambda x: mb.gather(x=x, indices=np.array([[2, -1], [0, 1]], dtype=np.int32), axis=1),
        lambda x: x[:, [[2, 2], [0, 1]]],
    ),
    (
        "gather_batch_dims",
        lambda x: mb.gather(x=x, indices=np.array([[1, 3], [0, 0]], dtype=np.int32), axis=2, batch_dims=1),
        lambda x: np.stack([x[0][:, [1, 3]], x[1][:, [0, 0]]]),
    ),
    (
        "gather_along_axis",
        lambda x: mb.gather_along_axis(x=x, indices=np.array([[[1], [0], [-1]]] * 2, dtype=np.int32), axis=2),
        lambda x: np.take_along_axis(x, np.array([[[1], [0], [3]]] * 2), 2),
    ),
    (
        "gather_nd",
        lambda x: mb.gather_nd(x=x, indices=np.array([[1, 2], [0, -1]], dtype=np.int32)),
        lambda x: np.stack([x[1, 2], x[0, 2]]),
    ),
    (
        "gather_nd_batch_dims",
        lambda x: mb.gather_nd(x=x, indices=np.array([[[2, 3]], [[0, 1]]], dtype=np.int32), batch_dims=1),
        lambda x: np.array([[x[0, 2, 3]], [x[1, 0, 1]]]),
    ),
    (
        "one_hot",
        lambda x: mb.one_hot(
            indices=np.array([0, 2, 5], dtype=np.int32),
            one_hot_vector_size=4,
            axis=0,
            on_value=2.0,
            off_value=-1.0,
        ),
        lambda x: np.where(np.array([0, 2, 5])[None, :] == np.arange(4)[:, None], 2.0, -1.0),
    ),
    (
        "topk",
        lambda x: mb.topk(x=x, k=2, axis=1),
        lambda x: (np.sort(x, 1)[:, ::-1][:, :2], np.argsort(-x, 1, kind="stable")[:, :2]),
    ),
    (
        "topk_ascending",
        lambda x: mb.topk(x=x, k=3, axis=-1, ascending=True),
        lambda x: (np.sort(x, -1)[..., :3], np.argsort(x, -1, kind="stable")[..., :3]),
    ),
    (
        "scatter_add",
        lambda x: mb.scatter(
            data=x,
            indices=np.array([2, 0, 2], dtype=np.int32),
            updates=np.ones((2, 3, 4), dtype=np.float32),
            axis=1,
            mode="add",
        ),
        lambda x: x + np.array([1, 0, 2])[None, :, None],
    ),
    (
        "scatter_update",
        lambda x: mb.scatter(
            data=x,
            indices=np.array([1], dtype=np.int32),
            updates=np.zeros((2, 1, 4), dtype=np.float32),
            axis=1,
            mode="update",
        ),
        lambda x: np.concatenate([x[:, :1], np.zeros((2, 1, 4)), x[:, 2:]], 1),
    ),
    (
        "scatter_along_axis_max",
        lambda x: mb.scatter_along_axis(
            data=x,
            indices=np.zeros((2, 3, 1), dtype=np.int32),
            updates=np.full((2, 3, 1), 10.0, dtype=np.float32),
            axis=2,
            mode="max",
        ),
        lambda x: np.concatenate([np.maximum(x[..., :1], 10.0), x[..., 1:]], -1),
    ),
    (
        "scatter_nd_sub",
        lambda x: mb.scatter_nd(
            data=x,
            indices=np.array([[1, 0], [1, 0]], dtype=np.int32),
            updates=np.ones((2, 4), dtype=np.float32),
            mode="sub",
        ),
        lambda x: x - 2 * (np.arange(6).reshape(2, 3)[..., None] == 3),
    ),
]


@pytest.mark.parametrize("name, build, oracle", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_indexing_ops(name: str, build: Callable[..., Any], oracle: Callable[[np.ndarray], Any]) -> None:
    x = RNG.permutation(24).astype(np.float32).reshape(2, 3, 4)  # distinct values: no ties in topk
    expected = oracle(x.astype(np.float64))
    assert_evaluates_to(
        build, [x], list(expected) if isinstance(expected, tuple) else expected, opset=ct.target.iOS17
    )


def test_scatter_update_with_duplicate_indices_is_unsupported() -> None:
    x = _randn(3, 2)
    prog = _build(
        lambda x: mb.scatter(
            data=x,
            indices=np.array([1, 1], dtype=np.int32),
            updates=np.ones((2, 2), dtype=np.float32),
            mode="update",
        ),
        [x],
    )
    with pytest.raises(UnsupportedOpError, match="duplicate indices"):
        evaluate(prog, {"x": x})


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_pad_matches_torch(mode: str) -> None:
    x = _randn(2, 3, 5, 6)
    pad = [1, 2, 3, 1]
    kwargs = {"constant_val": 0.5} if mode == "constant" else {}
    expected = F.pad(_t(x), [3, 1, 1, 2], mode=mode, **({"value": 0.5} if mode == "constant" else {}))
    assert_evaluates_to(lambda x: mb.pad(x=x, pad=pad, mode=mode, **kwargs), [x], expected)


def test_space_depth_and_pixel_shuffle() -> None:
    x = _randn(1, 8, 3, 2)
    assert_evaluates_to(lambda x: mb.pixel_shuffle(x=x, upscale_factor=2), [x], F.pixel_shuffle(_t(x), 2))
    y = _randn(1, 2, 4, 6)
    assert_evaluates_to(
        lambda y: mb.pixel_unshuffle(x=y, downscale_factor=np.uint32(2)),
        [y],
        F.pixel_unshuffle(_t(y), 2),
        opset=ct.target.iOS16,
    )
    # depth_to_space is TensorFlow's (depth-column-row order); space_to_depth is its inverse.
    n, c, h, w, b = 1, 8, 3, 2, 2
    nhwc = x.transpose(0, 2, 3, 1).reshape(n, h, w, b, b, c // 4).transpose(0, 1, 3, 2, 4, 5)
    expected = nhwc.reshape(n, h * b, w * b, c // 4).transpose(0, 3, 1, 2)
    assert_evaluates_to(lambda x: mb.depth_to_space(x=x, block_size=2), [x], expected)
    assert_evaluates_to(
        lambda x: mb.space_to_depth(x=mb.depth_to_space(x=x, block_size=2), block_size=2), [x], x
    )


def test_upsample_nearest_neighbor() -> None:
    x = _randn(1, 2, 3, 4)
    expected = F.interpolate(_t(x), scale_factor=(2, 3), mode="nearest")
    assert_evaluates_to(
        lambda x: mb.upsample_nearest_neighbor(x=x, scale_factor_height=2, scale_factor_width=3),
        [x],
        expected,
    )
    prog = _build(lambda x: mb.upsample_nearest_neighbor(x=x, scale_factor_height=1.5), [x])
    with pytest.raises(UnsupportedOpError, match="fractional scale"):
        evaluate(prog, {"x": x})


# The grids resize_bilinear's definition lists for an input [0, 1] (Xin = 2): resizing that input gives
# the grid itself, so each sampling mode is checked against its own documentation.
RESIZE_DOC_GRIDS = [
    ("UNALIGN_CORNERS", 5, [0.0, 0.1, 0.5, 0.9, 1.0]),
    ("STRICT_ALIGN_CORNERS", 5, [0.0, 0.25, 0.5, 0.75, 1.0]),
    ("ALIGN_CORNERS", 5, [0.0, 0.25, 0.5, 0.75, 1.0]),
    ("DEFAULT", 5, [0.0, 0.4, 0.8, 1.0, 1.0]),
    ("OFFSET_CORNERS", 5, [0.1, 0.3, 0.5, 0.7, 0.9]),
    ("UNALIGN_CORNERS", 6, [0.0, 0.0, 1 / 3, 2 / 3, 1.0, 1.0]),
    ("STRICT_ALIGN_CORNERS", 6, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
    ("DEFAULT", 6, [0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0]),
    ("OFFSET_CORNERS", 6, [1 / 12, 0.25, 5 / 12, 7 / 12, 0.75, 11 / 12]),
]


@pytest.mark.parametrize(("mode", "size", "grid"), RESIZE_DOC_GRIDS)
def test_resize_bilinear_samples_the_documented_grid(mode: str, size: int, grid: list[float]) -> None:
    x = np.array([[[0.0, 1.0], [0.0, 1.0]]], dtype=np.float32)  # [1, 2, 2]: rows identical
    expected = np.broadcast_to(np.array(grid), (1, 3, size))
    assert_evaluates_to(
        lambda x: mb.resize_bilinear(x=x, target_size_height=3, target_size_width=size, sampling_mode=mode),
        [x],
        expected,
        atol=1e-15,
    )


@pytest.mark.parametrize(
    ("mode", "align_corners"), [("UNALIGN_CORNERS", False), ("STRICT_ALIGN_CORNERS", True)]
)
@pytest.mark.parametrize("size", [(7, 10), (3, 2), (12, 4)])
def test_resize_bilinear_matches_torch(mode: str, align_corners: bool, size: tuple[int, int]) -> None:
    x = _randn(2, 3, 5, 4)
    expected = F.interpolate(_t(x), size=size, mode="bilinear", align_corners=align_corners)
    assert_evaluates_to(
        lambda x: mb.resize_bilinear(
            x=x, target_size_height=size[0], target_size_width=size[1], sampling_mode=mode
        ),
        [x],
        expected,
        atol=1e-14,
    )


def test_resize_bilinear_align_corners_to_one_sample() -> None:
    # ALIGN_CORNERS reads the middle, (Xin - 1) / 2; STRICT_ALIGN_CORNERS has no spacing there.
    x = _randn(1, 5, 4)
    assert_evaluates_to(
        lambda x: mb.resize_bilinear(
            x=x, target_size_height=1, target_size_width=4, sampling_mode="ALIGN_CORNERS"
        ),
        [x],
        x[:, 2:3, :],
    )
    prog = _build(
        lambda x: mb.resize_bilinear(
            x=x, target_size_height=1, target_size_width=4, sampling_mode="STRICT_ALIGN_CORNERS"
        ),
        [x],
    )
    with pytest.raises(UnsupportedOpError, match="STRICT_ALIGN_CORNERS to one output sample"):
        evaluate(prog, {"x": x})


# (scale_factor_height, scale_factor_width): whole, fractional (the size recomputes the grid, as in
# PyTorch's recompute_scale_factor=True), and downscaling.
UPSAMPLE_SCALES = [(2, 3), (2.4, 1.5), (0.5, 1.0)]


@pytest.mark.parametrize("align_corners", [True, False])
@pytest.mark.parametrize("scales", UPSAMPLE_SCALES)
def test_upsample_bilinear_matches_torch(align_corners: bool, scales: tuple[float, float]) -> None:
    x = _randn(1, 3, 5, 4)
    size = [math.floor(n * s) for n, s in zip(x.shape[2:], scales)]
    expected = F.interpolate(_t(x), size=size, mode="bilinear", align_corners=align_corners)
    assert_evaluates_to(
        lambda x: mb.upsample_bilinear(
            x=x, scale_factor_height=scales[0], scale_factor_width=scales[1], align_corners=align_corners
        ),
        [x],
        expected,
        atol=1e-14,
    )


def test_upsample_bilinear_with_integer_scale_is_torch_scale_factor() -> None:
    # What the torch frontend converts F.interpolate(scale_factor=2) to: align_corners False.
    x = _randn(1, 2, 3, 4)
    expected = F.interpolate(_t(x), scale_factor=2, mode="bilinear", align_corners=False)
    assert_evaluates_to(
        lambda x: mb.upsample_bilinear(x=x, scale_factor_height=2, scale_factor_width=2, align_corners=False),
        [x],
        expected,
        atol=1e-14,
    )


def test_upsample_bilinear_half_pixel_centers() -> None:
    # iOS16: without half-pixel centers, align_corners=False is TensorFlow's legacy ResizeBilinear, the
    # DEFAULT grid i * Xin / Xout; with both flags the op is not defined.
    x = _randn(1, 2, 3, 4)
    legacy = assert_evaluates_to(
        lambda x: mb.upsample_bilinear(
            x=x, scale_factor_height=2, scale_factor_width=2, align_corners=False, half_pixel_centers=False
        ),
        [x],
        _resize_by_grid(x, [i * 3 / 6 for i in range(6)], [i * 4 / 8 for i in range(8)]),
        opset=ct.target.iOS16,
    )[0]
    assert not np.allclose(legacy, F.interpolate(_t(x), scale_factor=2, mode="bilinear").numpy())
    prog = _build(
        lambda x: mb.upsample_bilinear(
            x=x, scale_factor_height=2, scale_factor_width=2, align_corners=True, half_pixel_centers=True
        ),
        [x],
        opset=ct.target.iOS16,
    )
    with pytest.raises(UnsupportedOpError, match="both True"):
        evaluate(prog, {"x": x})


def _resize_by_grid(x: np.ndarray, rows: Sequence[float], cols: Sequence[float]) -> np.ndarray:
    """Bilinear samples of the last two axes of ``x`` at the given coordinates, element by element."""
    x = np.asarray(x, dtype=np.float64)
    h, w = x.shape[-2:]
    out = np.zeros(x.shape[:-2] + (len(rows), len(cols)))
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            r0, c0 = math.floor(r), math.floor(c)
            r1, c1 = min(r0 + 1, h - 1), min(c0 + 1, w - 1)
            dr, dc = r - r0, c - c0
            out[..., i, j] = (
                x[..., r0, c0] * (1 - dr) * (1 - dc)
                + x[..., r0, c1] * (1 - dr) * dc
                + x[..., r1, c0] * dr * (1 - dc)
                + x[..., r1, c1] * dr * dc
            )
    return out


def test_resize_nearest_neighbor_whole_multiples_only() -> None:
    x = _randn(1, 2, 3, 4)
    assert_evaluates_to(
        lambda x: mb.resize_nearest_neighbor(x=x, target_size_height=6, target_size_width=12),
        [x],
        F.interpolate(_t(x), size=(6, 12), mode="nearest"),
    )
    prog = _build(lambda x: mb.resize_nearest_neighbor(x=x, target_size_height=5, target_size_width=4), [x])
    with pytest.raises(UnsupportedOpError, match="resize of 3 to 5 samples"):
        evaluate(prog, {"x": x})


def test_resize_ios17() -> None:
    # The last resized_dims axes take the last entries of `shape`; a 0 keeps x's size.
    x = _randn(2, 3, 5, 4)
    shape = np.array([9, 0, 7], dtype=np.int32)
    expected = F.interpolate(_t(x), size=(5, 7), mode="bilinear", align_corners=True)
    assert_evaluates_to(
        lambda x: mb.resize(
            x=x, shape=shape, resized_dims=np.uint32(2), sampling_mode="STRICT_ALIGN_CORNERS"
        ),
        [x],
        expected,
        opset=ct.target.iOS17,
        atol=1e-14,
    )
    one_axis = F.interpolate(_t(x), size=(5, 8), mode="nearest")
    assert_evaluates_to(
        lambda x: mb.resize(
            x=x,
            shape=np.array([8], np.int32),
            resized_dims=np.uint32(1),
            interpolation_mode="NEAREST_NEIGHBOR",
        ),
        [x],
        one_axis,
        opset=ct.target.iOS17,
    )
    prog = _build(
        lambda x: mb.resize(
            x=x,
            shape=np.array([8], np.int32),
            resized_dims=np.uint32(1),
            interpolation_mode="NEAREST_NEIGHBOR",
            sampling_mode="ALIGN_CORNERS",
        ),
        [x],
        opset=ct.target.iOS17,
    )
    with pytest.raises(UnsupportedOpError, match="NEAREST_NEIGHBOR' with sampling_mode 'ALIGN_CORNERS'"):
        evaluate(prog, {"x": x})


def test_scaled_dot_product_attention_matches_torch() -> None:
    q, k, v = _randn(2, 3, 4, 8), _randn(2, 3, 5, 8), _randn(2, 3, 5, 6)
    mask = RNG.random((4, 5)) < 0.7
    mask[:, 0] = True
    expected = F.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=torch.from_numpy(mask))
    assert_evaluates_to(
        lambda q, k, v, m: mb.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=m),
        [q, k, v, mask],
        expected,
        opset=ct.target.iOS18,
        rtol=1e-10,
        atol=1e-12,
    )


def test_slice_update() -> None:
    x, u = _randn(3, 4), _randn(3, 2)
    expected = x.astype(np.float64).copy()
    expected[:, 1:4:2] = u
    assert_evaluates_to(
        lambda x, u: mb.slice_update(x=x, update=u, begin=[0, 1], end=[3, 4], stride=[1, 2]),
        [x, u],
        expected,
        opset=ct.target.iOS18,
    )


def test_quantize_dequantize_round_trip() -> None:
    x = _randn(2, 3)
    scale = np.float32(0.05)
    q = np.clip(np.round(x.astype(np.float64) / np.float64(scale)) + 3, -128, 127)
    outputs = assert_evaluates_to(
        lambda x: (
            mb.quantize(input=x, scale=scale, zero_point=np.int8(3), output_dtype="int8"),
            mb.dequantize(
                input=mb.quantize(input=x, scale=scale, zero_point=np.int8(3), output_dtype="int8"),
                scale=scale,
                zero_point=np.int8(3),
            ),
        ),
        [x],
        [q, (q - 3) * np.float64(scale)],
        opset=ct.target.iOS17,
    )
    assert outputs[0].dtype == np.int8


# ----------------------------------------------------------------------------------------------
# Control flow
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_runs_the_selected_branch(sign: float) -> None:
    x = (np.abs(_randn(2, 3)) + 0.5) * sign

    def program(x):
        pred = mb.greater(x=mb.reduce_sum(x=x), y=0.0)
        return mb.cond(pred=pred, _true_fn=lambda: mb.exp(x=x), _false_fn=lambda: mb.mul(x=x, y=-3.0))

    d = x.astype(np.float64)
    assert_evaluates_to(program, [x.astype(np.float32)], np.exp(d) if sign > 0 else -3.0 * d)


def test_while_loop_iterates_with_outer_scope_values() -> None:
    x = _randn(2, 2)
    scale = np.float32(1.5)

    def program(x):
        def cond(i, acc):
            return mb.less(x=i, y=np.int32(4))

        def body(i, acc):
            return mb.add(x=i, y=np.int32(1)), mb.add(x=mb.mul(x=acc, y=scale), y=x)  # x from the outer scope

        return mb.while_loop(_cond=cond, _body=body, loop_vars=(np.int32(0), x))

    acc = x.astype(np.float64)
    for _ in range(4):
        acc = acc * float(scale) + x
    assert_evaluates_to(program, [x], [np.int32(4), acc])


# ----------------------------------------------------------------------------------------------
# Errors, registration, precision, inputs
# ----------------------------------------------------------------------------------------------


def _random_program() -> Any:
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        noise = mb.random_uniform(shape=np.array([2, 3], dtype=np.int32), name="noise")
        return mb.add(x=x, y=noise)

    return prog


def test_unknown_op_raises_and_names_the_op() -> None:
    with pytest.raises(UnsupportedOpError) as info:
        evaluate(_random_program(), {"x": _randn(2, 3)})
    message = str(info.value)
    assert "'random_uniform'" in message
    assert "'noise'" in message
    assert "never guesses" in message
    assert "register_op_semantics" in message


def test_registered_semantics_are_used_and_can_be_removed() -> None:
    @register_op_semantics("random_uniform")
    def _zeros(ctx: OpContext) -> np.ndarray:
        return np.zeros(ctx.attr("shape"))

    try:
        assert "random_uniform" in supported_op_types()
        x = _randn(2, 3)
        out = evaluate(_random_program(), {"x": x})
        np.testing.assert_array_equal(next(iter(out.values())), x.astype(np.float64))
        with pytest.raises(EvaluationError, match="already has reference semantics"):
            register_op_semantics("random_uniform")(_zeros)
    finally:
        assert unregister_op_semantics("random_uniform") is _zeros
    assert "random_uniform" not in supported_op_types()


def test_wrong_semantics_shape_is_caught_at_the_op() -> None:
    original = unregister_op_semantics("relu")
    try:
        register_op_semantics("relu")(lambda ctx: ctx.array("x")[:1])
        prog = _build(lambda x: mb.relu(x=x, name="r"), [_randn(2, 3)])
        with pytest.raises(EvaluationError, match=r"output 'r' of op 'r' \(relu\) has shape \(1, 3\)"):
            evaluate(prog, {"x": _randn(2, 3)})
    finally:
        register_op_semantics("relu", replace=True)(original)


def test_native_precision_keeps_fp16_and_float64_does_not() -> None:
    x = (RNG.standard_normal((4, 16)) * 2).astype(np.float16)

    def program(x):
        return mb.gelu(x=mb.mul(x=x, y=np.float16(1.37)), mode="TANH_APPROXIMATION")

    prog = _build(program, [x])
    exact = F.gelu(_t(x) * float(np.float16(1.37)), approximate="tanh").numpy()
    wide = next(iter(evaluate(prog, {"x": x}).values()))
    native = next(iter(evaluate(prog, {"x": x}, precision="native").values()))
    assert wide.dtype == np.float64 and native.dtype == np.float16
    np.testing.assert_allclose(wide, exact, rtol=1e-12, atol=1e-14)
    error = np.abs(native.astype(np.float64) - exact).max()
    assert 1e-5 < error < 1e-2  # fp16 rounding, visible in native precision only


def test_native_precision_fp32() -> None:
    x = _randn(3, 5)
    prog = _build(lambda x: mb.exp(x=mb.mul(x=x, y=1.1)), [x])
    out = next(iter(evaluate(prog, {"x": x}, precision="native").values()))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.exp(x * np.float32(1.1)))


def test_input_validation() -> None:
    prog = _build(
        lambda x, n: mb.add(x=mb.cast(x=n, dtype="fp32"), y=x), [_randn(2, 3), np.zeros((2, 3), np.int32)]
    )
    with pytest.raises(EvaluationError, match=r"missing \['n'\]"):
        evaluate(prog, {"x": _randn(2, 3)})
    with pytest.raises(EvaluationError, match=r"unexpected \['y'\]"):
        evaluate(prog, {"x": _randn(2, 3), "n": np.zeros((2, 3), np.int32), "y": 1})
    with pytest.raises(EvaluationError, match=r"input 'x' has shape \(3, 2\)"):
        evaluate(prog, {"x": _randn(3, 2), "n": np.zeros((2, 3), np.int32)})
    with pytest.raises(EvaluationError, match="got floating values"):
        evaluate(prog, {"x": _randn(2, 3), "n": _randn(2, 3)})
    with pytest.raises(EvaluationError, match="Unknown precision"):
        evaluate(prog, {"x": _randn(2, 3), "n": np.zeros((2, 3), np.int32)}, precision="fp8")  # type: ignore[arg-type]


def test_symbolic_dimensions_bind_consistently() -> None:
    s = get_new_symbol()

    @mb.program(input_specs=[mb.TensorSpec(shape=(s, 3)), mb.TensorSpec(shape=(s, 3))])
    def prog(x, y):
        return mb.concat(values=[x, y], axis=0)

    out = evaluate(prog, {"x": _randn(5, 3), "y": _randn(5, 3)})
    assert next(iter(out.values())).shape == (10, 3)
    with pytest.raises(EvaluationError, match="already bound to 5"):
        evaluate(prog, {"x": _randn(5, 3), "y": _randn(4, 3)})


def test_converted_pytorch_model_matches_torch() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.up = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
            self.norm = torch.nn.LayerNorm(16)
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
            y = self.up(y).flatten(2)[:, :, :16]
            y = self.norm(y)
            attn = torch.softmax(self.proj(y) @ y.transpose(1, 2) / 4.0, dim=-1)
            return F.gelu(attn @ y, approximate="tanh")

    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 3, 8, 8)
    traced = torch.jit.trace(model, x)
    mlmodel = ct.convert(
        traced,
        inputs=[ct.TensorType(name="x", shape=x.shape)],
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT32,
        skip_model_load=True,
    )
    out = next(iter(evaluate(mlmodel._mil_program, {"x": x.numpy()}).values()))
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)  # torch runs in float32
