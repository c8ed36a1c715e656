"""Equivalences the matcher knows: ``pow(x, 2)`` also matches ``mul(x, x)``, and so on.

With ``equivalences=`` (``register_generic_pass``, ``find_matches``, ``explain``, ``compile_pattern``), a
pattern op for which an identity below holds also matches its other spellings. The pattern program is
replayed into one where every such op is a :func:`~.choices.one_of` choice between the op as written and
its other spellings; the choice and its alternatives' ops keep the op's name, so ``pattern.<name>`` is
whichever matched and ``pattern.choices[<name>]`` says which (0: as written).

Identities (``name``: pattern op -> also matched; exactness in float32):

* ``pow2``: ``pow(x, 2)`` -> ``mul(x, x)``. **Exact**: both are one correctly rounded product.
* ``square_pow``: ``mul(x, x)`` (the same variable twice) -> ``pow(x, 2)``. Exact, as above.
* ``sub_const``: ``sub(x, c)`` -> ``add(x, -c)``; ``add_const``: ``add(x, c)`` -> ``sub(x, -c)``.
  **Exact**: negation is exact and ``a - b`` is defined as ``a + (-b)``.
* ``div_const``: ``real_div(x, c)`` -> ``mul(x, 1/c)``; ``mul_const``: ``mul(x, c)`` -> ``real_div(x,
  1/c)``. **Approximate** unless c is a power of two: ``x * fl(1/c)`` and ``fl(x / c)`` differ by at most
  3 units in the last place, relative ``3 * 2**-24 * |x / c|`` (``DIV_RTOL``). The other spelling's
  constant is ``1/c`` of the pattern's, under the same constant rule.
* ``rsqrt``: ``rsqrt(x)`` -> ``real_div(1, sqrt(x))``. **Approximate**: MIL's ``rsqrt`` is
  ``1 / sqrt(x + epsilon)`` (epsilon 1e-12 by default); relative difference at most
  ``2 * 2**-24 + epsilon / (2 x)`` (``RSQRT_RTOL`` for the rounding part).
* ``reassoc``: a product of 3 to ``MAX_FACTORS`` = 5 factors written as a chain of ``mul``, at least one
  factor a constant and one not, also matches every other order of multiplication of the same factors
  (``mul(mul(a, c), b)`` -> ``mul(a, mul(b, c))``, ``mul(mul(a, b), c)``: 3 orders for 3 factors, 15 for
  4, 105 for 5, each up to operand order). Declared on the outer ``mul``; the chain is the ``mul`` tree
  below it through inner ``mul`` ops it alone reads (one use, not an output), cut at 5 factors
  (:mod:`~.reassoc`); the inner ops join the choice, named in every order in the order they are built.
  **Approximate**: ``reassoc_rtol(k)`` relative for k factors (``REASSOC_RTOL`` for 3; see
  :mod:`~.reassoc`). Applied alone on its ops (their other identities left out); a constant rule keyed
  ``"<inner op>.y"`` holds in the order as written only, one keyed by const op name in every order.

Declaring them (refused at registration with the rule and the fix when wrong): ``False`` (the default:
the project's passes reproduce coremltools' programs exactly), ``True`` (every identity wherever it
applies), a list of identity names (wherever they apply), or ``{"<pattern op>": ["pow2", ...]}`` (those
identities on that op; one that does not hold there, such as ``pow2`` on ``relu`` or ``pow(x, 3)``, is
refused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Operation, Program, Var

from .choices import Record, one_of, records_of
from .errors import PatternDefinitionError
from .reassoc import MAX_FACTORS, Chain, Tree, association_orders, chain_at, constant_value, reassoc_rtol

__all__ = ["DIV_RTOL", "MAX_FACTORS", "REASSOC_RTOL", "RSQRT_RTOL", "IDENTITIES", "Identity", "Equivalences",
           "reassoc_rtol", "with_equivalences"]

DIV_RTOL = 2.4e-7
"""Relative tolerance of ``x / c`` against ``x * (1/c)`` in float32 (3 units in the last place, rounded up)."""
REASSOC_RTOL = 2.4e-7
"""Relative tolerance of ``(a * c) * b`` against ``a * (b * c)`` in float32: ``reassoc_rtol(3)`` rounded up."""
RSQRT_RTOL = 1.2e-7
"""Relative tolerance of ``rsqrt(x)`` against ``1 / sqrt(x)`` in float32, beyond rsqrt's epsilon term."""

Equivalences = Union[bool, Sequence[str], Mapping[str, Sequence[str]]]
"""What ``equivalences=`` accepts: see the module docstring."""


@dataclass(frozen=True)
class Identity:
    """One identity: where it holds, and how the other spelling is built."""

    name: str
    """Its name in ``equivalences=``."""
    op_type: str
    """The pattern op type it applies to."""
    holds: Callable[[Operation], bool]
    """Whether it holds for this pattern op (its constants)."""
    build: Callable[[dict[str, Var], Operation, str], Var]
    """Builds the other spelling from the op's mapped operands, the original op and the name to give."""
    exact: bool
    """Same float32 values (else see the module docstring)."""
    statement: str
    """The identity in words, for messages."""


