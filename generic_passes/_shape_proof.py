"""Proofs about symbolic dimensions, from a function's own shape ops and declared input ranges.

A dimension coremltools cannot compute at conversion gets a fresh symbol (``is123``): the length of a
slice whose ``end`` is computed at run time, the size of a ``tile`` whose ``reps`` are, a broadcast of
two symbols. Two fresh symbols are two names, not a proof that the lengths differ, nor that they are
equal. :class:`ShapeFacts` computes what a dimension *is*, as an expression in the function's input
symbols, by following the ops that produced it, and proves equalities and inequalities between such
expressions. Nothing is assumed: where a rule's condition is not proven, the dimension stays its own
symbol (an unknown), and an unknown is equal only to itself.

Rules:

1. A dimension of a function input is its symbol. A flexible input's declared range
   (``RangeDim(lower, upper)``, kept in ``function.input_types``, enforced by the runtime) bounds its
   symbol; every other symbol is a size, ``>= 0``.
2. A symbol an op's output shares with one of the op's inputs is that input's dimension: coremltools'
   type inference carried the symbol over because the sizes are equal.
3. A symbol an op creates is, by the op's definition:

   * ``slice_by_index`` with stride 1 on an axis of size ``N``: ``end - begin``, once
     ``0 <= begin <= end <= N`` is proven (no wrap-around, no clamping);
   * ``tile``: ``size * reps``;
   * ``range_1d(start, end, step=1)``: ``end - start``, once ``start <= end`` is proven;
   * ``concat`` on the concatenation axis: the sum of the inputs' sizes;
   * ``reshape``: the requested size, or for ``-1`` the element count divided by the other sizes;
   * an elementwise op's broadcast of ``a`` and ``b``: ``a`` when ``a == b`` or ``b == 1``, ``b`` when
     ``a == 1``;

   any other op: the symbol itself.
4. The integer values of a shape vector (what ``reps``, ``begin``, ``end`` and ``shape`` read): a
   constant; ``shape(x)`` is ``x``'s dimensions; ``gather`` and ``slice_by_index`` with constant
   indices pick from a vector; ``concat`` on axis 0 joins; ``add``, ``sub``, ``mul``, ``minimum``,
   ``maximum`` compute element by element (a minimum where neither side is proven the smaller stays
   undecided), and ``real_div`` of integers where the quotient is proven exact (a polynomial with
   integer coefficients: ``S / S = 1``, never ``S / is96``); ``select(equal(v, c), a, b)`` picks element
   by element where each comparison is decided; ``cast`` to an integer type, ``expand_dims``,
   ``squeeze`` and ``reshape`` keep the values in order.
5. ``a <= b`` is proven when ``b - a`` is linear in the symbols and its minimum over their ranges
   (rule 1) is ``>= 0``; ``a == b`` when ``a - b`` expands to 0.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import sympy as sp
from coremltools.converters.mil.input_types import RangeDim
from coremltools.converters.mil.mil import Block, Function, Operation, Var, types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

__all__ = ["ShapeFacts", "function_of"]

Expr: TypeAlias = sp.Expr

_ELEMENTWISE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "real_div",
        "floor_div",
        "pow",
        "maximum",
        "minimum",
        "mod",
        "equal",
        "not_equal",
        "less",
        "less_equal",
        "greater",
        "greater_equal",
        "logical_and",
        "logical_or",
        "logical_xor",
        "select",
    }
)
_SHAPE_KEEPING = frozenset({"expand_dims", "squeeze", "reshape", "identity"})
_FACTS: weakref.WeakKeyDictionary[Function, ShapeFacts] = weakref.WeakKeyDictionary()


def function_of(block: Block) -> Function:
    """The function a block belongs to (a block nested in ``cond`` or ``while_loop`` included)."""
    while not isinstance(block, Function):
        block = block.outer_op.enclosing_block
    return block


def _tensor_inputs(op: Operation) -> list[Var]:
    found = []
    for value in op.inputs.values():
        for var in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(var, Var) and types.is_tensor(var.sym_type):
                found.append(var)
    return found


def _carries(var: Var, symbol: sp.Symbol) -> bool:
    return any(is_symbolic(d) and symbol in sp.sympify(d).free_symbols for d in var.shape)


class ShapeFacts:
    """What the dimensions and shape vectors of one function are (see the module docstring).

    One instance per function (:meth:`of`), shared by the passes: a symbol names one size for the whole
    conversion, so what is proven about it stays true while the program is rewritten.
    """

    def __init__(self, function: Function) -> None:
        self.bounds: dict[str, tuple[int, int | None]] = {}
        """Symbol name to its declared ``(lower, upper)`` range (``upper`` None: unbounded)."""
        for input_type in getattr(function, "input_types", None) or ():
            for dim in getattr(getattr(input_type, "shape", None), "shape", ()) or ():
                if isinstance(dim, RangeDim):
                    upper = int(dim.upper_bound) if dim.upper_bound > 0 else None
                    self.bounds[str(dim.symbol)] = (int(dim.lower_bound), upper)
        self._symbols: dict[sp.Symbol, Expr] = {}

    @classmethod
    def of(cls, block: Block) -> ShapeFacts:
        """The facts of the function ``block`` belongs to."""
        function = function_of(block)
        facts = _FACTS.get(function)
        if facts is None:
            facts = _FACTS[function] = cls(function)
        return facts

    # -- dimensions -------------------------------------------------------------------------------

    def dims(self, var: Var) -> tuple[Expr, ...] | None:
        """Every dimension of ``var`` (rule 1 to 3); None when the shape is unknown."""
        if var.shape is None:
            return None
        return tuple(self.dim(var, axis) for axis in range(len(var.shape)))

    def dim(self, var: Var, axis: int) -> Expr:
        """One dimension of ``var`` as an expression in the function's input symbols (or unknowns)."""
        size = var.shape[axis]
        if not is_symbolic(size):
            return sp.Integer(int(size))
        expr = sp.sympify(size)
        try:
            replaced = expr.xreplace({symbol: self._symbol(symbol, var) for symbol in expr.free_symbols})
        except RecursionError:  # a chain too long to follow: the symbols stay unknowns
            return expr
        return sp.expand(replaced)

    def _symbol(self, symbol: sp.Symbol, var: Var) -> Expr:
        known = self._symbols.get(symbol)
        if known is not None:
            return known
        self._symbols[symbol] = symbol  # while it is being resolved (and if it cannot be)
        current = var
        while current.op is not None:
            carrier = next((v for v in _tensor_inputs(current.op) if _carries(v, symbol)), None)
            if carrier is None:
                break
            current = carrier
        result = symbol if current.op is None else self._created(current.op, current, symbol)
        self._symbols[symbol] = result
        return result

    def _created(self, op: Operation, out: Var, symbol: sp.Symbol) -> Expr:
        """Rule 3: the size ``op`` gives the axis of ``out`` that ``symbol`` names."""
        axes = [i for i, d in enumerate(out.shape) if is_symbolic(d) and sp.sympify(d) == symbol]
        if not axes:
            return symbol
        axis, kind = axes[0], op.op_type
        result: Expr | None = None
        if kind == "slice_by_index":
            result = self._slice_length(op, axis)
        elif kind == "tile":
            reps = self.values(op.reps)
            if reps is not None and len(reps) == op.x.rank:
                result = self.dim(op.x, axis) * reps[axis]
        elif kind == "range_1d":
            start, end, step = (self.values(op.inputs[n]) for n in ("start", "end", "step"))
            if start and end and step == (1,) and self.le(start[0], end[0]):
                result = end[0] - start[0]
        elif kind == "concat" and int(op.axis.val) % out.rank == axis:
            result = sum((self.dim(v, axis) for v in op.values), sp.Integer(0))
        elif kind == "reshape":
            result = self._reshaped(op, axis)
        elif kind in _ELEMENTWISE:
            result = self._broadcast(op, out, axis)
        return symbol if result is None else sp.expand(result)

    def _slice_length(self, op: Operation, axis: int) -> Expr | None:
        x = op.x
        squeeze = _flags(op, "squeeze_mask", x.rank)
        kept = [i for i in range(x.rank) if not squeeze[i]]
        if axis >= len(kept) or x.rank == 0:
            return None
        source = kept[axis]
        begin, end = self.values(op.begin), self.values(op.end)
        stride = self.values(op.stride) if op.stride is not None else (sp.Integer(1),) * x.rank
        if begin is None or end is None or stride is None or stride[source] != 1:
            return None
        size = self.dim(x, source)
        b = sp.Integer(0) if _flags(op, "begin_mask", x.rank)[source] else begin[source]
        e = size if _flags(op, "end_mask", x.rank)[source] else end[source]
        if self.le(0, b) and self.le(b, e) and self.le(e, size):
            return e - b
        return None

    def _reshaped(self, op: Operation, axis: int) -> Expr | None:
        shape = self.values(op.shape)
        dims = self.dims(op.x)
        if shape is None or dims is None or axis >= len(shape):
            return None
        if any(s == 0 for s in shape):
            return None  # 0 copies the input's size in some opsets: not read here
        if shape[axis] != -1:
            return shape[axis]
        others = [s for i, s in enumerate(shape) if i != axis]
        if any(s == -1 for s in others):
            return None
        return sp.Mul(*dims) / sp.Mul(*others)

    def _broadcast(self, op: Operation, out: Var, axis: int) -> Expr | None:
        from_right = out.rank - axis
        sizes = [self.dim(v, v.rank - from_right) for v in _tensor_inputs(op) if v.rank >= from_right]
        wide = [s for s in sizes if s != 1]
        if not wide:
            return sp.Integer(1)
        return wide[0] if all(self.equal(wide[0], s) for s in wide[1:]) else None

    # -- integer values ---------------------------------------------------------------------------

    def values(self, var: Var | None) -> tuple[Expr, ...] | None:
        """The integer values of a scalar or vector (rule 4), flattened; None when not known."""
        if var is None:
            return None
        if var.val is not None and not is_symbolic(var.val):
            array = np.asarray(var.val)
            if array.dtype.kind not in "iub":
                return None
            return tuple(sp.Integer(int(v)) for v in array.reshape(-1))
        op = var.op
        if op is None:
            return None
        try:
            return self._values_of(op)
        except RecursionError:
            return None

    def _values_of(self, op: Operation) -> tuple[Expr, ...] | None:
        kind = op.op_type
        if kind == "shape":
            return self.dims(op.x)
        if kind in _SHAPE_KEEPING:
            return self.values(op.x)
        if kind == "cast":
            return self.values(op.x) if op.dtype.val.startswith(("int", "uint")) else None
        if kind == "concat":
            if op.values[0].rank > 1:
                return None
            parts = [self.values(v) for v in op.values]
            known = [p for p in parts if p is not None]
            return tuple(e for p in known for e in p) if len(known) == len(parts) else None
        if kind in ("gather", "slice_by_index"):
            return self._picked(op)
        if kind == "select":
            return self._selected(op)
        if kind in ("add", "sub", "mul", "real_div", "minimum", "maximum"):
            return self._arithmetic(op)
        return None

    def _picked(self, op: Operation) -> tuple[Expr, ...] | None:
        source = self.values(op.x)
        if source is None or op.x.rank != 1:
            return None
        if op.op_type == "gather":
            if op.indices.val is None or int(op.axis.val) != 0:
                return None
            return tuple(source[int(i)] for i in np.asarray(op.indices.val).reshape(-1))
        begin, end = op.begin.val, op.end.val
        if begin is None or end is None:
            return None
        start = None if _flags(op, "begin_mask", 1)[0] else int(np.asarray(begin).reshape(-1)[0])
        stop = None if _flags(op, "end_mask", 1)[0] else int(np.asarray(end).reshape(-1)[0])
        stride = 1 if op.stride is None else int(np.asarray(op.stride.val).reshape(-1)[0])
        if _flags(op, "squeeze_mask", 1)[0]:
            return (source[0 if start is None else start],)
        return tuple(source[start:stop:stride])

    def _arithmetic(self, op: Operation) -> tuple[Expr, ...] | None:
        x, y = self.values(op.x), self.values(op.y)
        if x is None or y is None or (len(x) != len(y) and 1 not in (len(x), len(y))):
            return None
        n = max(len(x), len(y))
        x, y = (x * n if len(x) == 1 else x), (y * n if len(y) == 1 else y)
        kind = op.op_type
        if kind in ("add", "sub", "mul"):
            return tuple(sp.expand({"add": a + b, "sub": a - b, "mul": a * b}[kind]) for a, b in zip(x, y))
        if kind == "real_div":  # integer division: known only where it is proven exact
            quotients = [sp.cancel(a / b) if b != 0 else None for a, b in zip(x, y)]
            return (
                None if not all(_integral(q) for q in quotients) else tuple(sp.expand(q) for q in quotients)
            )
        picked = []
        for a, b in zip(x, y):
            smaller = a if self.le(a, b) else b if self.le(b, a) else None
            larger = b if smaller is a else a if smaller is b else None
            choice = smaller if kind == "minimum" else larger
            if choice is None:
                return None
            picked.append(choice)
        return tuple(picked)

    def _selected(self, op: Operation) -> tuple[Expr, ...] | None:
        cond = op.cond.op
        if cond is None or cond.op_type not in ("equal", "not_equal"):
            return None
        operands = [self.values(v) for v in (cond.x, cond.y, op.a, op.b)]
        known = [v for v in operands if v is not None]
        if len(known) != len(operands):
            return None
        n = max(len(v) for v in known)
        if any(len(v) not in (1, n) for v in known):
            return None
        left, right, a, b = ((v * n if len(v) == 1 else v) for v in known)
        picked = []
        for i in range(n):
            same = self.decide_equal(left[i], right[i])
            if same is None:
                return None
            picked.append(a[i] if same == (cond.op_type == "equal") else b[i])
        return tuple(picked)

    # -- comparisons ------------------------------------------------------------------------------

    def equal(self, a: Expr | int, b: Expr | int) -> bool:
        """Proven ``a == b`` (rule 5)."""
        return sp.expand(sp.sympify(a) - sp.sympify(b)) == 0

    def same_dims(self, a: Sequence[Expr] | None, b: Sequence[Expr] | None) -> bool:
        """Both shapes known, of one rank, with every dimension proven equal."""
        return a is not None and b is not None and len(a) == len(b) and all(map(self.equal, a, b))

    def decide_equal(self, a: Expr, b: Expr) -> bool | None:
        """True or False when ``a == b`` or ``a != b`` is proven; None otherwise."""
        if self.equal(a, b):
            return True
        if self._minimum(sp.expand(sp.sympify(a) - sp.sympify(b))) > 0:
            return False
        if self._minimum(sp.expand(sp.sympify(b) - sp.sympify(a))) > 0:
            return False
        return None

    def le(self, a: Expr | int, b: Expr | int) -> bool:
        """Proven ``a <= b`` (rule 5)."""
        return self._minimum(sp.expand(sp.sympify(b) - sp.sympify(a))) >= 0

    def _minimum(self, expr: Expr) -> float:
        """A lower bound of a linear expression over the symbols' ranges (``-inf`` if none is known)."""
        if expr.is_number:
            return float(expr)
        symbols = sorted(expr.free_symbols, key=str)
        try:
            poly = sp.Poly(expr, *symbols)
        except sp.PolynomialError:
            return -np.inf
        if poly.total_degree() > 1:
            return -np.inf
        low = float(poly.coeff_monomial(1))
        for symbol in symbols:
            coeff = float(poly.coeff_monomial(symbol))
            lower, upper = self.bounds.get(str(symbol), (0, None))
            if coeff >= 0:
                low += coeff * lower
            elif upper is None:
                return -np.inf
            else:
                low += coeff * upper
        return low


def _integral(expr: Expr | None) -> bool:
    """``expr`` is a polynomial with integer coefficients: an integer for every integer value of its
    symbols."""
    if expr is None:
        return False
    if expr.is_number:
        return bool(expr.is_Integer)
    try:
        poly = sp.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sp.PolynomialError:
        return False
    return all(c.is_Integer for c in poly.coeffs())


def _flags(op: Operation, name: str, rank: int) -> list[bool]:
    var = op.inputs.get(name)
    if var is None or var.val is None:
        return [False] * rank
    return [bool(f) for f in np.asarray(var.val).reshape(-1)]
