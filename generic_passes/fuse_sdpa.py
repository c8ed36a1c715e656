"""``generic::fuse_sdpa``: written-out attention into one ``scaled_dot_product_attention`` (iOS18+).

Every transformer of the zoo writes attention out, ``softmax(Q @ K^T * scale [+ mask]) @ V``, and
coremltools 9.0 only emits its ``scaled_dot_product_attention`` op for ``F.scaled_dot_product_attention``
calls, so the four to five ops stay. The op exists from opset iOS18 on; this pass declines every match in
a function of an older opset (the zoo converts at iOS16: convert with
``minimum_deployment_target=coremltools.target.iOS18`` to get it).

Math. ``scaled_dot_product_attention(Q, K, V, mask)`` (``.../ops/defs/iOS18/transformers.py``) computes::

    softmax(Q @ K^T / sqrt(E) + mask, axis=-1) @ V        E = Q.shape[-1]

with an additive float ``mask``, or, for a bool ``mask``, with ``-inf`` where the mask is False and
``0`` where it is True. Q, K, V have one rank >= 3 and the same batch dimensions (no broadcasting);
the mask broadcasts to ``[*batch, L, S]`` and its last dimension is ``S``.

* Scale. The op has no scale argument: its scale is ``1 / sqrt(E)``. A ``mul`` constant ``c`` is taken
  as is when ``|c * sqrt(E) - 1| <= 1e-6``, or the constant's own rounding error when larger (``2**-11``
  for a float16 constant: ``1 / sqrt(128)`` is ``0.08837890625`` in a model saved at float16, a
  relative ``1.1e-4`` from the real number, which the conversion's float32 constant is not). Otherwise
  ``f = c * sqrt(E)`` is folded into ``Q`` when that is exact in floating point: ``f`` a power of two
  (within the same tolerance), so ``Q * f`` only
  changes exponents, and ``(Q * f) @ K^T / sqrt(E)`` is ``c * (Q @ K^T)`` up to the rounding of the
  final scaling, as in the original. Any other constant is declined: folding it would add a rounding
  step the original does not have.
* Additive mask: ``scores * c + mask`` is the op's ``... + mask`` when ``mask`` is float, broadcasts to
  the scores without enlarging them and has ``S`` as last dimension.
* Bool mask, as ``select(mask, scores, fill)`` (``torch.where(mask, attn, finfo.min)``, GPT-2) or
  ``select(mask, fill, scores)`` (``masked_fill(mask, fill)``, becomes the mask ``not mask``). The op
  puts ``-inf`` where the original puts ``fill``: masked scores weigh ``exp(fill - max)`` instead of
  ``0``, which is exactly ``0`` in float32 and float64 once ``fill <= -1e9`` (:data:`MASK_FILL_MAX`)
  and the row's largest kept score is above ``fill + 745``. A row with no kept score would differ
  (uniform weights against NaN), so the mask must be a compile-time constant with at least one True
  in every row. Runtime bool masks are declined.

Patterns (``*`` = ``mul``, ``+`` = ``add``; ``key_t`` any ``transpose``, the two forms of ``K^T`` that
reach the pass: after ``merge_consecutive_transposes`` the head split and ``K^T`` are one transpose
``perm=[0, 2, 3, 1]``, after ``fuse_transpose_matmul`` it is ``matmul(transpose_y=True)``)::

    Key form "transpose":

        k --> transpose(perm) --> kT --|
        q ---------------------------> matmul --> * c --> [mask] --> softmax(-1) --> matmul --> y
                                                                                  v --^

    Key form "transpose_y":

        q, k --> matmul(transpose_y=True) --> * c --> [mask] --> softmax(-1) --> matmul(., v) --> y

    [mask] is one of: nothing; ``+ mask``; ``select(cond=mask, a=., b=fill)``;
    ``select(cond=mask, a=fill, b=.)``. All eight patterns become:

        q --> [* f] --|
        k --> [transpose(perm with its last two axes swapped)] --> scaled_dot_product_attention --> y
        v ------------|                                            ^ [attn_mask]

Scale form "query" (coremltools' decomposition of ``F.scaled_dot_product_attention`` with a float mask,
e.g. ``transformers``' sdpa attention below iOS18's op conditions): the ``mul`` by ``c`` is on Q, before
the first ``matmul``: ``(q * c) @ K^T`` is ``c * (Q @ K^T)`` up to where the product is rounded, the same
reassociation the power-of-two folding below makes exactly; the patterns above are spelled again in
that form. The 32 spellings (4 scale forms x 2 key forms x 4 mask forms) are one registration, a pattern
of 32 programs searched through one merged plan tree per anchor (``softmax``, ``qk`` or ``pv``).

Broadcast K and V (multi-query attention written out, Falcon's eager attention): one K/V head
``[B, 1, S, E]`` against ``H`` query heads, which both ``matmul`` broadcast. The op needs equal batch
dimensions, so K and V are tiled to them, which is what the broadcast computes (exact); the ``tile``
reps are ``[1, H, 1, 1]``, the multi-query form ``generic::fuse_grouped_kv_attention`` folds away right
after this pass (Q reshaped to ``[B, 1, H*L, E]``, K and V never repeated)::

    q [B, H, L, E], k [B, 1, S, E] --> matmul(transpose_y=True) --> * c --> [mask] --> softmax
        --> matmul(., v [B, 1, S, Ev])

    becomes    k --> tile([1, H, 1, 1]) --|
               v --> tile([1, H, 1, 1]) --|--> scaled_dot_product_attention --> y      (then folded, G = H)
               q -------------------------|

Only a static dimension of 1 against a static one is broadcast; a symbolic one is declined.

Flexible lengths. The shapes above are compared dimension by dimension, and a symbolic dimension is
what the program's shape ops prove it to be (:mod:`generic_passes._shape_proof`), never a symbol taken
for another. In a KV-cache decoder converted with flexible query and cache lengths (``L``, ``S``), the
keys are the cache sliced up to ``end = gather(shape(mask), 3)``, repeated and reshaped, and every op
on the way gives its output fresh symbols::

    mask [1, 1, L, S] --> shape --> gather(3) --> concat --> slice_by_index(cache, end=.)
        --> [1, Hkv, is96, E] --> expand_dims --> tile(reps computed from shape(.))
        --> reshape([1, H, -1, E]) --> [1, H, is97*.../32, E]
    q [1, H, L, E] --> matmul(., keys, transpose_y=True) --> [1, H, L, is97*.../32] --> * c --> + mask --> ...

The keys' length is proven ``S``, the mask's: the slice's length is ``end - 0 = S`` because ``0 <= S <= 15
<= 16`` (the cache's size, and the range declared for ``S`` by the flexible input, which the runtime
enforces: without a declared range the slice might be clamped, and the pass declines); the tile
multiplies it by ``S / S = 1``; the reshape divides the element count by the other sizes. A mask whose
length comes from elsewhere (another input's) stays a different symbol and is declined.

``* f`` appears only when the scale is folded into Q, the transpose only when the swapped ``perm`` is
not the identity (then it replaces the old one). The op takes the name of the last ``matmul``'s output
and is inserted before it (the only place where Q, K, V and the mask are all defined). coremltools has
no such pass, so this one runs as a new pass right after ``common::fuse_layernorm_or_instancenorm`` while
``ENABLE_EXPERIMENTAL_PASSES=1``: the scale is a ``mul`` by then (``divide_to_multiply``), masks are
constants (``const_elimination``), and ``add_fp16_cast`` has not yet run. That is before
``common::fuse_elementwise_to_batchnorm``, which would turn the scale and a per-head bias of ``[B, H, 1,
1]`` scores (LeViT at resolution 1) into a ``batch_norm`` and leave the attention unfused (docs/PASSES.md,
"Pass order"). The head split and ``K^T`` are then often still two transposes: ``key_t`` is the second,
whose swapped ``perm`` is the identity, so none is added and K is the head split's output.
"""