def _const(op: Operation, slot: str) -> np.ndarray | None:
    return constant_value(op.inputs.get(slot))


def _is_two(op: Operation) -> bool:
    value = _const(op, "y")
    return value is not None and value.size == 1 and float(value.reshape(())) == 2.0


def _has_const(op: Operation, nonzero: bool = False) -> bool:
    value = _const(op, "y")
    return value is not None and (not nonzero or bool(np.all(value)))


def _with_const(op_type: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., Var]:
    """Builds ``<op_type>(x, fn(c))`` for an op ``f(x, c)``, ``fn(c)`` in c's float dtype (else float32)."""

    def build(v: dict[str, Var], op: Operation, name: str) -> Var:
        value = _const(op, "y")
        assert value is not None  # holds() checked it
        y = fn(value.astype(np.float32)).astype(value.dtype if value.dtype.kind == "f" else np.float32)
        return getattr(mb, op_type)(x=v["x"], y=y, name=name)

    return build


IDENTITIES: dict[str, Identity] = {i.name: i for i in [
    Identity("pow2", "pow", _is_two,
             lambda v, op, name: mb.mul(x=v["x"], y=v["x"], name=name), True, "pow(x, 2) = mul(x, x)"),
    Identity("square_pow", "mul", lambda op: op.inputs["x"] is op.inputs["y"],
             lambda v, op, name: mb.pow(x=v["x"], y=np.float32(2.0), name=name), True, "mul(x, x) = pow(x, 2)"),
    Identity("sub_const", "sub", _has_const, _with_const("add", np.negative), True, "sub(x, c) = add(x, -c)"),
    Identity("add_const", "add", _has_const, _with_const("sub", np.negative), True, "add(x, c) = sub(x, -c)"),
    Identity("div_const", "real_div", lambda op: _has_const(op, nonzero=True), _with_const("mul", np.reciprocal),
             False, "real_div(x, c) = mul(x, 1/c)"),
    Identity("mul_const", "mul", lambda op: _has_const(op, nonzero=True), _with_const("real_div", np.reciprocal),
             False, "mul(x, c) = real_div(x, 1/c)"),
    Identity("reassoc", "mul", lambda op: chain_at(op) is not None, lambda v, op, name: v["x"], False,
             f"a product of 3 to {MAX_FACTORS} factors, one a constant (mul(mul(a, c), b) = mul(a, mul(b, c)) "
             f"= mul(mul(a, b), c), ...), in any order of multiplication"),
    Identity("rsqrt", "rsqrt", lambda op: True,
             lambda v, op, name: mb.real_div(x=np.float32(1.0), y=mb.sqrt(x=v["x"], name=f"{name}_sqrt"), name=name),
             False, "rsqrt(x) = real_div(1, sqrt(x))"),
]}
"""Every identity the matcher knows, by name."""


def _reassociated(chain: Chain, scopes: list[dict[int, Var]]) -> list[Callable[[], Var]]:
    """The spellings of ``chain`` (``reassoc``): as written (operand slots included), then every other
    order of its factors, the chain's inner ``mul`` ops named in the order they are built."""

    def spelling(k: int, tree: Tree) -> Callable[[], Var]:
        def build() -> Var:
            where = scopes + [{}]  # constants of one alternative stay inside it
            if k == 0:
                for op in (*chain.inner, chain.root):
                    made = mb.mul(**{s: _lookup(v, where) for s, v in op.inputs.items()}, name=op.name)
                    where[-1][id(op.outputs[0])] = made
                return made
            names = iter(op.name for op in chain.inner)

            def make(node: Tree, top: bool) -> Var:
                if isinstance(node, int):
                    return _lookup(chain.factors[node], where)
                x, y = make(node[0], False), make(node[1], False)
                return mb.mul(x=x, y=y, name=chain.root.name if top else next(names))

            return make(tree, True)

        return build

    return [spelling(k, tree) for k, tree in enumerate(association_orders(chain))]


def _plan(func: Function, pattern_name: str, equivalences: Equivalences) -> dict[str, list[Identity]]:
    """Pattern op name to the identities to apply to it."""
    ops = [op for op in func.operations if op.op_type != "const"]
    if isinstance(equivalences, bool):
        equivalences = list(IDENTITIES) if equivalences else []
    if isinstance(equivalences, Mapping):
        by_name = {op.name: op for op in ops}
        plan: dict[str, list[Identity]] = {}
        for op_name, names in equivalences.items():
            if op_name not in by_name:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: equivalences name op {op_name!r}, which the pattern does "
                    f"not have. Pattern ops: {sorted(by_name)}.")
            op = by_name[op_name]
            plan[op_name] = []
            for identity in _known(pattern_name, [names] if isinstance(names, str) else names):
                if not _applies(identity, op):
                    raise PatternDefinitionError(
                        f"Pattern {pattern_name!r}: equivalence {identity.name!r} declared on op "
                        f"{op_name!r} ({op.op_type}), where it does not hold. Rule: {identity.name} is "
                        f"{identity.statement}, for a {identity.op_type} op with such operands. Fix: "
                        f"declare it on such an op, or drop it for {op_name!r}.")
                plan[op_name].append(identity)
        return plan
    identities = _known(pattern_name, equivalences)
    return {op.name: [i for i in identities if _applies(i, op)] for op in ops}


