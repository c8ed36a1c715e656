"""Constant scalings re-associated (the ``reassoc`` equivalence): which ``mul`` chains (:func:`chain_at`),
which orders (:func:`association_orders`: ``(2k - 3)!!`` for ``k`` distinct factors, at most
:data:`MAX_FACTORS`, so a choice stays a constant number of alternatives per pattern op), how exact."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import numpy as np
from coremltools.converters.mil.mil import Operation, Var

__all__ = ["MAX_FACTORS", "Chain", "Tree", "association_orders", "chain_at", "constant_value", "reassoc_rtol"]

MAX_FACTORS = 5
"""Most factors of a chain re-associated (four ``mul``); a longer ``mul`` tree is cut there."""

Tree = Union[int, tuple["Tree", "Tree"]]
"""An order of multiplication: a factor's index in :attr:`Chain.factors`, or a pair multiplied together."""


def reassoc_rtol(factors: int) -> float:
    """Relative tolerance of two orders of multiplication of ``factors`` float32 factors.

    Each float32 ``mul`` rounds once, ``fl(p q) = p q (1 + d)`` with ``|d| <= u = 2**-24`` (round to nearest,
    no overflow nor underflow), and an order makes ``factors - 1`` products.

    Args:
        factors: Number of factors of the chain (2 or more).

    Returns:
        ``((1 + u) / (1 - u)) ** (factors - 1) - 1``, about ``2 (factors - 1) u``.

    Raises:
        ValueError: Fewer than 2 factors.
    """
    if factors < 2:
        raise ValueError(f"reassoc_rtol: a chain has 2 factors or more, got {factors}.")
    u = 2.0**-24
    return ((1 + u) / (1 - u)) ** (factors - 1) - 1


def constant_value(var: object) -> np.ndarray | None:
    """The value of ``var`` (anything ``op.inputs`` holds) as an array when a ``const`` op makes it and it
    is numeric, else None."""
    if not isinstance(var, Var) or var.op is None or var.op.op_type != "const" or var.val is None:
        return None
    value = np.asarray(var.val)
    return value if value.dtype.kind in "iuf" else None


@dataclass(frozen=True)
class Chain:
    """A chain of ``mul`` ops ending at :attr:`root`, as the pattern writes it."""

    root: Operation
    """The outer ``mul``, the op the identity is declared on (the choice takes its name)."""
    inner: tuple[Operation, ...]
    """The chain's other ``mul`` ops, in the pattern's op order (their names are reused in every order)."""
    factors: tuple[Var, ...]
    """What is multiplied, left to right as written (constants included)."""
    written: Tree


def chain_at(op: Operation, expandable: Callable[[Operation], bool] = lambda op: True) -> Chain | None:
    """The chain of ``mul`` ops ending at ``op`` that the ``reassoc`` identity applies to, else None.

    The ``mul`` tree below ``op`` is walked depth first, ``x`` before ``y``; an operand is expanded when an
    ``expandable`` ``mul`` makes it, the tree alone reads it (once), it is not a block output, and the
    tree stays within :data:`MAX_FACTORS` factors. None when ``op`` is not a ``mul``, the tree has fewer
    than 3 factors, or none (or all) of its factors are numeric constants.
    """
    if op.op_type != "mul":
        return None
    factors: list[Var] = []
    inner: list[Operation] = []

    def expands(var: object, parent: Operation) -> bool:
        return (isinstance(var, Var) and var.op is not None and var.op.op_type == "mul" and expandable(var.op)
                and len(var.child_ops) == 1 and var not in var.op.enclosing_block.outputs
                and sum(1 for v in parent.inputs.values() if v is var) == 1)

    def walk(node: Operation) -> Tree:
        pair = []
        for slot in ("x", "y"):
            var = node.inputs[slot]
            if expands(var, node) and 2 + len(inner) < MAX_FACTORS:  # each inner op adds one factor
                inner.append(var.op)
                pair.append(walk(var.op))
            else:
                factors.append(var)
                pair.append(len(factors) - 1)
        return (pair[0], pair[1])

    written = walk(op)
    consts = sum(constant_value(v) is not None for v in factors)
    if len(factors) < 3 or consts == 0 or consts == len(factors):
        return None
    order = {id(o): k for k, o in enumerate(op.enclosing_block.operations)}
    return Chain(op, tuple(sorted(inner, key=lambda o: order[id(o)])), tuple(factors), written)


def association_orders(chain: Chain) -> list[Tree]:
    """Every order of multiplication of the chain's factors, each once up to operand order: ``chain.written``
    first (a factor that is the very same variable as another counts as that one: ``x * c * x`` has 2 orders)."""
    same = [next(j for j, v in enumerate(chain.factors) if v is var) for var in chain.factors]

    def key(tree: Tree) -> str:
        if isinstance(tree, int):
            return f"f{same[tree]}"
        return "(" + ",".join(sorted(key(t) for t in tree)) + ")"

    orders = {key(chain.written): chain.written}
    for tree in _trees(tuple(range(len(chain.factors)))):
        orders.setdefault(key(tree), tree)
    return list(orders.values())


def _trees(indices: tuple[int, ...]) -> list[Tree]:
    """Every binary tree over ``indices`` up to operand order: the first index with each proper subset of
    the others on its side, the rest on the other side."""
    if len(indices) == 1:
        return [indices[0]]
    first, rest = indices[0], indices[1:]
    trees: list[Tree] = []
    for mask in range(2 ** len(rest) - 1):  # the other side is never empty
        left = (first, *(r for k, r in enumerate(rest) if mask >> k & 1))
        right = tuple(r for k, r in enumerate(rest) if not mask >> k & 1)
        trees.extend((a, b) for a in _trees(left) for b in _trees(right))
    return trees