from __future__ import annotations

import math

import numpy as np
from coremltools import target
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Program, Var

from generic_passes._shape_proof import ShapeFacts, function_of
from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = [
    "KEY_FORMS",
    "MASK_FORMS",
    "MASK_FILL_MAX",
    "SCALE_FORMS",
    "SCALE_RTOL",
    "attention_pattern",
    "sdpa_constraints",
    "transform_sdpa",
]

KEY_FORMS: tuple[str, ...] = ("transpose", "transpose_y")
"""How ``K^T`` reaches the first ``matmul``: a ``transpose`` op, or ``matmul(transpose_y=True)``."""

MASK_FORMS: tuple[str, ...] = ("none", "add", "select", "select_inverted")
"""No mask, an additive mask, ``select(mask, scores, fill)``, ``select(mask, fill, scores)``."""

SCALE_FORMS: tuple[str, ...] = ("scores", "query", "query_transposed", "none")
"""Where the scale is applied: to the scores ``(Q @ K^T) * c``; to the query ``(Q * c) @ K^T``
(coremltools' own decomposition of ``F.scaled_dot_product_attention``); to the query before its head
transpose ``transpose(Q * c) @ K^T`` (the same after coremltools moved the ``mul`` above the transpose);
nowhere (the scale folded into the query projection's weights, as in Whisper)."""

