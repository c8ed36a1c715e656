"""Equivalences the matcher knows: ``pow(x, 2)`` also matches ``mul(x, x)``, and so on (the identities, how
exact each is in float32, how ``equivalences=`` declares them: docs/LANGUAGE.md). :func:`with_equivalences`
replays the pattern program with every op an identity applies to made a :func:`~.choices.one_of` choice,
of the op's name, between the op as written and its other spellings."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Operation, Var

from .choices import Record, one_of, records_of
from .errors import PatternDefinitionError

__all__ = [
    "DIV_RTOL",
    "MAX_FACTORS",
    "REASSOC_RTOL",
    "RSQRT_RTOL",
    "IDENTITIES",
    "Chain",
    "Identity",
    "Equivalences",
    "Tree",
    "association_orders",
    "chain_at",
    "constant_value",
    "with_equivalences",
]

DIV_RTOL = 2.4e-7
"""Relative tolerance of ``x / c`` against ``x * (1/c)`` in float32: 3 ulp, rounded up."""
REASSOC_RTOL = 2.4e-7
"""Relative tolerance of ``(a * c) * b`` against ``a * (b * c)`` in float32: reassoc_rtol(3) rounded up."""
RSQRT_RTOL = 1.2e-7
"""Relative tolerance of ``rsqrt(x)`` against ``1 / sqrt(x)`` in float32, beyond rsqrt's epsilon term."""

MAX_FACTORS = 5
"""Most factors of a chain re-associated (four ``mul``); a longer ``mul`` tree is cut there."""

Tree = int | tuple["Tree", "Tree"]
"""An order of multiplication: a factor's index in :attr:`Chain.factors`, or a pair multiplied together."""

Equivalences = bool | Sequence[str] | Mapping[str, Sequence[str]]  # what equivalences= accepts

Scope = ChainMap[int, Var]  # a pattern variable's id to its copy; an alternative builds in a child scope


def constant_value(var: object) -> np.ndarray | None:
    """``var`` (anything ``op.inputs`` holds) as an array when a numeric ``const`` op makes it, else None."""
    if not isinstance(var, Var) or var.op is None or var.op.op_type != "const" or var.val is None:
        return None
    value = np.asarray(var.val)
    return value if value.dtype.kind in "iuf" else None


@dataclass(frozen=True)
class Identity:
    """One identity: a pattern op of ``op_type`` for which ``holds`` also matches what ``build`` makes."""

    name: str
    op_type: str
    holds: Callable[[Operation], bool]
    build: Callable[[Var, Operation], Var]
    """The other spelling, from the copy of the op's ``x`` and the op (whose name it takes)."""
    exact: bool
    """Same float32 values (else within the tolerance docs/LANGUAGE.md states)."""
    statement: str
    """The identity in words, for messages."""

    def applies(self, op: Operation) -> bool:
        """Whether it holds for the pattern op ``op``."""
        return op.op_type == self.op_type and self.holds(op)


def _const_y(op: Operation, test: Callable[[np.ndarray], bool]) -> bool:
    value = constant_value(op.inputs.get("y"))
    return value is not None and bool(test(value))


def _const_identity(
    name: str, op_type: str, other: str, fn: Callable[[np.ndarray], np.ndarray], c: str, exact: bool
) -> Identity:
    """``<op_type>(x, c) = <other>(x, fn(c))`` for a numeric constant ``c`` (nonzero for a reciprocal),
    ``fn(c)`` in c's float dtype (else float32)."""

    def build(x: Var, op: Operation) -> Var:
        value = np.asarray(op.inputs["y"].val)  # a numeric const: holds found it one
        y = fn(value.astype(np.float32)).astype(value.dtype if value.dtype.kind == "f" else np.float32)
        return getattr(mb, other)(x=x, y=y, name=op.name)

    holds = partial(_const_y, test=np.all if fn is np.reciprocal else lambda value: True)
    return Identity(name, op_type, holds, build, exact, f"{op_type}(x, c) = {other}(x, {c})")