def _known(pattern_name: str, names: Iterable[str]) -> list[Identity]:
    names = list(names)
    unknown = [n for n in names if n not in IDENTITIES]
    if unknown:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: unknown equivalence(s) {unknown}; the matcher knows "
            f"{sorted(IDENTITIES)} (see pattern_infra.language.equivalences).")
    return [IDENTITIES[n] for n in names]


def _applies(identity: Identity, op: Operation) -> bool:
    return op.op_type == identity.op_type and identity.holds(op)


def with_equivalences(program: Program, pattern_name: str, equivalences: Equivalences) -> Program:
    """The pattern program with every op an identity applies to turned into a choice of its spellings.

    Args:
        program: The pattern (not changed).
        pattern_name: For messages.
        equivalences: What to apply (see the module docstring).

    Returns:
        ``program`` itself when nothing applies, else a new pattern program (same names, same inputs).

    Raises:
        PatternDefinitionError: An unknown identity, or one declared on an op where it does not hold.
    """
    func = program.functions["main"]
    plan = {name: ids for name, ids in _plan(func, pattern_name, equivalences).items() if ids}
    if not plan:
        return program
    specs = {name: mb.TensorSpec(shape=var.shape, dtype=var.dtype) for name, var in func.inputs.items()}
    with Function(specs, opset_version=func.opset_version) as new:
        mapped: dict[int, Var] = {id(var): new.inputs[name] for name, var in func.inputs.items()}
        outputs = _replay(list(func.operations), records_of(func), plan, [mapped])
        new.set_outputs([outputs[id(v)] if id(v) in outputs else _lookup(v, [mapped]) for v in func.outputs])
    result = Program()
    result.add_function("main", new)
    result._pattern_name = getattr(program, "_pattern_name", None) or pattern_name  # type: ignore[attr-defined]
    return result


def _lookup(var: Var, scopes: list[dict[int, Var]]) -> Var:
    for scope in reversed(scopes):
        if id(var) in scope:
            return scope[id(var)]
    if var.op is not None and var.op.op_type == "const":
        scopes[-1][id(var)] = new = mb.const(val=var.val, name=var.op.name)
        return new
    raise PatternDefinitionError(f"equivalences: variable {var.name!r} is read before it is built.")


def _replay(
    ops: list[Operation], records: list[Record], plan: dict[str, list[Identity]], scopes: list[dict[int, Var]]
) -> dict[int, Var]:
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
        if op.op_type == "const" or id(op) in absorbed:
            continue
        record = regions.get(id(op))
        if record is not None:
            if id(record) in done:
                continue
            done.add(id(record))
            out = one_of(record.name, *[
                _alternative(alt_ops, record.children.get(k, []), out, plan, scopes)
                for k, (alt_ops, out) in enumerate(record.alternatives)
            ])
            scopes[-1][id(record.alternatives[0][1])] = out
            continue
        _replay_op(op, plan, scopes, chains.get(id(op)))
    return scopes[-1]


def _alternative(
    alt_ops: list[Operation], inner: list[Record], out: Var, plan: dict[str, list[Identity]],
    scopes: list[dict[int, Var]],
) -> Callable[[], Var]:
    def build() -> Var:
        local: dict[int, Var] = {}
        _replay(alt_ops, inner, plan, scopes + [local])
        return _lookup(out, scopes + [local])

    return build


def _replay_op(
    op: Operation, plan: dict[str, list[Identity]], scopes: list[dict[int, Var]], chain: Chain | None
) -> None:
    def operands(where: list[dict[int, Var]]) -> dict[str, Any]:
        return {slot: tuple(_lookup(v, where) for v in value) if isinstance(value, (list, tuple))
                else _lookup(value, where) for slot, value in op.inputs.items()}

    if chain is not None:  # re-associated alone: the chain's ops take no other identity
        scopes[-1][id(op.outputs[0])] = one_of(op.name, *_reassociated(chain, scopes))
        return
    identities = [i for i in plan.get(op.name, []) if i.name != "reassoc"]  # no chain left here
    if not identities:
        made = getattr(mb, op.op_type)(**operands(scopes), name=op.name)
        for old, new in zip(op.outputs, made if isinstance(made, (list, tuple)) else [made]):
            scopes[-1][id(old)] = new
        return

    def spelling(identity: Identity | None) -> Callable[[], Var]:
        def build() -> Var:
            where = scopes + [{}]  # constants of one alternative stay inside it
            if identity is None:
                return getattr(mb, op.op_type)(**operands(where), name=op.name)
            return identity.build({"x": _lookup(op.inputs["x"], where)}, op, op.name)

        return build

    scopes[-1][id(op.outputs[0])] = one_of(op.name, spelling(None), *[spelling(i) for i in identities])
