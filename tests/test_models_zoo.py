"""The model zoo converts with plain coremltools 9.0, and leaves the patterns the generic passes target.

Every zoo model is converted once per session with the override off. The tests pin down what coremltools
9.0 alone produces: the exact op-type counts, the written-out layer norms left unfused (their op chain,
axes, epsilon and affine form), the GELU variants it fuses and the ones it leaves. When a generic pass
lands, its own tests convert with ``override=True`` and compare against these baselines.

The conversion helpers are tested here too: the environment-variable context manager, the deep copy in
:func:`convert_mil`, and op counting through nested blocks.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

from pattern_infra.testing.convert import (
    ENV_VAR,
    convert_mil,
    convert_torch,
    count_ops,
    experimental_passes,
    iter_ops,
    op_counts,
)
from pattern_infra.testing.models import ZOO, prenorm_transformer

# Non-const op counts of every zoo model after `coremltools.convert` (9.0, override off, iOS16, fp32).
EXPECTED_OPS: dict[str, dict[str, int]] = {
    "prenorm_transformer": {
        "add": 14,
        "gelu": 2,
        "linear": 12,
        "matmul": 4,
        "mul": 7,
        "pow": 5,
        "real_div": 5,
        "reduce_mean": 10,
        "reshape": 8,
        "softmax": 2,
        "sqrt": 5,
        "sub": 5,
        "transpose": 8,
    },
    "prenorm_transformer_inline_ln": {
        "add": 14,
        "gelu": 2,
        "linear": 12,
        "matmul": 4,
        "mul": 7,
        "pow": 5,
        "real_div": 5,
        "reduce_mean": 10,
        "reshape": 8,
        "softmax": 2,
        "sqrt": 5,
        "sub": 5,
        "transpose": 8,
    },
    "gpt2_block": {
        "add": 2,
        "gelu": 1,
        "layer_norm": 2,
        "linear": 4,
        "matmul": 2,
        "mul": 1,
        "reshape": 11,
        "select": 1,
        "softmax": 1,
        "split": 1,
        "transpose": 4,
    },
    "bert_encoder": {
        "add": 6,
        "expand_dims": 2,
        "gelu": 2,
        "layer_norm": 4,
        "linear": 12,
        "matmul": 4,
        "mul": 3,
        "reshape": 8,
        "softmax": 2,
        "sub": 1,
        "transpose": 8,
    },
    "convnext_stage": {
        "add": 5,
        "batch_norm": 3,
        "conv": 7,
        "gelu": 2,
        "pow": 3,
        "real_div": 3,
        "reduce_mean": 6,
        "sqrt": 3,
        "sub": 3,
    },
    "clip_mlp": {"add": 1, "layer_norm": 1, "linear": 2, "mul": 2, "sigmoid": 1},
    "resnet_stack": {"add": 2, "conv": 6, "relu": 5},
    "mobilenet_block": {"add": 1, "clip": 2, "conv": 3},
    "jax_style_gelu_mlp": {"add": 2, "linear": 2, "mul": 6, "tanh": 1},
}


@functools.cache
def _converted(name: str) -> Program:
    """Convert a zoo model once per session (override off) and return its program after all passes.

    Tests only read the cached programs; none may mutate them.
    """
    module, args = ZOO[name]()
    return convert_torch(module, args, override=False)


def _ops_of_type(prog: Program, op_type: str) -> list[Any]:
    return [op for op in iter_ops(prog) if op.op_type == op_type]


def _const(var: Any) -> np.ndarray | None:
    """The value of ``var`` when a ``const`` op produces it, else ``None``."""
    if var.op is not None and var.op.op_type == "const":
        return np.asarray(var.val)
    return None


def _producer(var: Any, op_type: str) -> Any:
    """The op producing ``var``, checked to be of ``op_type``."""
    assert var.op is not None, f"{var.name} is a function input, expected the output of {op_type}"
    assert var.op.op_type == op_type, f"{var.name} comes from {var.op.op_type}, expected {op_type}"
    return var.op


def _check_layer_norm_statistics(div_input: Any, sqrt_var: Any, axes: list[int], eps: float) -> Any:
    """Check ``sqrt(reduce_mean(pow(x - u, 2)) + eps)`` and return the ``sub`` op computing ``x - u``.

    The centred input is computed once (``remove_redundant_ops`` merged the two ``x - u`` of the source).
    """
    sub = _producer(div_input, "sub")
    mean = _producer(sub.y, "reduce_mean")
    assert mean.x is sub.x
    assert _const(mean.axes).tolist() == axes and bool(_const(mean.keep_dims)) is True
    add_eps = _producer(_producer(sqrt_var, "sqrt").x, "add")
    eps_val = _const(add_eps.y)
    assert eps_val is not None and eps_val.dtype == np.float32 and eps_val.shape == ()
    assert eps_val == np.float32(eps)
    var_mean = _producer(add_eps.x, "reduce_mean")
    assert _const(var_mean.axes).tolist() == axes and bool(_const(var_mean.keep_dims)) is True
    pow_op = _producer(var_mean.x, "pow")
    assert pow_op.x is sub.outputs[0]
    exponent = _const(pow_op.y)
    assert exponent is not None and exponent.dtype == np.float32 and exponent == 2.0
    return sub


def _written_layer_norms(prog: Program, style: str, axes: list[int], eps: float) -> Iterator[tuple[Any, Any]]:
    """Yield ``(gamma, beta)`` of every written-out layer norm of the given style, checking its chain.

    ``style="module"``: ``add(x=mul(x=gamma, y=real_div(x=sub, y=sqrt)), y=beta)``.
    ``style="inline"``: ``add(x=real_div(x=mul(x=gamma, y=sub), y=sqrt), y=beta)``.
    """
    for div in _ops_of_type(prog, "real_div"):
        if style == "module":
            _check_layer_norm_statistics(div.x, div.y, axes, eps)
            (mul,) = div.outputs[0].child_ops
            assert mul.op_type == "mul" and mul.y is div.outputs[0]
            last = mul
        else:
            mul = _producer(div.x, "mul")
            _check_layer_norm_statistics(mul.y, div.y, axes, eps)
            last = div
        gamma = _const(mul.x)
        (add,) = last.outputs[0].child_ops
        assert add.op_type == "add" and add.x is last.outputs[0]
        beta = _const(add.y)
        assert gamma is not None and beta is not None
        yield gamma, beta


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_converts_with_expected_ops(name: str) -> None:
    prog = _converted(name)
    prog.validate()
    counts = op_counts(prog)
    non_const = {op_type: n for op_type, n in sorted(counts.items()) if op_type != "const"}
    assert non_const == EXPECTED_OPS[name]
    assert count_ops(prog) == sum(EXPECTED_OPS[name].values())
    assert count_ops(prog, include_const=True) == count_ops(prog) + counts["const"]


@pytest.mark.parametrize(
    ("name", "style"), [("prenorm_transformer", "module"), ("prenorm_transformer_inline_ln", "inline")]
)
def test_prenorm_layer_norms_stay_written_out(name: str, style: str) -> None:
    prog = _converted(name)
    norms = list(_written_layer_norms(prog, style, axes=[-1], eps=1e-5))
    assert len(norms) == 2 * 2 + 1  # two per block, plus the final one
    for gamma, beta in norms:
        assert gamma.shape == (64,) and gamma.dtype == np.float32
        assert beta.shape == (64,) and beta.dtype == np.float32
    assert not _ops_of_type(prog, "layer_norm")
    assert [op.mode.val for op in _ops_of_type(prog, "gelu")] == ["TANH_APPROXIMATION"] * 2


def test_prenorm_layer_norm_input_feeds_the_residual() -> None:
    prog = _converted("prenorm_transformer")
    centred = [div.x.op for div in _ops_of_type(prog, "real_div")]
    consumers = [sorted(op.op_type for op in sub.x.child_ops) for sub in centred]
    # Each block's two layer-norm inputs also feed the residual add; the final norm's input does not.
    assert consumers == [["add", "reduce_mean", "sub"]] * 4 + [["reduce_mean", "sub"]]


def test_convnext_channels_first_layer_norm_is_left_with_batch_norm_affine() -> None:
    prog = _converted("convnext_stage")
    divs = _ops_of_type(prog, "real_div")
    assert len(divs) == 3
    for div in divs:
        _check_layer_norm_statistics(div.x, div.y, axes=[1], eps=1e-6)
        (bn,) = div.outputs[0].child_ops
        # fuse_elementwise_to_batchnorm turned `gamma[:, None, None] * x + beta[:, None, None]` into a
        # batch_norm with mean 0, variance 1 and its default epsilon 1e-5.
        assert bn.op_type == "batch_norm"
        assert np.all(_const(bn.mean) == 0.0) and np.all(_const(bn.variance) == 1.0)
        assert _const(bn.epsilon) == np.float32(1e-5)
    assert [op.mode.val for op in _ops_of_type(prog, "gelu")] == ["EXACT"] * 2


@pytest.mark.parametrize(("name", "n_norms"), [("gpt2_block", 2), ("bert_encoder", 4), ("clip_mlp", 1)])
def test_nn_layer_norm_converts_to_layer_norm(name: str, n_norms: int) -> None:
    norms = _ops_of_type(_converted(name), "layer_norm")
    assert len(norms) == n_norms
    assert all(_const(op.axes).tolist() == [-1] for op in norms)


@pytest.mark.parametrize(
    ("name", "mode", "n"), [("gpt2_block", "TANH_APPROXIMATION", 1), ("bert_encoder", "EXACT", 2)]
)
def test_library_gelus_are_fused(name: str, mode: str, n: int) -> None:
    prog = _converted(name)
    assert [op.mode.val for op in _ops_of_type(prog, "gelu")] == [mode] * n
    assert not _ops_of_type(prog, "tanh") and not _ops_of_type(prog, "erf") and not _ops_of_type(prog, "pow")


def test_clip_quick_gelu_is_left_unfused() -> None:
    prog = _converted("clip_mlp")
    (sigmoid,) = _ops_of_type(prog, "sigmoid")
    scale = _producer(sigmoid.x, "mul")
    assert _const(scale.y) == np.float32(1.702)
    (gate,) = sigmoid.outputs[0].child_ops
    assert gate.op_type == "mul" and gate.x is scale.x and gate.y is sigmoid.outputs[0]
    assert _producer(scale.x, "linear")


def test_jax_style_tanh_gelu_is_left_unfused() -> None:
    prog = _converted("jax_style_gelu_mlp")
    (tanh,) = _ops_of_type(prog, "tanh")
    inner = _producer(tanh.x, "mul")
    assert _const(inner.y) == np.float32(math.sqrt(2 / math.pi))
    add = _producer(inner.x, "add")
    x = add.x
    coeff = _producer(add.y, "mul")
    assert _const(coeff.y) == np.float32(0.044715)
    cube = _producer(coeff.x, "mul")
    square = _producer(cube.x, "mul")
    assert square.x is x and square.y is x and cube.y is x
    (plus_one,) = tanh.outputs[0].child_ops
    assert plus_one.op_type == "add" and _const(plus_one.y) == np.float32(1.0)
    (half,) = plus_one.outputs[0].child_ops
    assert half.op_type == "mul" and _const(half.y) == np.float32(0.5)
    (out,) = half.outputs[0].child_ops
    assert out.op_type == "mul" and out.x is x and out.y is half.outputs[0]


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_builders_are_deterministic(name: str) -> None:
    module_a, args_a = ZOO[name]()
    module_b, args_b = ZOO[name]()
    assert not module_a.training
    state_a, state_b = module_a.state_dict(), module_b.state_dict()
    assert list(state_a) == list(state_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(torch.equal(a, b) for a, b in zip(args_a, args_b, strict=True))
    with torch.no_grad():
        out = module_a(*args_a)
    assert torch.isfinite(out).all()


def test_prenorm_transformer_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        prenorm_transformer(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="ln_style"):
        prenorm_transformer(ln_style="fused")  # type: ignore[arg-type]


@pytest.mark.parametrize("previous", [None, "0", "1"])
@pytest.mark.parametrize("enabled", [False, True])
def test_experimental_passes_sets_and_restores(
    monkeypatch: pytest.MonkeyPatch, previous: str | None, enabled: bool
) -> None:
    if previous is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, previous)
    with pytest.raises(RuntimeError, match="boom"):
        with experimental_passes(enabled):
            assert os.environ.get(ENV_VAR) == ("1" if enabled else None)
            raise RuntimeError("boom")
    assert os.environ.get(ENV_VAR) == previous


def _layer_norm_program() -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 8))])
    def prog(x: Any) -> Any:
        u = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name="mean")
        d = mb.sub(x=x, y=u, name="centred")
        v = mb.reduce_mean(x=mb.mul(x=d, y=d, name="square"), axes=[-1], keep_dims=True, name="var")
        r = mb.rsqrt(x=mb.add(x=v, y=1e-5, name="add_eps"), name="rsqrt")
        return mb.mul(x=d, y=r, name="out")

    return prog


def test_convert_mil_leaves_the_callers_program_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    prog = _layer_norm_program()
    text_before, counts_before = str(prog), op_counts(prog)
    converted = convert_mil(prog, override=False)
    assert converted is not prog
    assert str(prog) == text_before and op_counts(prog) == counts_before
    assert {k: v for k, v in op_counts(converted).items() if k != "const"} == {
        "reduce_mean": 2,
        "sub": 1,
        "mul": 2,
        "add": 1,
        "rsqrt": 1,
    }
    assert os.environ.get(ENV_VAR) is None


@pytest.mark.parametrize("previous", [None, "0"])
def test_convert_torch_with_override_registers_passes_and_restores_env(
    monkeypatch: pytest.MonkeyPatch, previous: str | None
) -> None:
    if previous is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, previous)
    module, args = ZOO["clip_mlp"]()
    prog = convert_torch(module, args, override=True)
    assert "generic_passes" in sys.modules
    assert os.environ.get(ENV_VAR) == previous
    prog.validate()
    counts = op_counts(prog)
    assert (counts["layer_norm"], counts["linear"], counts["add"]) == (1, 2, 1)


def test_op_counts_descends_into_nested_blocks() -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(3,)), mb.TensorSpec(shape=(1,))])
    def prog(x: Any, flag: Any) -> Any:
        pred = mb.squeeze(x=mb.greater(x=flag, y=0.0, name="gt"), name="pred")
        return mb.cond(
            pred=pred,
            _true_fn=lambda: mb.relu(x=mb.add(x=x, y=1.0, name="t_add"), name="t_relu"),
            _false_fn=lambda: mb.mul(x=x, y=2.0, name="f_mul"),
            name="cond",
        )

    counts = op_counts(prog)
    for op_type in ("greater", "squeeze", "cond", "add", "relu", "mul"):
        assert counts[op_type] == 1, op_type
    assert count_ops(prog) == 6
    assert count_ops(prog, include_const=True) == 6 + counts["const"]
    order = [op.op_type for op in iter_ops(prog) if op.op_type != "const"]
    assert order == ["greater", "squeeze", "cond", "add", "relu", "mul"]


def test_expected_table_covers_the_zoo() -> None:
    assert list(EXPECTED_OPS) == list(ZOO)