MASK_FILL_MAX = -1e9
"""A ``select`` fill must be at most this: ``exp(fill - max)`` is then exactly 0 (see the docstring)."""

SCALE_RTOL = 1e-6
"""Relative tolerance on the scale: ``c * sqrt(E)`` against 1, or against a power of two."""

# Shapes of the pattern programs: they only make the patterns build (q, k, v [1, 2, 3, 4], scores
# [1, 2, 3, 3]); the constraints decide on the program's shapes.
_QKV = (1, 2, 3, 4)
_MASK = (1, 1, 1, 3)
_COND = np.ones((1, 1, 3, 3), dtype=bool)


def attention_pattern(key_form: str, mask_form: str, scale_form: str = "scores") -> Program:
    """The pattern program of one key form, one mask form and one scale form (see the module docstring).

    Args:
        key_form: One of :data:`KEY_FORMS`.
        mask_form: One of :data:`MASK_FORMS`.
        scale_form: One of :data:`SCALE_FORMS`.

    Returns:
        The pattern, ops named ``key_t`` (key form "transpose"), ``qk``, ``scale``, ``mask_add`` or
        ``mask_select`` (with a mask), ``softmax`` and ``pv``.
    """

    def body(q: Var, k: Var, v: Var, mask: Var | None) -> Var:
        if scale_form.startswith("query"):
            q = mb.mul(x=q, y=0.5, name="scale")
        if scale_form == "query_transposed":
            q = mb.transpose(x=q, perm=[0, 1, 3, 2], name="query_t")
        if key_form == "transpose":
            kt = mb.transpose(x=k, perm=[0, 1, 3, 2], name="key_t")
            qk = mb.matmul(x=q, y=kt, transpose_x=False, transpose_y=False, name="qk")
        else:
            qk = mb.matmul(x=q, y=k, transpose_x=False, transpose_y=True, name="qk")
        scores = mb.mul(x=qk, y=0.5, name="scale") if scale_form == "scores" else qk
        if mask_form == "add":
            scores = mb.add(x=scores, y=mask, name="mask_add")
        elif mask_form == "select":
            scores = mb.select(cond=_COND, a=scores, b=-1e38, name="mask_select")
        elif mask_form == "select_inverted":
            scores = mb.select(cond=_COND, a=-1e38, b=scores, name="mask_select")
        probs = mb.softmax(x=scores, axis=-1, name="softmax")
        return mb.matmul(x=probs, y=v, transpose_x=False, transpose_y=False, name="pv")

    q_shape = _QKV[:2] + _QKV[:1:-1] if scale_form == "query_transposed" else _QKV
    specs = [mb.TensorSpec(shape=q_shape), mb.TensorSpec(shape=_QKV), mb.TensorSpec(shape=_QKV)]
    if mask_form == "add":

        @mb.program(input_specs=[*specs, mb.TensorSpec(shape=_MASK)])
        def attention_with_mask(q, k, v, mask):
            return body(q, k, v, mask)

        return attention_with_mask

    @mb.program(input_specs=specs)
    def attention(q, k, v):
        return body(q, k, v, None)

    return attention


