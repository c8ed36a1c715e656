"""``generic::fuse_grouped_kv_attention``: grouped-KV attention without repeating K and V (iOS18+).

Grouped-query attention (Llama, Mistral, Qwen2, Gemma, ...) has ``H = Hkv * G`` query heads and ``Hkv``
key/value heads. ``transformers``' ``repeat_kv`` repeats each K/V head ``G`` times so that every query
head has its own copy, and coremltools converts it to three ops per tensor; ``scaled_dot_product_attention``
(iOS18) needs equal batch dimensions for Q, K and V, so the repeated tensors are what
``generic::fuse_sdpa`` feeds it.

Math. Query head ``h = j * G + g`` (``j < Hkv``, ``g < G``) attends to K/V head ``j``. Reshaping Q
``(B, Hkv*G, L, E)`` to ``(B, Hkv, G*L, E)`` puts the ``G`` query heads of K/V head ``j`` one after the
other along the sequence axis (row ``g * L + l``), and attention works row by row: each row is scored
against the same ``S`` keys, masked by the same mask row, normalised by the same softmax and mixes the same
values as before. So::

    sdpa(Q, repeat(K), repeat(V), M) = reshape(sdpa(reshape(Q, [B, Hkv, G*L, E]), K, V, M'), [B, H, L, Ev])

with ``M'`` the mask rows in the same order: a mask with neither head nor query axis (``[.., 1, 1, S]``)
is kept; a mask shared by the heads (``[.., 1, L, S]``) is repeated ``G`` times along the query axis; a
per-head mask (``[.., H, L, S]``) is reshaped to ``[.., Hkv, G*L, S]``. Every row is computed with the
same arithmetic as before: the rewrite is exact (checked with the evaluator), and K/V are never copied.

Pattern (``k``, ``v`` of shape ``[B, Hkv, S, E]``; the three ops of ``repeat_kv`` on each)::

    k --> expand_dims(axes=[2]) --> tile(reps=[1, 1, G, 1, 1]) --> reshape([B, H, S, E]) --|
    v --> expand_dims(axes=[2]) --> tile(reps=[1, 1, G, 1, 1]) --> reshape([B, H, S, Ev]) -|
    q ------------------------------------------------------------------------------> scaled_dot_product_attention --> y
                                                                          [attn_mask] --^

becomes::

    q --> reshape([B, Hkv, G*L, E]) --> scaled_dot_product_attention(., k, v, [M']) --> reshape([B, H, L, Ev]) --> y

7 ops become 3 (4 when a runtime mask shared by the heads needs its ``tile``; a constant mask is
repeated at compile time). Shapes must be static (the reshapes name every dimension); a per-head mask
without a query axis (``[.., H, 1, S]``) that is not a constant is left alone.

Runs right after ``generic::fuse_sdpa`` (which makes the ``scaled_dot_product_attention``), override on.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

import generic_passes.fuse_sdpa  # noqa: F401  (registers generic::fuse_sdpa, which this pass follows)
from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["grouped_kv_pattern", "grouped_kv_constraints", "transform_grouped_kv"]

_Q = (1, 4, 3, 8)
_KV = (1, 2, 5, 8)


def grouped_kv_pattern(masked: bool) -> Program:
    """The pattern, with or without ``attn_mask``; ops ``{k,v}_expand``, ``{k,v}_tile``, ``{k,v}_reshape``, ``sdpa``."""

    def body(q: Var, k: Var, v: Var, mask: Var | None) -> Var:
        repeated = []
        for name, t in (("k", k), ("v", v)):
            e = mb.expand_dims(x=t, axes=[2], name=f"{name}_expand")
            r = mb.tile(x=e, reps=[1, 1, 2, 1, 1], name=f"{name}_tile")
            repeated.append(mb.reshape(x=r, shape=[1, 4, 5, 8], name=f"{name}_reshape"))
        kwargs = {} if mask is None else {"attn_mask": mask}
        return mb.scaled_dot_product_attention(query=q, key=repeated[0], value=repeated[1], name="sdpa", **kwargs)

    import coremltools as ct

    specs = [mb.TensorSpec(shape=_Q), mb.TensorSpec(shape=_KV), mb.TensorSpec(shape=_KV)]
    if masked:

        @mb.program(input_specs=[*specs, mb.TensorSpec(shape=(1, 1, 3, 5))], opset_version=ct.target.iOS18)
        def grouped_kv_masked(q, k, v, mask):
            return body(q, k, v, mask)

        return grouped_kv_masked

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def grouped_kv(q, k, v):
        return body(q, k, v, None)

    return grouped_kv


def _static(var: Var) -> tuple[int, ...] | None:
    shape = var.shape
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _repeat_groups(pattern: Pattern, name: str) -> int | None:
    """``G`` when ``{name}_expand/tile/reshape`` repeat each head of a ``[B, Hkv, S, E]`` tensor G times."""
    expand, tile, reshape = (pattern.ops[f"{name}_{op}"] for op in ("expand", "tile", "reshape"))
    src = _static(expand.x)
    if src is None or len(src) != 4 or not predicates.axes_are(expand.axes, 5, [2]):
        return None
    if not predicates.is_constant(tile.reps):
        return None
    reps = [int(r) for r in np.atleast_1d(tile.reps.val)]
    if len(reps) != 5 or reps[:2] != [1, 1] or reps[3:] != [1, 1] or reps[2] < 2:
        return None
    b, hkv, s, e = src
    if _static(reshape.outputs[0]) != (b, hkv * reps[2], s, e):
        return None
    return reps[2]


def _new_mask(mask: Var, q: tuple[int, ...], hkv: int, groups: int) -> tuple[str, np.ndarray | None] | None:
    """How the mask reaches the folded attention: ("keep"|"tile"|"reshape", constant value or None)."""
    shape = _static(mask)
    if shape is None or len(shape) > 4:
        return None
    b, h, l, _ = q
    full = (1,) * (4 - len(shape)) + shape
    mb_, mh, ml, ms = full
    value = np.asarray(mask.val) if predicates.is_constant(mask) and not predicates.is_constexpr(mask) else None
    if mh == 1 and ml == 1:
        return "keep", None
    if mh == 1 and ml == l:
        return "tile", None if value is None else np.tile(value.reshape(full), (1, 1, groups, 1))
    if mh == h and ml in (1, l) and (ml == l or value is not None):
        if value is None:
            return "reshape", None
        return "reshape", np.broadcast_to(value.reshape(full), (mb_, h, l, ms)).reshape(mb_, hkv, groups * l, ms)
    return None


def grouped_kv_constraints(pattern: Pattern) -> bool:
    """K and V repeated by the same ``G`` from ``Hkv`` heads, Q with ``Hkv * G`` heads, static shapes."""
    sdpa = pattern.sdpa
    q = _static(sdpa.query)
    groups_k, groups_v = _repeat_groups(pattern, "k"), _repeat_groups(pattern, "v")
    if q is None or len(q) != 4 or groups_k is None or groups_k != groups_v:
        return False
    hkv = _static(pattern.k_expand.x)[1]
    if q[1] != hkv * groups_k or _static(pattern.v_expand.x)[1] != hkv:
        return False
    if _static(sdpa.outputs[0]) is None:
        return False
    plan = None
    if sdpa.inputs.get("attn_mask") is not None:
        plan = _new_mask(sdpa.attn_mask, q, hkv, groups_k)
        if plan is None:
            return False
    pattern.add_attribute("mask_plan", plan)
    pattern.add_attribute("kv_groups", groups_k)
    pattern.add_attribute("kv_heads", hkv)
    return True


def transform_grouped_kv(pattern: Pattern) -> None:
    """Q folded to ``[B, Hkv, G*L, E]``, attention on the unrepeated K/V, the result unfolded."""
    sdpa = pattern.sdpa
    name = sdpa.outputs[0].name
    b, h, l, e = _static(sdpa.query)
    out_shape = _static(sdpa.outputs[0])
    hkv, groups = pattern.kv_heads, pattern.kv_groups
    query = mb.reshape(x=sdpa.query, shape=[b, hkv, groups * l, e], name=f"{name}_query_folded", before_op=sdpa)
    kwargs = {}
    if pattern.mask_plan is not None:
        how, value = pattern.mask_plan
        mask = sdpa.attn_mask
        full = (1,) * (4 - mask.rank) + _static(mask)
        if value is not None:
            mask = mb.const(val=value, name=f"{name}_mask_folded", before_op=sdpa)
        elif how == "tile":
            mask = mb.tile(x=mb.reshape(x=mask, shape=list(full), before_op=sdpa) if mask.rank != 4 else mask,
                           reps=[1, 1, groups, 1], name=f"{name}_mask_folded", before_op=sdpa)
        elif how == "reshape":
            mask = mb.reshape(x=mask, shape=[full[0], hkv, groups * l, full[3]], name=f"{name}_mask_folded",
                              before_op=sdpa)
        kwargs["attn_mask"] = mask
    folded = mb.scaled_dot_product_attention(query=query, key=pattern.k_expand.x, value=pattern.v_expand.x,
                                             name=f"{name}_folded", before_op=sdpa, **kwargs)
    out = mb.reshape(x=folded, shape=list(out_shape), name=name, before_op=sdpa)
    pattern.replace_output(out)


register_generic_pass(
    ops_arrangement=[grouped_kv_pattern(True), grouped_kv_pattern(False)],
    var_constraints=grouped_kv_constraints,
    transform_pattern=transform_grouped_kv,
    pass_name="fuse_grouped_kv_attention",
    namespace="generic",
    const_rules={"k_expand.axes": "const", "v_expand.axes": "const", "k_tile.reps": "const",
                 "v_tile.reps": "const", "k_reshape.shape": "const", "v_reshape.shape": "const"},
    name="grouped_kv_attention",
    run_after="generic::fuse_sdpa",
)
