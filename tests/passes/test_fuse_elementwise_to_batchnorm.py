"""``common::fuse_elementwise_to_batchnorm``: per-channel ``mul`` + ``add`` into ``batch_norm``.

Numerics: both coremltools' fusion and ours use ``batch_norm``'s default ``epsilon=1e-5`` with
``variance=1``, scaling ``x * gamma`` by ``1/sqrt(1 + 1e-5)`` (a relative ``5.0e-6``). Comparisons therefore
use ``rtol=1e-5`` with ``atol=1e-5``: where ``x * gamma`` and ``beta`` nearly cancel, the absolute error
``5e-6 * |x * gamma|`` is not bounded by ``rtol`` times the (small) result.
"""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import assert_same_program, near_one_f32, op_types, run_both, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_elementwise_to_batchnorm"
rand = near_one_f32(np.random.default_rng(1))


def close(prog: Program, other: Program) -> None:
    assert_programs_equivalent(prog, other, rtol=1e-5, atol=1e-5)


def scale_shift(shape=(2, 3, 4, 5), gamma=None, beta=None, *, swap_mul=False, swap_add=False, extra=None):
    gamma = rand(1, shape[1], 1, 1) if gamma is None else gamma
    beta = rand(1, shape[1], 1, 1) if beta is None else beta

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        m = mb.mul(x=gamma, y=x, name="m") if swap_mul else mb.mul(x=x, y=gamma, name="m")
        y = mb.add(x=beta, y=m, name="y") if swap_add else mb.add(x=m, y=beta, name="y")
        if extra == "use_mul":
            return y, mb.relu(x=m)
        if extra == "mul_is_output":
            return y, m
        if extra == "use_root":
            return mb.add(x=x, y=y)
        return y

    return prog


def batch_norm_of(prog: Program):
    (bn,) = [op for op in prog.functions["main"].operations if op.op_type == "batch_norm"]
    return bn


@pytest.mark.parametrize("swap_add", [False, True], ids=["m_b", "b_m"])
@pytest.mark.parametrize("swap_mul", [False, True], ids=["x_g", "g_x"])
@pytest.mark.parametrize(
    "shapes",
    [((1, 3, 1, 1), (1, 3, 1, 1)), ((3, 1, 1), (1, 3, 1, 1)), ((3, 1, 1), (3, 1, 1))],
    ids=["1c11", "c11_1c11", "c11"],
)
def test_same_program_as_coremltools(shapes, swap_mul, swap_add):
    prog = scale_shift(gamma=rand(*shapes[0]), beta=rand(*shapes[1]), swap_mul=swap_mul, swap_add=swap_add)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == ["batch_norm"]
    assert_same_program(outcome.coremltools, outcome.ours)
    bn = batch_norm_of(outcome.ours)
    assert bn.outputs[0].name == "y" and bn.epsilon.val == np.float32(1e-5)
    close(prog, outcome.ours)


def test_root_used_elsewhere_and_many_channels_as_coremltools():
    prog = scale_shift((2, 16, 3, 3), extra="use_root")  # 16 channels: consts printed by name
    outcome = run_both(PASS, prog)
    theirs, ours = outcome.coremltools, outcome.ours
    assert op_types(theirs) == ["batch_norm", "add"]
    assert_same_program(theirs, ours)
    close(prog, ours)


@pytest.mark.parametrize(
    "gamma, beta",
    [
        (np.float32(2.5), rand(1, 3, 1, 1)),
        (rand(3, 1, 1), np.float32(-0.5)),
        (rand(1, 1, 1, 1), rand(3, 1, 1)),
    ],
    ids=["scalar_gamma", "scalar_beta", "size1_gamma"],
)
def test_one_size_1_constant_is_fused_beyond_coremltools(gamma, beta):
    prog = scale_shift(gamma=gamma, beta=beta)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == ["mul", "add"]
    assert op_types(outcome.ours) == ["batch_norm"]
    bn = batch_norm_of(outcome.ours)
    assert bn.gamma.shape == (3,) and bn.beta.shape == (3,)
    close(prog, outcome.ours)


def test_size_1_beta_becomes_per_channel():
    # coremltools makes batch_norm(beta=<rank 0>), which batch_norm's spec ([C]) does not allow.
    prog = scale_shift(beta=rand(1, 1, 1, 1))
    outcome = run_both(PASS, prog)
    assert batch_norm_of(outcome.coremltools).beta.shape == ()
    bn = batch_norm_of(outcome.ours)
    assert op_types(outcome.ours) == ["batch_norm"] and bn.beta.shape == (3,)
    close(prog, outcome.ours)


def test_one_channel_input_broadcast_by_constants_is_refused():
    # x has one channel, the constants three: coremltools' batch_norm keeps one channel (wrong shape).
    prog = scale_shift((2, 1, 4, 5), gamma=rand(1, 3, 1, 1), beta=rand(1, 3, 1, 1))
    outcome = run_both(PASS, prog)
    assert outcome.coremltools.functions["main"].outputs[0].shape != prog.functions["main"].outputs[0].shape
    assert_same_program(prog, outcome.ours)


@pytest.mark.parametrize(
    "prog",
    [
        lambda: scale_shift(extra="use_mul"),
        lambda: scale_shift(extra="mul_is_output"),
        lambda: scale_shift(gamma=rand(5), beta=rand(5)),  # scales the last axis, not the channels
        lambda: scale_shift((3, 4, 5), gamma=rand(3, 1, 1), beta=rand(3, 1, 1)),  # rank 3
        lambda: scale_shift(gamma=np.float32(2.0), beta=np.float32(1.0)),  # no channel count
        lambda: scale_shift((2, 1, 4, 5), gamma=rand(1, 1, 1, 1), beta=rand(1, 1, 1, 1)),  # C == 1
    ],
    ids=["mul_used_elsewhere", "mul_is_block_output", "last_axis", "rank3", "scalars", "one_channel"],
)
def test_not_fused(prog):
    p = prog()
    outcome = run_both(PASS, p)
    assert_same_program(p, outcome.coremltools)
    assert_same_program(p, outcome.ours)


def test_non_const_gamma_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 4, 5)), mb.TensorSpec(shape=(1, 3, 1, 1))])
    def prog(x, g):
        return mb.add(x=mb.mul(x=x, y=g), y=rand(1, 3, 1, 1))

    assert_same_program(prog, run_pass(PASS, prog))