def _shape(pattern: Pattern, var: Var) -> tuple | None:
    """``var``'s dimensions, symbolic ones as what the program's shape ops prove them to be."""
    return ShapeFacts.of(pattern.block).dims(var)


def _normalized_perm(perm: Var, rank: int) -> list[int] | None:
    if not predicates.is_constant(perm):
        return None
    values = [int(p) % rank for p in np.atleast_1d(perm.val)]
    return values if sorted(values) == list(range(rank)) else None


def _key_perm(pattern: Pattern) -> list[int] | None:
    """The perm giving K from the transpose's input: its perm with the last two entries swapped."""
    op = pattern.key_t
    perm = _normalized_perm(op.perm, op.x.rank)
    if perm is None or len(perm) < 2:
        return None
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return perm


def _key_shape(pattern: Pattern) -> tuple | None:
    """Shape of K ``[*batch, S, E]`` as the op will see it."""
    if "key_t" in pattern.ops:
        kt = _shape(pattern, pattern.key_t.outputs[0])
        return None if kt is None or len(kt) < 2 else kt[:-2] + (kt[-1], kt[-2])
    return _shape(pattern, pattern.qk.y)


def _fits(mask: tuple | None, scores: tuple) -> bool:
    """``mask`` broadcasts to ``scores`` without enlarging it and ends with ``scores``' last dim."""
    if mask is None or len(mask) > len(scores) or not mask or mask[-1] != scores[-1]:
        return False
    return all(m == 1 or m == s for m, s in zip(reversed(mask), reversed(scores)))


def _scale_factor(pattern: Pattern, embed: int) -> float | str:
    """1.0 when the scale is ``1/sqrt(E)``; a power of two to fold into Q; else the reason to decline.

    The tolerance is :data:`SCALE_RTOL`, or the scale's dtype's rounding error when larger: a float16
    ``1/sqrt(128)`` is ``0.08837890625``, 1.1e-4 of it away from the real number.
    """
    value, rtol = np.ones(()), SCALE_RTOL
    if "scale" in pattern.ops:
        scale = pattern.operand("scale", "y")
        if not predicates.is_constant(scale) or predicates.is_constexpr(scale):
            return "the scale is not a constant"
        value = np.asarray(scale.val)
        if value.size != 1:
            return f"the scale has {value.size} elements, not one"
        if _shape(pattern, pattern.scale.outputs[0]) != _shape(pattern, pattern.operand("scale", "x")):
            return "the scale broadcasts the scores to another shape"
        rtol = predicates.dtype_rtol(scale, SCALE_RTOL)
    factor = float(value.reshape(())) * math.sqrt(embed)
    if not factor > 0.0 or not math.isfinite(factor):
        return f"the scale {float(value.reshape(()))} is not a positive number"
    power = 2.0 ** round(math.log2(factor))
    if abs(factor - power) > rtol * power:
        return (
            f"the scale {float(value.reshape(())):.9g} is neither 1/sqrt({embed}) nor a power of two "
            f"times it (rtol {rtol:.3g})"
        )
    return power


def _scores(pattern: Pattern) -> Var:
    """The scaled scores ``Q @ K^T * c``, the var the mask is applied to."""
    if "scale" in pattern.ops and pattern.operand("scale", "x") is pattern.qk.outputs[0]:
        return pattern.scale.outputs[0]
    return pattern.qk.outputs[0]


def _query(pattern: Pattern, before: Operation) -> Var:
    """Q without the scale: ``qk.x``, the ``mul``'s input, or that input transposed like the original."""
    if "scale" not in pattern.ops or _scores(pattern) is pattern.scale.outputs[0]:
        return pattern.qk.x
    query = pattern.operand("scale", "x")
    if "query_t" in pattern.ops:
        query = mb.transpose(
            x=query, perm=pattern.query_t.perm, name=pattern.query_t.outputs[0].name, before_op=before
        )
    return query


