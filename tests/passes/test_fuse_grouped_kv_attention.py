"""``generic::fuse_grouped_kv_attention``: repeat_kv + attention with K/V never repeated (iOS18)."""

from __future__ import annotations

import math

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.convert import convert_torch, op_counts
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.evaluator import evaluate
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
    runtime = {
        "float_shared": (B, 1, L, S),
        "per_head": (B, HKV * groups, L, S),
        "per_head_row": (B, HKV * groups, 1, S),
    }
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
        out = mb.scaled_dot_product_attention(
            query=q, key=repeat(k, groups, E), value=repeat(v, v_groups, EV), **kwargs
        )
        return mb.relu(x=out)

    if len(specs) == 4:
        return mb.program(input_specs=specs, opset_version=ct.target.iOS18)(
            lambda q, k, v, m: body(q, k, v, m)
        )
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
    specs = [
        mb.TensorSpec(shape=(B, HKV * G, L, E)),
        mb.TensorSpec(shape=(B, HKV, S, E)),
        mb.TensorSpec(shape=(B, HKV, S, EV)),
    ]

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
    specs = [
        mb.TensorSpec(shape=(B, 6, L, E)),
        mb.TensorSpec(shape=(B, 2, S, E)),
        mb.TensorSpec(shape=(B, 3, S, EV)),
    ]

    def rep(t, heads, n, last):
        r = mb.tile(x=mb.expand_dims(x=t, axes=[2]), reps=[1, 1, n, 1, 1])
        return mb.reshape(x=r, shape=[B, heads * n, S, last])

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v):
        return mb.relu(
            x=mb.scaled_dot_product_attention(query=q, key=rep(k, 2, 3, E), value=rep(v, 3, 2, EV))
        )

    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


# -- multi-query attention: one K/V head broadcast by one tile(reps=[1, H, 1, 1]) -------------------------


def multi_query(mask: str = "none", *, kv_heads: int = 1, reps_input: bool = False) -> Program:
    """``sdpa(q, tile(k, [1, H/kv_heads, 1, 1]), tile(v, ...), mask)``; mask: none, const_bool, float_shared.
    ``reps_input``: the reps are a function input (nothing proves them)."""
    groups = H // kv_heads
    specs = [
        mb.TensorSpec(shape=(B, H, L, E)),
        mb.TensorSpec(shape=(B, kv_heads, S, E)),
        mb.TensorSpec(shape=(B, kv_heads, S, EV)),
    ]
    if mask == "float_shared":
        specs.append(mb.TensorSpec(shape=(B, 1, L, S)))
    if reps_input:
        specs.append(mb.TensorSpec(shape=(4,), dtype=types.int32))

    def body(q, k, v, *rest):
        reps = rest[-1] if reps_input else [1, groups, 1, 1]
        m = CAUSAL[None, None] if mask == "const_bool" else (rest[0] if mask == "float_shared" else None)
        kwargs = {} if m is None else {"attn_mask": m}
        out = mb.scaled_dot_product_attention(
            query=q, key=mb.tile(x=k, reps=reps), value=mb.tile(x=v, reps=reps), **kwargs
        )
        return mb.relu(x=out)

    program = mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    if len(specs) == 3:
        return program(lambda q, k, v: body(q, k, v))
    return program(lambda q, k, v, extra: body(q, k, v, extra))


@pytest.mark.parametrize(
    "mask, expected",
    [
        ("none", FOLDED),
        ("const_bool", FOLDED),
        ("float_shared", ["tile", "reshape", SDPA, "reshape", "relu"]),
    ],
)
def test_multi_query_folded_with_all_heads_as_one_group(mask, expected):
    prog = multi_query(mask)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == expected, op_types(ours)
    (sdpa,) = ours.functions["main"].find_ops(op_type=SDPA)
    assert sdpa.key.name == "k" and sdpa.value.name == "v"
    assert tuple(sdpa.query.shape) == (B, 1, H * L, E)  # G = H query heads over the single K/V head
    assert_programs_equivalent(prog, ours, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [{"kv_heads": 2}, {"reps_input": True}],
    ids=["tile_of_two_heads_interleaves_them", "reps_not_provably_H"],
)
def test_multi_query_near_misses_left_alone(kwargs):
    """``tile(k, [1, G, 1, 1])`` of 2 heads gives heads ``k0, k1, k0, k1, ...``: query head ``h`` reads
    K/V head ``h % 2``, not ``h // G`` as ``repeat_kv``; reps read from an input are not proven."""
    prog = multi_query(**kwargs)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)


