"""``common::fuse_transpose_matmul``: a ``transpose`` of the last two axes goes into ``matmul``'s flags.

Math: ``matmul(transpose_x=t)`` transposes the last two axes of ``x`` when ``t`` is set, so a ``transpose``
whose ``perm`` only swaps the last two axes (``(0, ..., r-3, r-1, r-2)``, negative axes allowed) is the
flag toggled: ``matmul(transpose(a), b, transpose_x=t) = matmul(a, b, transpose_x=not t)``, and likewise
for ``y``.

``matmul`` is not commutative, so each side is its own pattern; the five share the callbacks (one
registration) and run in this order, so a ``matmul`` with both sides transposed is rewritten once::

    Pattern 1 (both sides):           Pattern 2 (one transpose feeding both sides):

    a --> transpose_x --|             a --> transpose_xy --|--> matmul --> out
                        |--> matmul --> out                |------^
    b --> transpose_y --|

    Pattern 3 (x side):               Pattern 4 (y side):

    a --> transpose_x --> matmul --> out           b --> transpose_y --> matmul(y) --> out
                   b ------^  (y)                  a -------------------^  (x)

    Pattern 5 (a transpose in an enclosing block, which patterns cannot span):

    a --> transpose  |  block of a cond / while_loop:  --> matmul --> out

    all become:

    a, b --> matmul(transpose_x=not t_x, transpose_y=not t_y) --> out   (only the fused sides toggled)

The ``transpose`` ops are returned by the patterns, so they may have other users, as in coremltools
(which reads them and never requires them to be single-use): they stay for those users, and are removed
by the framework once the ``matmul`` was their only one. A ``transpose`` whose ``perm`` moves any other
axis, or of rank < 2, is not fused (that side keeps it; patterns 3 and 4 still fuse the other side).

Pattern 5 is a work-around: the matcher keeps a match inside one block, but coremltools also fuses a
``transpose`` computed in an enclosing block. Its ``transpose`` is not part of the match, so when dead it
is left for ``dead_code_elimination``, as coremltools leaves it.

As coremltools does, the new ``matmul`` is inserted before the old one and takes the old op's name.
Two differences from coremltools' program, neither in what it computes:

* coremltools leaves a ``transpose`` that the fusion made dead in the program (for a later
  ``dead_code_elimination``); here the framework removes it (same block only, see pattern 5).
* coremltools makes a single sweep, so of ``transpose(transpose(a))`` feeding a ``matmul`` it fuses
  the outer one only; the driver revisits the new ``matmul`` and fuses the inner one too.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var, get_new_symbol

from pattern_infra import Pattern, register_generic_pass

__all__ = [
    "transpose_both_pattern",
    "transpose_same_pattern",
    "transpose_x_pattern",
    "transpose_y_pattern",
    "matmul_pattern",
    "swaps_last_two_axes",
    "transpose_matmul_constraints",
    "transform_transpose_matmul",
]

_S = get_new_symbol()
_SPEC = [mb.TensorSpec(shape=(_S, _S)), mb.TensorSpec(shape=(_S, _S))]


@mb.program(input_specs=_SPEC)
def transpose_both_pattern(a, b):
    transpose_x = mb.transpose(x=a, perm=[1, 0], name="transpose_x")
    transpose_y = mb.transpose(x=b, perm=[1, 0], name="transpose_y")
    return transpose_x, transpose_y, mb.matmul(x=transpose_x, y=transpose_y, name="matmul")


@mb.program(input_specs=_SPEC[:1])
def transpose_same_pattern(a):
    transpose_xy = mb.transpose(x=a, perm=[1, 0], name="transpose_xy")
    return transpose_xy, mb.matmul(x=transpose_xy, y=transpose_xy, name="matmul")


@mb.program(input_specs=_SPEC)
def transpose_x_pattern(a, b):
    transpose_x = mb.transpose(x=a, perm=[1, 0], name="transpose_x")
    return transpose_x, mb.matmul(x=transpose_x, y=b, name="matmul")


@mb.program(input_specs=_SPEC)
def transpose_y_pattern(a, b):
    transpose_y = mb.transpose(x=b, perm=[1, 0], name="transpose_y")
    return transpose_y, mb.matmul(x=a, y=transpose_y, name="matmul")


@mb.program(input_specs=_SPEC)
def matmul_pattern(a, b):
    return mb.matmul(x=a, y=b, name="matmul")


def swaps_last_two_axes(transpose_out: Var) -> bool:
    """Whether the ``transpose`` producing ``transpose_out`` only swaps its last two axes (rank >= 2)."""
    rank = transpose_out.rank
    if rank is None or rank < 2:
        return False
    perm = transpose_out.op.perm.val
    if perm is None:
        return False
    perm = [int(p) % rank for p in np.asarray(perm).reshape(-1)]
    return perm == list(range(rank - 2)) + [rank - 1, rank - 2]


def _fused_sides(pattern: Pattern) -> list[tuple[str, Var]]:
    """The transposes to fuse, with the matmul side(s) each feeds: ("x" | "y" | "xy", its output)."""
    ops = pattern.ops
    if "transpose_x" in ops or "transpose_y" in ops or "transpose_xy" in ops:
        return [
            (sides, ops[name].outputs[0])
            for name, sides in (("transpose_x", "x"), ("transpose_y", "y"), ("transpose_xy", "xy"))
            if name in ops
        ]
    # pattern 5: transposes outside the matmul's block
    mm = pattern.matmul
    return [
        (side, var)
        for side, var in (("x", mm.x), ("y", mm.y))
        if var.op is not None
        and var.op.op_type == "transpose"
        and var.op.enclosing_block is not mm.enclosing_block
    ]


def transpose_matmul_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """There is a transpose to fuse, and every one swaps only the last two axes.

    Returns:
        True, or ``(False, reason)``.
    """
    sides = _fused_sides(pattern)
    if not sides:
        return False, "no transpose feeds the matmul"
    for _, out in sides:
        if not swaps_last_two_axes(out):
            return False, f"the transpose {out.op.name} does more than swap the last two axes"
    return True


def transform_transpose_matmul(pattern: Pattern) -> None:
    """Inserts the ``matmul`` reading the transposes' inputs with the toggled flags."""
    mm = pattern.matmul
    operands = {"x": mm.x, "y": mm.y}
    flags = {"x": bool(mm.transpose_x.val), "y": bool(mm.transpose_y.val)}
    for sides, out in _fused_sides(pattern):
        for side in sides:
            operands[side] = out.op.x
            flags[side] = not flags[side]
    fused = mb.matmul(
        x=operands["x"],
        y=operands["y"],
        transpose_x=flags["x"],
        transpose_y=flags["y"],
        name=mm.name,
        before_op=mm,
    )
    pattern.replace_output(fused, old_var=mm.outputs[0])


register_generic_pass(
    ops_arrangement=[
        transpose_both_pattern,
        transpose_same_pattern,
        transpose_x_pattern,
        transpose_y_pattern,
        matmul_pattern,
    ],
    var_constraints=transpose_matmul_constraints,
    transform_pattern=transform_transpose_matmul,
    pass_name="fuse_transpose_matmul",
    namespace="common",
    name="transpose_matmul",
)
