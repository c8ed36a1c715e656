"""``generic::fuse_grouped_kv_attention``: repeat_kv + attention with K/V never repeated (iOS18)."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fuse_grouped_kv_attention"
SDPA = "scaled_dot_product_attention"
B, HKV, G, L, S, E, EV = 2, 2, 3, 4, 6, 8, 5
H = HKV * G
RNG = np.random.default_rng(5)
CAUSAL = np.tril(np.ones((L, S), dtype=bool), k=S - L)


def grouped(
    mask: str = "none",
    *,
    groups: int = G,
    v_groups: int | None = None,
    dtype=types.fp32,
) -> Program:
    """``sdpa(q, repeat_kv(k), repeat_kv(v), mask)``; mask: none, float_shared (B,1,L,S runtime), const_bool
    (1,1,L,S), const_row (B,1,1,S float), per_head (B,H,L,S runtime), per_head_row (B,H,1,S runtime)."""
    v_groups = groups if v_groups is None else v_groups
    specs = [
        mb.TensorSpec(shape=(B, HKV * groups, L, E), dtype=dtype),
        mb.TensorSpec(shape=(B, HKV, S, E), dtype=dtype),
        mb.TensorSpec(shape=(B, HKV, S, EV), dtype=dtype),
    ]
    runtime = {"float_shared": (B, 1, L, S), "per_head": (B, HKV * groups, L, S), "per_head_row": (B, HKV * groups, 1, S)}
    if mask in runtime:
        specs.append(mb.TensorSpec(shape=runtime[mask], dtype=dtype))

    def repeat(t, n, last):
        r = mb.tile(x=mb.expand_dims(x=t, axes=[2]), reps=[1, 1, n, 1, 1])
        return mb.reshape(x=r, shape=[B, HKV * n, S, last])

    def body(q, k, v, m=None):
        if mask == "const_bool":
            m = CAUSAL[None, None]
        elif mask == "const_row":
            m = RNG.standard_normal((B, 1, 1, S)).astype(np.float32)
        kwargs = {} if m is None else {"attn_mask": m}
        out = mb.scaled_dot_product_attention(query=q, key=repeat(k, groups, E), value=repeat(v, v_groups, EV), **kwargs)
        return mb.relu(x=out)

    if len(specs) == 4:
        return mb.program(input_specs=specs, opset_version=ct.target.iOS18)(lambda q, k, v, m: body(q, k, v, m))
    return mb.program(input_specs=specs, opset_version=ct.target.iOS18)(lambda q, k, v: body(q, k, v))


FOLDED = ["reshape", SDPA, "reshape", "relu"]


@pytest.mark.parametrize(
    "mask, expected",
    [
        ("none", FOLDED),
        ("const_bool", FOLDED),  # repeated at compile time
        ("const_row", FOLDED),  # [B, 1, 1, S] broadcasts as it is
        # the runtime mask (a function input) repeated once, at the block's start, for every layer
        ("float_shared", ["tile", "reshape", SDPA, "reshape", "relu"]),
        ("per_head", ["reshape", "reshape", SDPA, "reshape", "relu"]),
    ],
)
def test_folded(mask, expected):
    prog = grouped(mask)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == expected, op_types(ours)
    (sdpa,) = ours.functions["main"].find_ops(op_type=SDPA)
    assert sdpa.key.name == "k" and sdpa.value.name == "v"  # K and V themselves, never repeated
    assert tuple(sdpa.query.shape) == (B, HKV, G * L, E)
    assert_programs_equivalent(prog, ours, rtol=1e-12, atol=1e-12)  # exact: the same arithmetic per row


def test_fp16():
    prog = grouped("const_bool", dtype=types.fp16)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == FOLDED
    assert_programs_equivalent(prog, ours, rtol=1e-12, atol=1e-12)


def test_two_groups():
    prog = grouped(groups=2)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == FOLDED
    assert_programs_equivalent(prog, ours, rtol=1e-12, atol=1e-12)


def test_runtime_per_head_mask_without_query_axis_left_alone():
    prog = grouped("per_head_row")
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


def test_repeat_along_the_sequence_left_alone():
    prog = _repeat_along_sequence()
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


def _repeat_along_sequence() -> Program:
    """K/V tiled along a new axis after the sequence (reshaped to the same head count): not repeat_kv."""
    specs = [mb.TensorSpec(shape=(B, HKV * G, L, E)), mb.TensorSpec(shape=(B, HKV, S, E)),
             mb.TensorSpec(shape=(B, HKV, S, EV))]

    def rep(t, last):
        e = mb.expand_dims(x=t, axes=[3])
        r = mb.tile(x=e, reps=[1, 1, 1, G, 1])
        return mb.reshape(x=r, shape=[B, HKV * G, S, last])

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v):
        return mb.relu(x=mb.scaled_dot_product_attention(query=q, key=rep(k, E), value=rep(v, EV)))

    return prog


def test_different_groups_for_k_and_v_left_alone():
    """K repeated 3 times, V from 3 heads repeated twice: both reach 6 heads, but not the same grouping."""
    specs = [mb.TensorSpec(shape=(B, 6, L, E)), mb.TensorSpec(shape=(B, 2, S, E)), mb.TensorSpec(shape=(B, 3, S, EV))]

    def rep(t, heads, n, last):
        r = mb.tile(x=mb.expand_dims(x=t, axes=[2]), reps=[1, 1, n, 1, 1])
        return mb.reshape(x=r, shape=[B, heads * n, S, last])

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v):
        return mb.relu(x=mb.scaled_dot_product_attention(query=q, key=rep(k, 2, 3, E), value=rep(v, 3, 2, EV)))

    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)