def _mask_problem(pattern: Pattern, scores: tuple) -> str | None:
    """Why the mask cannot be the op's ``attn_mask`` (None: it can, or there is none)."""
    if "mask_add" in pattern.ops:
        mask = pattern.operand("mask_add", "y")
        if not predicates.dtype_is(mask, "fp16", "fp32"):
            return "the additive mask is not fp16 or fp32"
        mask_shape = _shape(pattern, mask)
        if mask_shape is None or not _fits(mask_shape, scores):
            return f"the mask of shape {mask_shape} does not broadcast to the scores {scores}"
        if _shape(pattern, pattern.mask_add.outputs[0]) != scores:
            return "adding the mask enlarges the scores"
        return None
    if "mask_select" in pattern.ops:
        op = pattern.mask_select
        inverted = op.b is _scores(pattern)
        fill = op.a if inverted else op.b
        cond = op.cond
        if not predicates.is_constant(cond) or not predicates.is_constant(fill):
            return "the bool mask or its fill is not a compile-time constant"
        if predicates.is_constexpr(cond) or predicates.is_constexpr(fill):
            return "the bool mask or its fill is a constexpr"
        if _shape(pattern, op.outputs[0]) != scores or not _fits(_shape(pattern, cond), scores):
            return "the bool mask does not broadcast to the scores"
        if not np.all(np.asarray(fill.val, dtype=np.float64) <= MASK_FILL_MAX):
            return f"the select fill is above {MASK_FILL_MAX:g}"
        keep = np.asarray(cond.val, dtype=bool)
        keep = ~keep if inverted else keep
        if not np.all(np.any(keep, axis=-1)):
            return "a row of the bool mask keeps no score"
    return None


def sdpa_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """iOS18+, the shapes and dtypes the op accepts, softmax on the last axis, scale and mask as above.

    Returns:
        True, or ``(False, reason)``.
    """
    opset = function_of(pattern.block).opset_version
    if opset is None or opset < target.iOS18:
        return False, "needs iOS18 or later (scaled_dot_product_attention)"
    qk, pv = pattern.qk, pattern.pv
    want_ty = "key_t" not in pattern.ops
    if not (
        predicates.attr_is(qk, "transpose_x", False)
        and predicates.attr_is(qk, "transpose_y", want_ty)
        and predicates.attr_is(pv, "transpose_x", False)
        and predicates.attr_is(pv, "transpose_y", False)
    ):
        return False, "the matmuls transpose other operands than K"
    if "key_t" in pattern.ops and _key_perm(pattern) is None:
        return False, "the transpose of K is not a constant permutation"
    q, key, v = _shape(pattern, qk.x), _key_shape(pattern), _shape(pattern, pv.y)
    if q is None or key is None or v is None or not len(q) == len(key) == len(v) >= 3:
        return False, "Q, K and V are not of one rank >= 3"
    if key[:-2] != v[:-2] or q[-1] != key[-1] or key[-2] != v[-2]:
        return False, f"the shapes of Q {q}, K {key} and V {v} do not fit"
    reps = _broadcast_reps(q[:-2], key[:-2])
    if reps is None:
        return False, f"K's batch dimensions {key[:-2]} do not broadcast to Q's {q[:-2]}"
    if not q[-1].is_Integer:
        return False, "the head size is symbolic (needed to compare the scale with 1/sqrt(E))"
    operands = (qk.x, qk.y, pv.y)
    if len({var.dtype for var in operands}) != 1 or not predicates.dtype_is(qk.x, "fp16", "fp32"):
        return False, "Q, K and V are not all fp16 or all fp32"
    if not predicates.axes_are(pattern.softmax.axis, len(q), [len(q) - 1]):
        return False, "the softmax is not over the last axis"
    factor = _scale_factor(pattern, int(q[-1]))
    if isinstance(factor, str):
        return False, factor
    scores = q[:-1] + (key[-2],)
    if _shape(pattern, qk.outputs[0]) != scores:
        return False, "Q @ K^T broadcasts to another shape"
    problem = _mask_problem(pattern, scores)
    if problem is not None:
        return False, problem
    pattern.add_attribute("query_factor", factor)
    pattern.add_attribute("kv_reps", reps)
    return True


