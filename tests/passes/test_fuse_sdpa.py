"""``generic::fuse_sdpa``: written-out attention into ``scaled_dot_product_attention`` (iOS18+)."""

from __future__ import annotations

import math

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import run_log
from pattern_infra.testing.convert import convert_torch, op_counts
from pattern_infra.testing.models import bert_encoder, gpt2_block, prenorm_transformer
from pattern_infra.testing.passes import assert_same_program, op_types, run_pass
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fuse_sdpa"
SDPA = "scaled_dot_product_attention"
B, H, L, S, E, EV = 2, 3, 5, 6, 16, 8
RNG = np.random.default_rng(3)
CAUSAL = np.tril(np.ones((L, S), dtype=bool), k=S - L)[None, None]  # every row keeps >= 1 key
ROW_MASKED = CAUSAL.copy()
ROW_MASKED[..., 2, :] = False  # query 2 attends to nothing


def check(prog: Program, expected: list[str]) -> Program:
    """Runs the pass; demands op types ``expected`` (``op_types(prog)``: untouched) and equal outputs."""
    ours = run_pass(PASS, prog)
    assert op_types(ours) == expected, op_types(ours)
    if expected == op_types(prog):
        assert_same_program(prog, ours)
    else:
        assert_programs_equivalent(prog, ours, rtol=1e-5)
    return ours


def attention(
    key_form: str = "transpose",
    mask_form: str = "none",
    *,
    scale: float | None = None,
    opset=ct.target.iOS18,
    dtype=types.fp32,
    mask: np.ndarray | None = None,
    fill: float = float(np.finfo(np.float32).min),
    mask_shape=(B, 1, 1, S),
    kv_heads: int = H,
    axis: int = -1,
    extra: str | None = None,
    scale_at: str = "scores",
) -> Program:
    """``softmax(q @ k^T * scale [mask]) @ v`` in one of the forms the pass matches.

    key_form: ``"transpose"`` (``k`` is ``[B, H, S, E]``, transposed by ``perm=[0, 1, 3, 2]``),
    ``"merged"`` (``k`` is ``[B, S, H, E]``, head split and ``K^T`` in one ``perm=[0, 2, 3, 1]``),
    ``"transpose_y"`` (``matmul(q, k, transpose_y=True)``). mask_form: ``"none"``, ``"add"`` (a runtime
    float input), ``"select"`` / ``"select_inverted"`` (a constant bool mask), ``"select_input"`` (a
    runtime bool mask).
    """
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    k_shape = (B, S, kv_heads, E) if key_form == "merged" else (B, kv_heads, S, E)
    specs = [
        mb.TensorSpec(shape=(B, L, H, E) if scale_at == "query_transposed" else (B, H, L, E), dtype=dtype),
        mb.TensorSpec(shape=k_shape, dtype=dtype),
        mb.TensorSpec(shape=(B, kv_heads, S, EV), dtype=dtype),
    ]
    if mask_form == "add":
        specs.append(mb.TensorSpec(shape=mask_shape, dtype=dtype))
    if mask_form == "select_input":
        specs.append(mb.TensorSpec(shape=(1, 1, L, S), dtype=types.bool))
    if extra == "dynamic_scale":
        specs.append(mb.TensorSpec(shape=(1,), dtype=dtype))
    bool_mask = CAUSAL if mask is None else mask
    np_dtype = np.float16 if dtype == types.fp16 else np.float32

    def body(q, k, v, *more):
        c = more[-1] if extra == "dynamic_scale" else np_dtype(scale)
        if scale_at.startswith("query"):
            q = mb.mul(x=q, y=c, name="scale")
        if scale_at == "query_transposed":
            q = mb.transpose(x=q, perm=[0, 2, 1, 3], name="query_t")
        if key_form == "transpose_y":
            qk = mb.matmul(x=q, y=k, transpose_y=True, name="qk")
        else:
            perm = [0, 2, 3, 1] if key_form == "merged" else [0, 1, 3, 2]
            qk = mb.matmul(x=q, y=mb.transpose(x=k, perm=perm, name="key_t"), name="qk")
        scores = mb.mul(x=c, y=qk, name="scale") if scale_at == "scores" else qk
        if mask_form == "add":
            scores = mb.add(x=more[0], y=scores, name="masked")
        elif mask_form == "select":
            scores = mb.select(cond=bool_mask, a=scores, b=np_dtype(fill), name="masked")
        elif mask_form == "select_inverted":
            scores = mb.select(cond=~bool_mask, a=np_dtype(fill), b=scores, name="masked")
        elif mask_form == "select_input":
            scores = mb.select(cond=more[0], a=scores, b=np_dtype(fill), name="masked")
        probs = mb.softmax(x=scores, axis=axis, name="probs")
        out = mb.matmul(x=probs, y=v, name="out")
        if extra == "scores_used":
            return out, mb.exp(x=scores, name="other")
        if extra == "probs_is_output":
            return out, probs
        return mb.relu(x=out, name="y")

    if len(specs) == 4:

        @mb.program(input_specs=specs, opset_version=opset)
        def prog(q, k, v, m):
            return body(q, k, v, m)

        return prog

    @mb.program(input_specs=specs, opset_version=opset)
    def prog3(q, k, v):
        return body(q, k, v)

    return prog3


