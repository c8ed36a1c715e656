"""Chains of ``reshape`` / ``expand_dims`` / ``squeeze`` / ``transpose`` as one permutation of factors.

None of these ops computes anything: each output element is an input element. ``reshape``,
``expand_dims`` and ``squeeze`` keep the row-major order of the elements and only regroup the axes;
``transpose`` reorders the axes. A chain of them is therefore described by *factors*: the input's axes cut
into pieces (an axis of 12 split as 3 x 4 has the factors 3 and 4, outer first), each output axis a run
of consecutive factors. :class:`Layout` follows a chain op by op:

1. Every input axis of size other than 1 is one factor; a size-1 axis has none.
2. A reshape (``expand_dims`` and ``squeeze`` included) regroups the current factors, in row-major order,
   into the new axes: a factor is taken whole when the new axis is a multiple of it, split (outer part
   first) when the new axis divides it, and merged with the next factor when both are consecutive pieces
   of one input axis. Any other cut (a size of 6 from factors 4 and 3 of two different input axes) is
   refused: the chain is then not a permutation of factors.
3. A transpose reorders the current axes, each with its factors.

Sizes are :class:`~generic_passes._shape_proof.ShapeFacts` expressions: a symbolic dimension is taken
whole or split only where the quotient is proven an integer polynomial, never guessed.

Afterwards the factors in input order (``F``) and in output order (``G``) are one permutation, and
:meth:`Layout.plan` writes it in the fewest ops: none (the input itself), one ``reshape`` (``G`` is
``F``), one ``transpose`` (each input axis is one output axis), a ``transpose`` then a ``reshape`` (each
input axis stays whole), a ``reshape`` then a ``transpose`` (each output axis is a run of ``F``), or
``reshape -> transpose -> reshape`` over the blocks of factors consecutive in both orders. No tensor of
the plan has more than :data:`MAX_RANK` axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var

from ._shape_proof import ShapeFacts

__all__ = ["MAX_RANK", "MOVEMENT_OPS", "Layout", "Step", "emit", "steps_of"]

MOVEMENT_OPS: tuple[str, ...] = ("reshape", "transpose", "expand_dims", "squeeze", "identity")
"""MIL ops that only move elements: every output element is one input element (``identity`` too)."""

MAX_RANK = 5
"""The highest rank a ``reshape`` or ``transpose`` of a plan may produce (Core ML's tensor limit)."""

Step = tuple[str, tuple]
"""``("reshape", dims)`` or ``("transpose", perm)``."""

Dims = tuple[sp.Expr, ...]


def steps_of(op: Operation, facts: ShapeFacts) -> Step | None:
    """The step ``op`` takes: a transpose's permutation, or the output dimensions of a reshape-like op."""
    if op.op_type == "transpose":
        rank = op.x.rank
        return ("transpose", tuple(int(p) % rank for p in op.perm.val))
    if op.op_type in MOVEMENT_OPS:
        dims = facts.dims(op.outputs[0])
        return None if dims is None else ("reshape", dims)
    return None


def _quotient(a: sp.Expr, b: sp.Expr) -> sp.Expr | None:
    """``a / b`` when it is proven an integer polynomial, else None."""
    q = sp.cancel(sp.sympify(a) / sp.sympify(b))
    if q.is_number:
        return q if q.is_Integer and q > 0 else None
    try:
        poly = sp.Poly(q, *sorted(q.free_symbols, key=str))
    except sp.PolynomialError:
        return None
    return q if all(c.is_Integer for c in poly.coeffs()) else None


class Layout:
    """The factors of one chain, input axes and current axes (see the module docstring)."""

    def __init__(self, facts: ShapeFacts, dims: Sequence[sp.Expr]) -> None:
        self.facts = facts
        self.in_dims: Dims = tuple(dims)
        """The chain's input dimensions."""
        self.sizes: dict[int, sp.Expr] = {}
        """Factor id to its size."""
        self.source: list[list[int]] = [[] if facts.equal(d, 1) else [self._new(d)] for d in dims]
        """Per input axis, its factors, outer first."""
        self.axes: list[list[int]] = [list(a) for a in self.source]
        """Per current axis, its factors, outer first."""
        self.dims: Dims = tuple(dims)
        """The current dimensions."""

    def _new(self, size: sp.Expr) -> int:
        self.sizes[len(self.sizes)] = sp.sympify(size)
        return len(self.sizes) - 1

    def _replace(self, old: int, new: list[int]) -> None:
        for axis in self.source:
            if old in axis:
                i = axis.index(old)
                axis[i : i + 1] = new

    def apply(self, step: Step) -> str | None:
        """Follows one step; the reason it cannot, or None."""
        kind, value = step
        if kind == "transpose":
            if sorted(value) != list(range(len(self.axes))):
                return f"transpose perm {list(value)} does not fit rank {len(self.axes)}"
            self.axes = [self.axes[p] for p in value]
            self.dims = tuple(self.dims[p] for p in value)
            return None
        return self._reshape(value)

    def _reshape(self, dims: Dims) -> str | None:
        equal = self.facts.equal
        flat = [f for axis in self.axes for f in axis]
        pos, new_axes = 0, []
        for target in dims:
            group: list[int] = []
            rest = sp.sympify(target)
            while not equal(rest, 1):
                if pos >= len(flat):
                    return f"reshape to {list(dims)} holds more elements than {list(self.dims)}"
                f = flat[pos]
                size = self.sizes[f]
                if equal(size, rest):
                    group.append(f)
                    pos, rest = pos + 1, sp.Integer(1)
                elif (q := _quotient(rest, size)) is not None:
                    group.append(f)
                    pos, rest = pos + 1, q
                elif (q := _quotient(size, rest)) is not None:
                    outer, inner = self._new(rest), self._new(q)
                    self._replace(f, [outer, inner])
                    group.append(outer)
                    flat[pos], rest = inner, sp.Integer(1)
                elif pos + 1 < len(flat) and self._consecutive(f, flat[pos + 1]):
                    merged = self._new(size * self.sizes[flat[pos + 1]])
                    self._replace(flat[pos + 1], [])
                    self._replace(f, [merged])
                    flat[pos : pos + 2] = [merged]
                else:
                    return f"reshape to {list(dims)} cuts a factor of size {size} of {list(self.dims)}"
            new_axes.append(group)
        if pos != len(flat):
            return f"reshape to {list(dims)} holds fewer elements than {list(self.dims)}"
        self.axes, self.dims = new_axes, tuple(sp.sympify(d) for d in dims)
        return None

    def _consecutive(self, f: int, g: int) -> bool:
        return any(f in a and a.index(f) + 1 < len(a) and a[a.index(f) + 1] == g for a in self.source)

    # -- the plan -------------------------------------------------------------------------------

    def keeps_last_axis(self) -> bool:
        """The last current axis is the last input axis, whole (an op along it commutes with the chain)."""
        return bool(self.source and self.axes and self.source[-1] and self.axes[-1] == self.source[-1])

    def plan(self) -> list[Step] | str:
        """The fewest ops from the input to the current dimensions; the reason when there are none."""
        F = [f for a in self.source for f in a]
        G = [f for a in self.axes for f in a]
        if sorted(F) != sorted(G):
            return "the chain drops or repeats elements"
        candidates = []
        if F == G:
            same = self.facts.same_dims(self.in_dims, self.dims)
            candidates.append([] if same else [("reshape", self.dims)])
        for option in (self._transpose_first, self._reshape_first, self._blocks):
            steps = option(F, G)
            if steps is not None:
                candidates.append(steps)
        candidates = [c for c in candidates if all(_rank(s) <= MAX_RANK for s in c)]
        if not candidates:
            return f"the chain needs a tensor of rank over {MAX_RANK}"
        return min(candidates, key=len)

    def _runs(self, order: list[int], axes: list[list[int]]) -> list[int] | None:
        """The indices of ``axes`` (the non-empty ones) in the order their runs make up ``order``."""
        starts = {a[0]: i for i, a in enumerate(axes) if a}
        found, pos = [], 0
        while pos < len(order):
            i = starts.get(order[pos])
            if i is None or order[pos : pos + len(axes[i])] != axes[i]:
                return None
            found.append(i)
            pos += len(axes[i])
        return found

    def _transpose_first(self, F: list[int], G: list[int]) -> list[Step] | None:
        """Each input axis whole: transpose the input (unit axes stay), then reshape if needed."""
        order = self._runs(G, self.source)
        if order is None:
            return None
        slots = iter(order)
        perm = tuple(next(slots) if a else i for i, a in enumerate(self.source))
        moved = tuple(self.in_dims[p] for p in perm)
        steps: list[Step] = [("transpose", perm)]
        if not self.facts.same_dims(moved, self.dims):
            steps.append(("reshape", self.dims))
        return steps

    def _reshape_first(self, F: list[int], G: list[int]) -> list[Step] | None:
        """Each output axis a run of F: reshape the input to the output's axes in F order, transpose."""
        order = self._runs(F, self.axes)
        if order is None:
            return None
        slots = iter(order)
        placed = [next(slots) if a else j for j, a in enumerate(self.axes)]  # P's axis k holds output axis
        perm = tuple(placed.index(j) for j in range(len(self.axes)))
        middle = tuple(self.dims[j] for j in placed)
        steps: list[Step] = []
        if not self.facts.same_dims(self.in_dims, middle):
            steps.append(("reshape", middle))
        steps.append(("transpose", perm))
        return steps

    def _blocks(self, F: list[int], G: list[int]) -> list[Step]:
        """``reshape -> transpose -> reshape`` over the runs of factors consecutive in both orders."""
        where = {f: i for i, f in enumerate(F)}
        blocks: list[list[int]] = []
        for f in G:
            if blocks and where[blocks[-1][-1]] + 1 == where[f]:
                blocks[-1].append(f)
            else:
                blocks.append([f])
        in_order = sorted(range(len(blocks)), key=lambda b: where[blocks[b][0]])
        middle = tuple(sp.Mul(*(self.sizes[f] for f in blocks[b])) for b in in_order)
        perm = tuple(in_order.index(b) for b in range(len(blocks)))
        return [("reshape", middle), ("transpose", perm), ("reshape", self.dims)]


def _rank(step: Step) -> int:
    return len(step[1])


def _shape_value(dims: Sequence[sp.Expr]) -> list[int] | None:
    """Integer dims, with one symbolic dimension as ``-1``; None with more than one."""
    symbolic = [i for i, d in enumerate(dims) if not sp.sympify(d).is_Integer]
    if len(symbolic) > 1:
        return None
    return [-1 if i in symbolic else int(d) for i, d in enumerate(dims)]


def emittable(steps: Sequence[Step]) -> bool:
    """Every reshape of ``steps`` has at most one symbolic dimension (written ``-1``)."""
    return all(kind != "reshape" or _shape_value(value) is not None for kind, value in steps)


def emit(steps: Sequence[Step], x: Var, *, name: str, before_op: Operation) -> Var:
    """Builds ``steps`` on ``x`` before ``before_op``; the last op is named ``name`` (an ``identity`` when
    there is no step)."""
    if not steps:
        return mb.identity(x=x, name=name, before_op=before_op)
    for i, (kind, value) in enumerate(steps):
        last = {"name": name} if i == len(steps) - 1 else {}
        if kind == "transpose":
            x = mb.transpose(x=x, perm=list(value), before_op=before_op, **last)
        else:
            x = mb.reshape(x=x, shape=_shape_value(value), before_op=before_op, **last)
    return x