def _broadcast_reps(query_batch: tuple, kv_batch: tuple) -> list[int] | None:
    """The reps that tile K and V to Q's batch dims: all ones when they are equal; ``q / 1`` where the
    ``matmul`` broadcasts a K/V dim of 1 (a static one) over Q's; None when the matmul does not."""
    reps = []
    for qd, kd in zip(query_batch, kv_batch):
        if qd == kd:
            reps.append(1)
        elif kd == 1 and qd.is_Integer:
            reps.append(int(qd))
        else:
            return None
    return reps


def transform_sdpa(pattern: Pattern) -> None:
    """Inserts the op (with the Q scaling, K transpose or inverted mask it needs) before the last matmul."""
    pv = pattern.pv
    name = pv.outputs[0].name
    query = _query(pattern, pv)
    if pattern.query_factor != 1.0:
        factor = pattern.const_like(pattern.query_factor, like=query, before_op=pv)
        query = mb.mul(x=query, y=factor, name=f"{name}_query", before_op=pv)
    if "key_t" in pattern.ops:
        key, perm = pattern.key_t.x, _key_perm(pattern)
        assert perm is not None, "sdpa_constraints refused a key transpose of no known perm"
        if perm != list(range(len(perm))):
            key = mb.transpose(x=key, perm=perm, name=pattern.key_t.outputs[0].name, before_op=pv)
    else:
        key = pattern.qk.y
    mask: Var | None = None
    if "mask_add" in pattern.ops:
        mask = pattern.operand("mask_add", "y")
    elif "mask_select" in pattern.ops:
        op = pattern.mask_select
        mask = op.cond
        if op.b is _scores(pattern):  # select(mask, fill, scores): keep where mask is False
            mask = mb.const(
                val=np.logical_not(np.asarray(op.cond.val, dtype=bool)), name=f"{name}_mask", before_op=pv
            )
    kwargs = {} if mask is None else {"attn_mask": mask}
    value = pv.y
    if any(r != 1 for r in pattern.kv_reps):  # the matmuls' broadcast, made explicit: the op needs it
        reps = [*pattern.kv_reps, 1, 1]
        key = mb.tile(x=key, reps=reps, name=f"{name}_key_heads", before_op=pv)
        value = mb.tile(x=value, reps=reps, name=f"{name}_value_heads", before_op=pv)
    fused = mb.scaled_dot_product_attention(
        query=query, key=key, value=value, name=name, before_op=pv, **kwargs
    )
    pattern.replace_output(fused)


def _name(key_form: str, mask_form: str, scale_form: str) -> str:
    suffix = "" if scale_form == "scores" else f", {scale_form}"
    return f"sdpa[{key_form}, {mask_form}{suffix}]"


register_generic_pass(
    # one pattern of 32 spellings, in this order: the scale forms outermost (the query scaled before the
    # plain one: "none" also matches around a query "mul"), the key forms, then the mask forms
    ops_arrangement={
        _name(key_form, mask_form, scale_form): attention_pattern(key_form, mask_form, scale_form)
        for scale_form in SCALE_FORMS
        for key_form in KEY_FORMS
        for mask_form in MASK_FORMS
    },
    var_constraints=sdpa_constraints,
    transform_pattern=transform_sdpa,
    pass_name="fuse_sdpa",
    namespace="generic",
    # a rule applies where a spelling has that constant: mask_select.b in "select", .a in "select_inverted"
    const_rules=dict.fromkeys(
        (
            "qk.transpose_x",
            "qk.transpose_y",
            "pv.transpose_x",
            "pv.transpose_y",
            "softmax.axis",
            "scale.y",
            "query_t.perm",
            "key_t.perm",
            "mask_select.cond",
            "mask_select.a",
            "mask_select.b",
        ),
        "const",
    ),
    name="sdpa",
    run_after="common::fuse_layernorm_or_instancenorm",
)