def sdpa_op(prog: Program):
    (op,) = prog.functions["main"].find_ops(op_type=SDPA)
    return op


KEY_FORMS = ["transpose", "merged", "transpose_y"]
MASK_FORMS = ["none", "add", "select", "select_inverted"]


@pytest.mark.parametrize("mask_form", MASK_FORMS)
@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_fused(key_form, mask_form):
    prog = attention(key_form, mask_form)
    expected = ([] if key_form != "merged" else ["transpose"]) + [SDPA, "relu"]
    ours = check(prog, expected)
    op = sdpa_op(ours)
    assert op.outputs[0].name == "out"
    assert (op.attn_mask is None) == (mask_form == "none")
    if mask_form.startswith("select"):
        assert op.attn_mask.dtype == types.bool
        np.testing.assert_array_equal(op.attn_mask.val, CAUSAL)
    if key_form == "merged":
        (transpose,) = ours.functions["main"].find_ops(op_type="transpose")
        assert [int(p) for p in transpose.perm.val] == [0, 2, 1, 3]


@pytest.mark.parametrize("mask_form", MASK_FORMS)
@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_fused_with_the_scale_on_the_query(key_form, mask_form):
    """``(q * c) @ K^T``: coremltools' own decomposition of ``F.scaled_dot_product_attention``."""
    prog = attention(key_form, mask_form, scale_at="query")
    expected = ([] if key_form != "merged" else ["transpose"]) + [SDPA, "relu"]
    ours = check(prog, expected)
    assert sdpa_op(ours).query.name == "q"


@pytest.mark.parametrize("mask_form", MASK_FORMS)
@pytest.mark.parametrize("key_form", KEY_FORMS)
def test_fused_with_the_scale_before_the_query_transpose(key_form, mask_form):
    """``transpose(q * c) @ K^T``: coremltools moved the ``mul`` above the head transpose."""
    prog = attention(key_form, mask_form, scale_at="query_transposed")
    transposes = ["transpose"] + (["transpose"] if key_form == "merged" else [])
    ours = check(prog, transposes + [SDPA, "relu"])
    assert sdpa_op(ours).query.op.op_type == "transpose" and sdpa_op(ours).query.op.x.name == "q"


@pytest.mark.parametrize("mask_form", ["none", "add"])
def test_fused_without_scale_when_sqrt_e_is_a_power_of_two(mask_form):
    """No ``mul`` at all (Whisper folds the scale into the query weights): Q * sqrt(E) = Q * 4, exact."""
    ours = check(attention(mask_form=mask_form, scale_at="none"), ["mul", SDPA, "relu"])
    (mul,) = ours.functions["main"].find_ops(op_type="mul")
    assert float(mul.y.val) == math.sqrt(E) == 4.0