class _MultiQueryAttention(torch.nn.Module):
    """Falcon-style multi-query self-attention: one K/V head expanded to every query head, written out."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query = torch.nn.Linear(dim, dim)
        self.key_value = torch.nn.Linear(dim, 2 * self.head_dim)
        self.dense = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.query(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.key_value(x).unsqueeze(1).split(self.head_dim, dim=-1)
        k = k.expand(batch, self.heads, length, self.head_dim)
        v = v.expand(batch, self.heads, length, self.head_dim)
        causal = torch.full((length, length), -1e9).triu(1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + causal
        out = torch.softmax(scores, dim=-1) @ v
        return self.dense(out.transpose(1, 2).reshape(batch, length, -1))


def test_multi_query_module_from_pytorch_loses_its_tiles():
    torch.manual_seed(0)
    module, x = _MultiQueryAttention().eval(), torch.randn(1, 6, 32)
    progs = {
        on: convert_torch(module, (x,), override=on, minimum_deployment_target=ct.target.iOS18)
        for on in (False, True)
    }
    counts, prog = {on: op_counts(p) for on, p in progs.items()}, progs[True]
    assert counts[False]["tile"] == 2 and counts[True]["tile"] == 0 and counts[True][SDPA] == 1
    (got,) = evaluate(prog, {name: x.numpy() for name in prog.functions["main"].inputs}).values()
    want = module(x).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# -- repeat_kv with run-time reps (a decoder with flexible lengths) --------------------------------------


def test_runtime_reps_folded_when_proven():
    """reps ``real_div(select(equal(target, -1), shape(x), target), shape(x))`` with ``target = [1, 2, 2, S,
    8]`` and ``x`` the cache sliced to ``S``: proven ``[1, 1, 2, 1, 1]``. Run with ``generic::fuse_sdpa``,
    whose follower this pass is, as in a conversion."""
    from pattern_infra.testing.cached_attention import cached_attention

    prog = cached_attention()
    ours = run_pass("generic::fuse_sdpa", prog, followers=True)
    (tile,) = ours.functions["main"].find_ops(op_type="tile")
    assert tile.x.name == "mask"  # only the mask is repeated, K and V never
    (sdpa,) = ours.functions["main"].find_ops(op_type=SDPA)
    assert sdpa.key.name == "k_slice" and sdpa.value.name == "v_slice"
    for length, cache_len in ((3, 5), (1, 6)):
        inputs = {
            "q": RNG.standard_normal((1, 4, length, 8)),
            "k_cache": RNG.standard_normal((1, 2, 16, 8)),
            "v_cache": RNG.standard_normal((1, 2, 16, 8)),
            "mask": RNG.standard_normal((1, 1, length, cache_len)),
            "other": np.zeros((1, cache_len)),
        }
        assert_programs_equivalent(prog, ours, inputs=inputs, rtol=1e-5)


def test_runtime_reps_not_proven_left_alone():
    """The target names the query length ``L`` where the sliced length ``S`` belongs: reps ``[1, 1, 2,
    L / S, 1]``, not proven ``G`` (nor is the attention fused: the keys' length is unknown)."""
    from pattern_infra.testing.cached_attention import cached_attention

    prog = cached_attention(reps_length="other")
    ours = run_pass("generic::fuse_sdpa", prog, followers=True)
    assert op_types(ours) == op_types(prog)


def flexible_grouped(mask_rank: int = 4) -> Program:
    """repeat_kv with constant reps on K/V of a symbolic length ``S``, reshaped to ``[B, H, -1, E]``; Q of a
    symbolic length ``L``; a runtime mask ``[1, 1, L, S]`` (``mask_rank`` 4) or ``[L, S]`` (2)."""
    length, keys = get_new_symbol(), get_new_symbol()
    mask_shape = (1, 1, length, keys) if mask_rank == 4 else (length, keys)
    specs = [
        mb.TensorSpec(shape=(B, H, length, E)),
        mb.TensorSpec(shape=(B, HKV, keys, E)),
        mb.TensorSpec(shape=(B, HKV, keys, EV)),
        mb.TensorSpec(shape=mask_shape),
    ]

    def repeat(t, last):
        return mb.reshape(
            x=mb.tile(x=mb.expand_dims(x=t, axes=[2]), reps=[1, 1, G, 1, 1]), shape=[B, H, -1, last]
        )

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v, mask):
        return mb.relu(
            x=mb.scaled_dot_product_attention(query=q, key=repeat(k, E), value=repeat(v, EV), attn_mask=mask)
        )

    return prog


def test_flexible_lengths_folded_with_the_query_rows_left_to_the_run_time():
    prog = flexible_grouped()
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["tile", "reshape", SDPA, "reshape", "relu"], op_types(ours)
    (query,) = [op for op in ours.functions["main"].find_ops(op_type="reshape") if op.x.name == "q"]
    assert list(query.shape.val) == [B, HKV, -1, E]
    for length, keys in ((3, 5), (1, 7)):
        inputs = {
            "q": RNG.standard_normal((B, H, length, E)),
            "k": RNG.standard_normal((B, HKV, keys, E)),
            "v": RNG.standard_normal((B, HKV, keys, EV)),
            "mask": RNG.standard_normal((1, 1, length, keys)),
        }
        assert_programs_equivalent(prog, ours, inputs=inputs, rtol=1e-12, atol=1e-12)


def test_rank_2_mask_of_two_symbols_left_alone():
    """Repeating it needs a reshape to rank 4 first, which can leave only one size to the run time."""
    prog = flexible_grouped(mask_rank=2)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)