IDENTITIES: dict[str, Identity] = {
    i.name: i
    for i in [
        Identity(
            "pow2",
            "pow",
            partial(_const_y, test=lambda c: c.size == 1 and float(c.reshape(())) == 2.0),
            lambda x, op: mb.mul(x=x, y=x, name=op.name),
            True,
            "pow(x, 2) = mul(x, x)",
        ),
        Identity(
            "square_pow",
            "mul",
            lambda op: op.inputs["x"] is op.inputs["y"],
            lambda x, op: mb.pow(x=x, y=np.float32(2.0), name=op.name),
            True,
            "mul(x, x) = pow(x, 2)",
        ),
        _const_identity("sub_const", "sub", "add", np.negative, "-c", True),
        _const_identity("add_const", "add", "sub", np.negative, "-c", True),
        _const_identity("div_const", "real_div", "mul", np.reciprocal, "1/c", False),
        _const_identity("mul_const", "mul", "real_div", np.reciprocal, "1/c", False),
        Identity(
            "reassoc",
            "mul",
            lambda op: chain_at(op) is not None,
            lambda x, op: x,  # built by _order
            False,
            f"a product of 3 to {MAX_FACTORS} factors, one a constant (mul(mul(a, c), b) = mul(a, mul(b, c)) "
            f"= mul(mul(a, b), c), ...), in any order of multiplication",
        ),
        Identity(
            "rsqrt",
            "rsqrt",
            lambda op: True,
            lambda x, op: mb.real_div(
                x=np.float32(1.0), y=mb.sqrt(x=x, name=f"{op.name}_sqrt"), name=op.name
            ),
            False,
            "rsqrt(x) = real_div(1, sqrt(x))",
        ),
    ]
}


def with_equivalences(func: Function, pattern_name: str, equivalences: Equivalences) -> Function:
    """The pattern function with every op an identity applies to a choice of its spellings (a new function
    of the same names and inputs; ``func`` itself when nothing applies)."""
    plan = {name: ids for name, ids in _plan(func, pattern_name, equivalences).items() if ids}
    if not plan:
        return func
    specs = {name: mb.TensorSpec(shape=var.shape, dtype=var.dtype) for name, var in func.inputs.items()}
    with Function(specs, opset_version=func.opset_version) as new:
        scope: Scope = ChainMap({id(var): new.inputs[name] for name, var in func.inputs.items()})
        _replay(list(func.operations), records_of(func), plan, scope)
        new.set_outputs([_lookup(v, scope) for v in func.outputs])
    return new


def _plan(func: Function, pattern_name: str, equivalences: Equivalences) -> dict[str, list[Identity]]:
    """Pattern op name to the identities to apply to it."""
    ops = {op.name: op for op in func.operations if op.op_type != "const"}
    if not isinstance(equivalences, Mapping):
        identities = _known(pattern_name, list(IDENTITIES) if equivalences is True else equivalences or [])
        return {name: [i for i in identities if i.applies(op)] for name, op in ops.items()}
    plan: dict[str, list[Identity]] = {}
    for op_name, names in equivalences.items():
        if op_name not in ops:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: equivalences name op {op_name!r}, which the "
                f"pattern does not have. Pattern ops: {sorted(ops)}."
            )
        op = ops[op_name]
        plan[op_name] = _known(pattern_name, [names] if isinstance(names, str) else names)
        for identity in plan[op_name]:
            if not identity.applies(op):
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: equivalence {identity.name!r} declared on op {op_name!r} "
                    f"({op.op_type}), where it does not hold. Rule: {identity.name} is {identity.statement}, "
                    f"for a {identity.op_type} op with such operands. Fix: declare it on such an op or drop "
                    "it."
                )
    return plan


def _known(pattern_name: str, names: Iterable[str]) -> list[Identity]:
    unknown = [n for n in names if n not in IDENTITIES]
    if unknown:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: unknown equivalence(s) {unknown}; the matcher knows "
            f"{sorted(IDENTITIES)} (docs/LANGUAGE.md)."
        )
    return [IDENTITIES[n] for n in names]


def _lookup(var: Var, scope: Scope) -> Var:
    """The copy of ``var``; a constant is copied where it is first read (in an alternative: for it alone)."""
    if id(var) not in scope:
        if var.op is None or var.op.op_type != "const":
            raise PatternDefinitionError(f"equivalences: variable {var.name!r} is read before it is built.")
        scope[id(var)] = mb.const(val=var.val, name=var.op.name)
    return scope[id(var)]


def _rebuild(op: Operation, scope: Scope) -> Var:
    """``op`` built again on the copies of its operands, as written; returns its (first) output."""
    operands = {
        slot: tuple(_lookup(v, scope) for v in value)
        if isinstance(value, (list, tuple))
        else _lookup(value, scope)
        for slot, value in op.inputs.items()
    }
    made = getattr(mb, op.op_type)(**operands, name=op.name)
    made = made if isinstance(made, (list, tuple)) else [made]
    scope.update(zip(map(id, op.outputs), made))
    return made[0]


