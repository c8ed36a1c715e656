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

Patterns (``k``, ``v`` of shape ``[B, Hkv, S, E]``)::

    Grouped form (repeat_kv: expand_dims -> tile -> reshape on each of K and V):

    k --> expand_dims(axes=[2]) --> tile(reps=[1, 1, G, 1, 1]) --> reshape([B, H, S, E]) --|
    v --> expand_dims(axes=[2]) --> tile(reps=[1, 1, G, 1, 1]) --> reshape([B, H, S, Ev]) -|
    q -------------------------------------------------------------------------> sdpa --> y
                                                                     [attn_mask] --^
    (sdpa: scaled_dot_product_attention)

    Multi-query form (Falcon: one K/V head, Hkv = 1, expanded to the H query heads; G = H):

    k --> tile(reps=[1, H, 1, 1]) --|
    v --> tile(reps=[1, H, 1, 1]) --|
    q ----------------------------> scaled_dot_product_attention --> y

    Run-time reps (either form, a flexible-shape conversion: coremltools broadcasts to a symbolic shape):

    x --> shape --> select(cond=equal(target, -1), a=., b=target) --> real_div(., shape(x)) --> tile.reps

all become::

    q --> reshape([B, Hkv, G*L, E]) --> sdpa(., k, v, [M']) --> reshape([B, H, L, Ev]) --> y

7 ops become 3 (4 when a runtime mask shared by the heads needs its ``tile``; a constant mask is
repeated at compile time); with run-time reps, 13 become 3. A ``tile`` of ``Hkv > 1`` heads by ``[1, G,
1, 1]`` is not repeat_kv (it orders the heads ``k0, k1, k0, k1, ...``: query head ``h`` reads K/V head
``h % Hkv``, not ``h // G``) and is left alone, as is a per-head mask without a query axis (``[.., H, 1,
S]``) that is not a constant.

Proof of the reps and sizes. The reps must be proven ``[1, 1, G, 1, 1]`` (``[1, H, 1, 1]``) and the
reshape ``[B, Hkv * G, S, E]``, from constants or from the program's shape ops
(:mod:`generic_passes._shape_proof`: ``target = concat([1, Hkv, G, gather(shape(mask), 3), E])`` and ``x``
the cache sliced to that same length give ``S / S = 1``; a target naming another length is not proven).
``B``, ``H``, ``E`` and ``Ev`` must be integers; the query length ``L`` may be symbolic: the reshapes then
write ``-1`` for it, the one size they leave to the run time.

Decision on the mask of a flexible decoder. The causal mask ``[1, 1, L, S]`` is a function input, shared by
every layer, and folded query rows need it ``G`` times (``tile(mask, [1, 1, G, 1])``): no MIL op reads a
mask broadcast over the folded rows. ``scaled_dot_product_attention`` broadcasts the mask, but needs the
batch dims of Q, K and V equal, so the ``G`` axis cannot stay apart (Q ``[B, Hkv, G, L, E]`` against K
``[B, Hkv, 1, S, E]`` is rejected), and a mask of ``L`` rows does not broadcast to ``G * L``. The form
that reads the mask as it is, one attention per query group (``G`` attentions on ``[B, Hkv, L, E]``
slices of Q), costs a split of Q, ``G - 1`` more attentions and a concat of the outputs per layer. The
tile is made once, at the start of the function, and every folded attention of the function reads it:
one ``tile`` of ``G * L * S`` elements per call where repeat_kv made two of ``G * S * E`` per layer.

Runs right after ``generic::fuse_sdpa`` (which makes the ``scaled_dot_product_attention``), override on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Operation, Program, Var

import generic_passes.fuse_sdpa  # noqa: F401  (registers generic::fuse_sdpa, which this pass follows)
from generic_passes._shape_proof import ShapeFacts
from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["FORMS", "grouped_kv_constraints", "repeat_pattern", "transform_grouped_kv"]

_Q = (1, 4, 3, 8)
_KV = (1, 2, 5, 8)


FORMS: tuple[str, ...] = ("grouped", "multi_query")
"""How K/V are repeated: ``expand_dims -> tile -> reshape`` (``repeat_kv``), or one ``tile`` of a single
head (multi-query attention)."""


def repeat_pattern(form: str, masked: bool, runtime_reps: bool = False) -> Program:
    """The pattern of one form (:data:`FORMS`), with or without ``attn_mask``, constant or run-time reps.

    Args:
        form: ``"grouped"``: ops ``{k,v}_expand``, ``{k,v}_tile``, ``{k,v}_reshape``; ``"multi_query"``:
            ops ``{k,v}_tile``.
        masked: Whether ``sdpa`` has an ``attn_mask``.
        runtime_reps: The reps as coremltools computes them for a symbolic shape:
            ``real_div(select(equal(target, -1), shape(x), target), shape(x))`` (ops ``{k,v}_shape``,
            ``{k,v}_select``, ``{k,v}_reps``; ``cond`` and ``target`` are pattern inputs).

    Returns:
        The pattern, its attention op named ``sdpa``.
    """
    import coremltools as ct
    from coremltools.converters.mil.mil import types

    rank = 5 if form == "grouped" else 4
    kv = _KV if form == "grouped" else (1, 1, 5, 8)

    def repeat(t: Var, name: str, runtime: tuple[Var, Var] | None) -> Var:
        if form == "grouped":
            t = mb.expand_dims(x=t, axes=[2], name=f"{name}_expand")
        reps: Any = [1, 1, 2, 1, 1] if form == "grouped" else [1, 4, 1, 1]
        if runtime is not None:
            cond, target = runtime
            shape = mb.shape(x=t, name=f"{name}_shape")
            reps = mb.real_div(
                x=mb.select(cond=cond, a=shape, b=target, name=f"{name}_select"), y=shape, name=f"{name}_reps"
            )
        tiled = mb.tile(x=t, reps=reps, name=f"{name}_tile")
        if form == "grouped":
            tiled = mb.reshape(x=tiled, shape=[1, 4, 5, 8], name=f"{name}_reshape")
        return tiled

    def body(q: Var, k: Var, v: Var, mask: Var | None, k_reps: tuple | None, v_reps: tuple | None) -> Var:
        kwargs = {} if mask is None else {"attn_mask": mask}
        return mb.scaled_dot_product_attention(
            query=q, key=repeat(k, "k", k_reps), value=repeat(v, "v", v_reps), name="sdpa", **kwargs
        )

    specs = [mb.TensorSpec(shape=_Q), mb.TensorSpec(shape=kv), mb.TensorSpec(shape=kv)]
    if masked:
        specs.append(mb.TensorSpec(shape=(1, 1, 3, 5)))
    if runtime_reps:  # cond and target of K's reps, then of V's (the same vars in a conversion)
        for _ in "kv":
            specs += [
                mb.TensorSpec(shape=(rank,), dtype=types.bool),
                mb.TensorSpec(shape=(rank,), dtype=types.int32),
            ]
    program = mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    if not runtime_reps:
        if masked:
            return program(lambda q, k, v, mask: body(q, k, v, mask, None, None))
        return program(lambda q, k, v: body(q, k, v, None, None, None))
    if masked:
        return program(lambda q, k, v, mask, kc, kt, vc, vt: body(q, k, v, mask, (kc, kt), (vc, vt)))
    return program(lambda q, k, v, kc, kt, vc, vt: body(q, k, v, None, (kc, kt), (vc, vt)))


def _is_int(dim: Any) -> bool:
    return isinstance(dim, int) or bool(getattr(dim, "is_Integer", False))


def _unrepeated(pattern: Pattern, name: str) -> Var:
    """K or V before the repetition: the ``expand_dims``' input (GQA form) or the ``tile``'s (MQA form)."""
    return (
        pattern.ops[f"{name}_expand"].x if f"{name}_expand" in pattern.ops else pattern.ops[f"{name}_tile"].x
    )


def _repeat_groups(pattern: Pattern, name: str) -> int | None:
    """``G`` when K or V (``[B, Hkv, S, E]``) reaches the attention with each head repeated G times.

    GQA form: ``expand_dims(axes=[2])``, ``tile(reps=[1, 1, G, 1, 1])``, ``reshape`` to ``[B, Hkv*G, S,
    E]``. MQA form (``Hkv = 1``): ``tile(reps=[1, G, 1, 1])``. The reps and the reshaped size are read
    from the program's shape ops when they are computed at run time (:mod:`generic_passes._shape_proof`).
    """
    facts = ShapeFacts.of(pattern.block)
    tile = pattern.ops[f"{name}_tile"]
    src = facts.dims(_unrepeated(pattern, name))
    reps = facts.values(tile.reps)
    if src is None or len(src) != 4 or reps is None or not all(_is_int(r) for r in reps):
        return None
    reps_ = [int(r) for r in reps]
    b, hkv, s, e = src
    if f"{name}_expand" not in pattern.ops:
        if len(reps_) != 4 or reps_[0] != 1 or reps_[2:] != [1, 1] or reps_[1] < 2 or hkv != 1:
            return None
        return reps_[1]
    expand, reshape = pattern.ops[f"{name}_expand"], pattern.ops[f"{name}_reshape"]
    if not predicates.axes_are(expand.axes, 5, [2]):
        return None
    if len(reps_) != 5 or reps_[:2] != [1, 1] or reps_[3:] != [1, 1] or reps_[2] < 2:
        return None
    if not facts.same_dims(facts.dims(reshape.outputs[0]), (b, hkv * reps_[2], s, e)):
        return None
    return reps_[2]


def _new_mask(
    pattern: Pattern, mask: Var, q: tuple, hkv: int, groups: int
) -> tuple[str, np.ndarray | None] | None:
    """How the mask reaches the folded attention: ("keep"|"tile"|"reshape", constant value or None)."""
    facts = ShapeFacts.of(pattern.block)
    shape = facts.dims(mask)
    if shape is None or len(shape) > 4:
        return None
    b, h, length, _ = q
    full = (1,) * (4 - len(shape)) + tuple(shape)
    mb_, mh, ml, ms = full
    value = (
        np.asarray(mask.val) if predicates.is_constant(mask) and not predicates.is_constexpr(mask) else None
    )
    if mh == 1 and ml == 1:
        return "keep", None
    if mh == 1 and facts.equal(ml, length):
        if len(shape) != 4 and sum(not _is_int(d) for d in full) > 1:
            return None  # the reshape to rank 4 could name only one size -1
        return "tile", None if value is None else np.tile(value.reshape(full), (1, 1, groups, 1))
    if not all(_is_int(d) for d in full + (length,)):
        return None
    if mh == h and ml in (1, length) and (ml == length or value is not None):
        if value is None:
            return "reshape", None
        shape4 = tuple(int(d) for d in (mb_, h, length, ms))
        return "reshape", np.broadcast_to(value.reshape(full), shape4).reshape(
            int(mb_), hkv, groups * int(length), int(ms)
        )
    return None


def grouped_kv_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """K and V repeated by the same ``G`` from ``Hkv`` heads, Q with ``Hkv * G`` heads; B, H and E static.

    Returns:
        True, or ``(False, reason)``.
    """
    facts = ShapeFacts.of(pattern.block)
    sdpa = pattern.sdpa
    q = facts.dims(sdpa.query)
    groups_k, groups_v = _repeat_groups(pattern, "k"), _repeat_groups(pattern, "v")
    if q is None or len(q) != 4:
        return False, "the query is not of rank 4"
    if groups_k is None or groups_k != groups_v:
        return False, f"K and V are not repeated by one number of groups (K {groups_k}, V {groups_v})"
    hkv = facts.dim(_unrepeated(pattern, "k"), 1)
    if not all(_is_int(d) for d in (q[0], q[1], q[3], hkv)):
        return False, "the batch, the heads or the head size is symbolic"
    if q[1] != hkv * groups_k or facts.dim(_unrepeated(pattern, "v"), 1) != hkv:
        return False, f"the query's {q[1]} heads are not {hkv} K/V heads times {groups_k} groups"
    out = facts.dims(sdpa.outputs[0])
    if out is None or not _is_int(out[-1]):
        return False, "the output's last dimension is symbolic"
    plan = None
    if sdpa.inputs.get("attn_mask") is not None:
        plan = _new_mask(pattern, sdpa.attn_mask, q, int(hkv), groups_k)
        if plan is None:
            return False, "the mask cannot be laid out for the grouped heads"
    pattern.add_attribute("mask_plan", plan)
    pattern.add_attribute("kv_groups", groups_k)
    pattern.add_attribute("kv_heads", int(hkv))
    return True


def _known_dims(facts: ShapeFacts, var: Var) -> tuple[Any, ...]:
    """``facts.dims(var)`` for a variable whose dimensions ``grouped_kv_constraints`` found known."""
    dims = facts.dims(var)
    assert dims is not None, f"{var.name}: grouped_kv_constraints checked that its shape is known"
    return dims


def _shape_with_one_unknown(dims: Sequence[Any]) -> list[int]:
    """A reshape target: the static sizes, ``-1`` for the one symbolic size (the query length)."""
    return [int(d) if _is_int(d) else -1 for d in dims]


def _shared_mask_tile(mask: Var, groups: int, sdpa: Operation, name: str) -> Var:
    """``tile(mask, [1, 1, G, 1])``: for a function input, one op at the block's start that every
    folded attention of the block reads (the causal mask every layer shares); otherwise before ``sdpa``."""
    block = sdpa.enclosing_block
    if not isinstance(block, Function) or not any(mask is var for var in block.inputs.values()):
        return mb.tile(x=mask, reps=[1, 1, groups, 1], name=name, before_op=sdpa)
    for op in mask.child_ops:
        if (
            op.op_type == "tile"
            and op.enclosing_block is block
            and op.x is mask
            and op.reps.val is not None
            and list(np.asarray(op.reps.val)) == [1, 1, groups, 1]
        ):
            return op.outputs[0]
    return mb.tile(
        x=mask, reps=[1, 1, groups, 1], name=f"{mask.name}_repeated_{groups}", before_op=block.operations[0]
    )


def transform_grouped_kv(pattern: Pattern) -> None:
    """Q folded to ``[B, Hkv, G*L, E]``, attention on the unrepeated K/V, the result unfolded."""
    facts = ShapeFacts.of(pattern.block)
    sdpa = pattern.sdpa
    name = sdpa.outputs[0].name
    b, h, length, e = _known_dims(facts, sdpa.query)
    out_shape = _shape_with_one_unknown(_known_dims(facts, sdpa.outputs[0]))
    hkv, groups = pattern.kv_heads, pattern.kv_groups
    rows = groups * int(length) if _is_int(length) else -1
    query = mb.reshape(
        x=sdpa.query, shape=[int(b), hkv, rows, int(e)], name=f"{name}_query_folded", before_op=sdpa
    )
    kwargs = {}
    if pattern.mask_plan is not None:
        how, value = pattern.mask_plan
        mask = sdpa.attn_mask
        full = (1,) * (4 - mask.rank) + _known_dims(facts, mask)
        if value is not None:
            mask = mb.const(val=value, name=f"{name}_mask_folded", before_op=sdpa)
        elif how == "tile" and mask.rank == 4:
            mask = _shared_mask_tile(mask, groups, sdpa, f"{name}_mask_folded")
        elif how == "tile":
            mask = mb.tile(
                x=mb.reshape(x=mask, shape=_shape_with_one_unknown(full), before_op=sdpa),
                reps=[1, 1, groups, 1],
                name=f"{name}_mask_folded",
                before_op=sdpa,
            )
        elif how == "reshape":
            mask = mb.reshape(
                x=mask,
                shape=[int(full[0]), hkv, groups * int(length), int(full[3])],
                name=f"{name}_mask_folded",
                before_op=sdpa,
            )
        kwargs["attn_mask"] = mask
    folded = mb.scaled_dot_product_attention(
        query=query,
        key=_unrepeated(pattern, "k"),
        value=_unrepeated(pattern, "v"),
        name=f"{name}_folded",
        before_op=sdpa,
        **kwargs,
    )
    out = mb.reshape(x=folded, shape=out_shape, name=name, before_op=sdpa)
    pattern.replace_output(out)


for _form in FORMS:
    register_generic_pass(
        ops_arrangement=[
            repeat_pattern(_form, masked, runtime) for runtime in (False, True) for masked in (True, False)
        ],
        var_constraints=grouped_kv_constraints,
        transform_pattern=transform_grouped_kv,
        pass_name="fuse_grouped_kv_attention",
        namespace="generic",
        const_rules={"k_expand.axes": "const", "v_expand.axes": "const"} if _form == "grouped" else None,
        name="grouped_kv_attention" if _form == "grouped" else "multi_query_attention",
        run_after="generic::fuse_sdpa",
    )