@pytest.mark.parametrize(
    "kwargs",
    [{"scale": 0.3, "mask_form": "add"}, {"extra": "dynamic_scale"}],
    ids=["wrong_scale", "dynamic_scale"],
)
def test_other_query_scale_stays_part_of_the_query(kwargs):
    """A scale that is not 1/sqrt(E) stays a ``mul`` of Q; the attention is then the unscaled form,
    whose ``Q * sqrt(E)`` is exact here (E = 16)."""
    prog = attention(scale_at="query", **kwargs)
    ours = check(prog, ["mul", "mul", SDPA, "relu"])
    assert float(sdpa_op(ours).query.op.y.val) == 4.0


def test_query_scaled_declined_before_ios18():
    prog = attention(scale_at="query", mask_form="add", opset=ct.target.iOS17)
    check(prog, op_types(prog))


def test_fused_fp16():
    check(attention(dtype=types.fp16), [SDPA, "relu"])


@pytest.mark.parametrize("factor", [0.5, 2.0, 0.25])
def test_scale_folded_into_query_when_exact(factor):
    ours = check(attention(scale=factor / math.sqrt(E)), ["mul", SDPA, "relu"])
    (mul,) = ours.functions["main"].find_ops(op_type="mul")
    assert float(mul.y.val) == factor and mul.y.dtype == types.fp32
    assert sdpa_op(ours).query is mul.outputs[0]


def test_scale_within_tolerance_is_taken_as_is():
    check(attention(scale=(1 + 5e-7) / math.sqrt(E)), [SDPA, "relu"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": 0.3},  # c * sqrt(E) = 1.2: neither 1 nor a power of two
        {"scale": (1 + 1e-4) / math.sqrt(E)},  # close to 1/sqrt(E), but not within 1e-6
        {"scale": -0.25},
        {"extra": "dynamic_scale"},
    ],
    ids=["wrong_scale", "nearly_right_scale", "negative_scale", "dynamic_scale"],
)
def test_scale_declined(kwargs):
    prog = attention(**kwargs)
    check(prog, op_types(prog))


@pytest.mark.parametrize("opset", [ct.target.iOS16, ct.target.iOS17])
def test_old_opset_declined(opset):
    prog = attention(mask_form="add", opset=opset)
    check(prog, op_types(prog))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "scores_used"},
        {"extra": "probs_is_output"},
        {"axis": -2},  # softmax over the queries
        {"mask_form": "add", "mask_shape": (B, 1, L, 1)},  # the op's mask must end with S
        {"mask_form": "select_input"},  # runtime bool mask: a fully masked row cannot be ruled out
        {"mask_form": "select", "mask": ROW_MASKED},
        {"mask_form": "select", "fill": -1e4},  # exact only for scores above -1e4 + 745: policy declines
        {"mask_form": "select_inverted", "mask": ROW_MASKED},
    ],
    ids=[
        "scores_used_elsewhere",
        "probs_block_output",
        "softmax_axis",
        "mask_last_dim_1",
        "runtime_bool_mask",
        "fully_masked_row",
        "small_fill",
        "inverted_all_masked",
    ],
)
def test_declined(kwargs):
    prog = attention(**kwargs)
    check(prog, op_types(prog))


def test_rank3_fused_and_symbolic_batch():
    n = get_new_symbol()

    specs = [mb.TensorSpec(shape=(n, L, E)), mb.TensorSpec(shape=(n, S, E)), mb.TensorSpec(shape=(n, S, EV))]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v):
        scores = mb.mul(x=mb.matmul(x=q, y=k, transpose_y=True, name="qk"), y=0.25, name="scale")
        return mb.matmul(x=mb.softmax(x=scores, axis=2, name="probs"), y=v, name="out")

    check(prog, [SDPA])