def _replay(
    ops: list[Operation], records: list[Record], plan: dict[str, list[Identity]], scope: Scope
) -> None:
    """Builds ``ops`` again in the current function, choices as choices, planned ops as new choices."""
    regions = {id(op): r for r in records for alt_ops, _ in r.alternatives for op in alt_ops}
    level = {id(op) for op in ops if id(op) not in regions}
    absorbed: set[int] = set()  # inner ops of re-associated chains: built inside the root's choice
    chains: dict[int, Chain] = {}  # root op to its chain; the outermost root first takes the ops it can
    for op in reversed(ops):
        if id(op) in level and id(op) not in absorbed and IDENTITIES["reassoc"] in plan.get(op.name, []):
            chain = chain_at(op, lambda inner: id(inner) in level and id(inner) not in absorbed)
            if chain is not None:
                chains[id(op)] = chain
                absorbed.update(id(inner) for inner in chain.inner)
    done: set[int] = set()
    for op in ops:
        record = regions.get(id(op))
        if op.op_type == "const" or id(op) in absorbed or id(record) in done:
            continue
        identities = [i for i in plan.get(op.name, []) if i.name != "reassoc"]
        name, out = op.name, op.outputs[0]
        if record is not None:
            done.add(id(record))
            name, out = record.name, record.alternatives[0][1]
            builds = [
                partial(_alternative, alt_ops, record.children.get(k, []), alt_out, plan)
                for k, (alt_ops, alt_out) in enumerate(record.alternatives)
            ]
        elif id(op) in chains:  # re-associated alone: the chain's ops take no other identity
            builds = [partial(_order, chains[id(op)], t) for t in association_orders(chains[id(op)])]
        elif identities:
            builds = [partial(_spelling, op, i) for i in [None, *identities]]
        else:
            _rebuild(op, scope)
            continue
        scope[id(out)] = one_of(name, *[partial(build, scope.new_child()) for build in builds])


def _alternative(
    alt_ops: list[Operation], inner: list[Record], out: Var, plan: dict[str, list[Identity]], scope: Scope
) -> Var:
    _replay(alt_ops, inner, plan, scope)
    return _lookup(out, scope)


def _spelling(op: Operation, identity: Identity | None, scope: Scope) -> Var:
    """``op`` as written (``identity`` None) or as ``identity`` spells it."""
    return _rebuild(op, scope) if identity is None else identity.build(_lookup(op.inputs["x"], scope), op)


def _order(chain: Chain, tree: Tree, where: Scope) -> Var:
    """``chain`` multiplied in the order ``tree``: as written (operand slots included) when it is the written
    order, else its inner ``mul`` ops named in the order they are built."""
    if tree == chain.written:
        return [_rebuild(op, where) for op in (*chain.inner, chain.root)][-1]
    names = iter(op.name for op in chain.inner)

    def make(node: Tree, top: bool) -> Var:
        if isinstance(node, int):
            return _lookup(chain.factors[node], where)
        x, y = make(node[0], False), make(node[1], False)
        return mb.mul(x=x, y=y, name=chain.root.name if top else next(names))

    return make(tree, True)


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
    """The chain of ``mul`` ops ending at ``op`` that ``reassoc`` applies to (docs/LANGUAGE.md), else None:
    ``x`` first, an operand expanded when an ``expandable`` ``mul`` makes it for the tree alone."""
    if op.op_type != "mul":
        return None
    factors: list[Var] = []
    inner: list[Operation] = []

    def walk(node: Operation) -> Tree:
        return (operand(node.inputs["x"], node), operand(node.inputs["y"], node))

    def operand(var: Var, parent: Operation) -> Tree:
        if (
            var.op is not None
            and var.op.op_type == "mul"
            and expandable(var.op)
            and len(var.child_ops) == 1
            and var not in var.op.enclosing_block.outputs
            and sum(v is var for v in parent.inputs.values()) == 1
            and 2 + len(inner) < MAX_FACTORS
        ):  # each inner op adds one factor
            inner.append(var.op)
            return walk(var.op)
        factors.append(var)
        return len(factors) - 1

    written = walk(op)
    consts = sum(constant_value(v) is not None for v in factors)
    if len(factors) < 3 or consts == 0 or consts == len(factors):
        return None
    order = {id(o): k for k, o in enumerate(op.enclosing_block.operations)}
    return Chain(op, tuple(sorted(inner, key=lambda o: order[id(o)])), tuple(factors), written)


def association_orders(chain: Chain) -> list[Tree]:
    """Every order of multiplication of the chain's factors, once up to operand order, ``chain.written``
    first (the same variable twice counts once: ``x * c * x`` has 2 orders)."""
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