def test_runs_right_before_fuse_elementwise_to_batchnorm():
    # docs/PASSES.md, "Pass order": the larger fusion first (tests/test_pass_order.py).
    assert PASS_REGISTRY[PASS] in PASS_REGISTRY["common::fuse_layernorm_or_instancenorm"].followers
    passes = ct.PassPipeline.DEFAULT.passes
    leader = passes.index("common::fuse_layernorm_or_instancenorm")
    assert passes[leader + 1] == "common::fuse_elementwise_to_batchnorm"


def _convert(model, args, override: bool, target=ct.target.iOS18):
    run_log(clear=True)
    prog = convert_torch(model, args, override=override, minimum_deployment_target=target)
    fired = sum(s.rewrites for pass_id, _, s in run_log(clear=True) if pass_id == PASS)
    counts = op_counts(prog)
    counts.pop("const", None)
    return prog, counts, fired


def _outputs(prog: Program, args) -> list[np.ndarray]:
    names = list(prog.functions["main"].inputs)
    return list(evaluate(prog, {n: a.numpy() for n, a in zip(names, args)}).values())


@pytest.mark.parametrize(
    ("builder", "n_attention", "removed"),
    [
        (prenorm_transformer, 2, {"matmul": 4, "softmax": 2}),
        (gpt2_block, 1, {"matmul": 2, "softmax": 1, "select": 1}),  # constant causal bool mask
        (bert_encoder, 2, {"matmul": 4, "softmax": 2}),  # additive mask input
    ],
    ids=["prenorm_transformer", "gpt2_block", "bert_encoder"],
)
def test_zoo_models_at_ios18(builder, n_attention, removed):
    model, args = builder()
    off, counts_off, _ = _convert(model, args, override=False)
    on, counts_on, fired = _convert(model, args, override=True)
    assert fired == n_attention
    assert counts_off[SDPA] == 0 and counts_on[SDPA] == n_attention
    for op_type, n in removed.items():
        assert counts_off[op_type] - counts_on[op_type] == n, op_type
    assert sum(counts_on.values()) < sum(counts_off.values())
    with torch.no_grad():
        expected = model(*args).numpy()
    for got_off, got_on in zip(_outputs(off, args), _outputs(on, args)):
        np.testing.assert_allclose(got_on, got_off, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_on, expected, rtol=1e-4, atol=1e-5)  # torch computes in float32
    assert_programs_equivalent(off, on, rtol=1e-5)


def test_prenorm_transformer_at_default_target_is_left_alone():
    model, args = prenorm_transformer()
    _, counts_on, fired = _convert(model, args, override=True, target=ct.target.iOS16)
    assert fired == 0 and counts_on[SDPA] == 0 and counts_on["softmax"] == 2


def test_fused_inside_a_nested_block():
    """The opset is read from the function around the block (here a ``cond`` branch)."""

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(B, H, L, E)),
            mb.TensorSpec(shape=(B, H, S, E)),
            mb.TensorSpec(shape=(B, H, S, E)),
            mb.TensorSpec(shape=(1,)),
        ],
        opset_version=ct.target.iOS18,
    )
    def prog(q, k, v, flag):
        def attend():
            scores = mb.mul(x=mb.matmul(x=q, y=k, transpose_y=True, name="qk"), y=0.25, name="scale")
            return mb.matmul(x=mb.softmax(x=scores, axis=-1, name="probs"), y=v, name="out")

        pred = mb.squeeze(x=mb.greater(x=flag, y=0.0, name="gt"), name="pred")
        return mb.cond(pred=pred, _true_fn=attend, _false_fn=lambda: mb.relu(x=q, name="skip"), name="cond")

    ours = run_pass(PASS, prog)
    (cond,) = ours.functions["main"].find_ops(op_type="cond")
    assert [op.op_type for op in cond.blocks[0].operations if op.op_type != "const"] == [SDPA]
    for flag in (1.0, -1.0):
        inputs = {
            "q": RNG.standard_normal((B, H, L, E)),
            "k": RNG.standard_normal((B, H, S, E)),
            "v": RNG.standard_normal((B, H, S, E)),
            "flag": np.array([flag]),
        }
        assert_programs_equivalent(prog, ours, inputs=inputs, rtol=1e-5)


# -- flexible lengths: the attention step of a KV-cache decoder (pattern_infra.testing.cached_attention) --


def _cached_inputs(
    heads: int, length: int, cache_len: int, other_len: int | None = None
) -> dict[str, np.ndarray]:
    from pattern_infra.testing.cached_attention import CACHE, HEAD_DIM, KV_HEADS

    return {
        "q": RNG.standard_normal((1, heads, length, HEAD_DIM)),
        "k_cache": RNG.standard_normal((1, KV_HEADS, CACHE, HEAD_DIM)),
        "v_cache": RNG.standard_normal((1, KV_HEADS, CACHE, HEAD_DIM)),
        "mask": RNG.standard_normal((1, 1, length, cache_len)),
        "other": np.zeros((1, cache_len if other_len is None else other_len)),
    }


def test_flexible_cache_slice_fused_when_its_length_is_proven_the_mask_s():
    """Keys: the cache sliced to ``end = shape(mask)[3]``, repeated by a tile of run-time reps and reshaped
    to ``[1, H, -1, E]``, each with fresh symbols; proven equal to the mask's length ``S`` from the slice
    (``0 <= 0 <= S <= 15 <= 16``: the declared range), the reps (``S / S``) and the reshape."""
    from pattern_infra.testing.cached_attention import cached_attention

    prog = cached_attention()
    ours = run_pass(PASS, prog)
    assert SDPA in op_types(ours) and "softmax" not in op_types(ours) and "matmul" not in op_types(ours)
    for length, cache_len in ((3, 5), (1, 6), (15, 15)):
        assert_programs_equivalent(prog, ours, inputs=_cached_inputs(4, length, cache_len), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [{"bounded": False}, {"mask_length": "other"}],
    ids=["slice_end_not_proven_within_the_cache", "mask_of_a_different_length"],
)
def test_flexible_near_misses_left_alone(kwargs):
    """Without declared ranges ``S <= 16`` is not proven (the slice may clamp); with the keys sliced to
    another input's length, the mask's ``S`` and the keys' length are different symbols, never equal."""
    from pattern_infra.testing.cached_attention import cached_attention

    prog = cached_attention(**kwargs)
    assert op_types(run_pass(PASS, prog)) == op_types(prog)


# -- one K/V head broadcast by the matmuls (multi-query attention written out, Falcon's eager path) ------


@pytest.mark.parametrize("key_form", ["transpose", "merged", "transpose_y"])
def test_broadcast_kv_tiled_for_the_op_then_folded_as_multi_query(key_form):
    prog = attention(key_form, "select", kv_heads=1)
    alone = run_pass(PASS, prog)
    assert op_types(alone).count("tile") == 2 and SDPA in op_types(alone)  # the broadcast made explicit
    assert_programs_equivalent(prog, alone, rtol=1e-5)
    ours = run_pass(PASS, prog, followers=True)
    assert "tile" not in op_types(ours) and op_types(ours)[-3:] == [SDPA, "reshape", "relu"], op_types(ours)
    assert_programs_equivalent(prog, ours, rtol=1e-5)


def test_broadcast_over_a_symbolic_head_count_left_alone():
    specs = [
        mb.TensorSpec(shape=(B, get_new_symbol(), L, E)),
        mb.TensorSpec(shape=(B, 1, S, E)),
        mb.TensorSpec(shape=(B, 1, S, EV)),
    ]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(q, k, v):
        scores = mb.mul(x=mb.matmul(x=q, y=k, transpose_y=True), y=np.float32(0.25))
        return mb.relu(x=mb.matmul(x=mb.softmax(x=scores, axis=-1), y=v))

    assert op_types(run_pass(PASS, prog)) == op_types(prog)
