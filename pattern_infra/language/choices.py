"""Alternatives at any point of a pattern (docs/LANGUAGE.md): :func:`one_of` records a :class:`Record` per
choice; :func:`regions_of` checks the rules and returns each alternative as a :class:`Region`."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Operation, Var
from coremltools.converters.mil.mil import block as _block

from .errors import PatternDefinitionError
from .graph import operands

__all__ = ["Record", "Region", "one_of", "optional", "records_of", "regions_of"]


@dataclass
class Record:
    """What :func:`one_of` saw while the pattern program was built."""

    name: str
    alternatives: list[tuple[list[Operation], Var]]
    """Per alternative: the ops it created (consts and nested choices' ops included) and its output."""
    children: dict[int, list[Record]] = field(default_factory=dict)
    """Per alternative, the choices declared inside it (nested choices)."""
    fallback: bool = False
    """See :func:`one_of`."""


_RECORDS: weakref.WeakKeyDictionary[Any, list[Record]] = weakref.WeakKeyDictionary()
"""Pattern function to the choices declared at its top level while it was built."""

_ACTIVE: list[list[Record]] = []
"""Per alternative being built right now (innermost last), the choices declared inside it."""


def one_of(name: str, *alternatives: Callable[[], Var], fallback: bool = False) -> Var:
    """Declares, inside an ``@mb.program`` pattern, a variable computed by one of several small programs.

    Alternatives are tried in the order written, the longest first; choices nest (the rules, what a
    match holds: docs/LANGUAGE.md, "Alternatives at any point").

    Args:
        name: The choice's name: ``pattern.<name>`` is the op computing the variable in a match.
        *alternatives: Functions of no argument building ops with ``mb``, each returning one's output.
        fallback: Offer a later alternative inside an earlier one's match too, after it (a weight the
            fusion cannot absorb stays an op after the fused one); ``find_matches`` reports both.

    Returns:
        The first alternative's variable, for the rest of the pattern to use.

    Raises:
        PatternDefinitionError: Called outside a pattern program, fewer than two alternatives, or an
            alternative that does not return a variable computed by one of its own ops.
    """
    if not _block.BLOCK_STACK:
        raise PatternDefinitionError(
            f"one_of({name!r}) must be called while an @mb.program pattern is built, "
            f"inside the decorated function."
        )
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise PatternDefinitionError(
            f"one_of: the choice name {name!r} must be a Python identifier not starting "
            f"with '_' (it is read as pattern.<name>)."
        )
    if len(alternatives) < 2 or not all(callable(a) for a in alternatives):
        raise PatternDefinitionError(
            f"one_of({name!r}) needs at least two alternatives, each a function of no "
            f"argument building ops (lambda: mb.relu(x=x)); got {len(alternatives)}."
        )
    func = _block.curr_block()
    record = Record(name, [], fallback=fallback)
    (_ACTIVE[-1] if _ACTIVE else _RECORDS.setdefault(func, [])).append(record)
    for k, build in enumerate(alternatives):
        start = len(func.operations)
        _ACTIVE.append(record.children.setdefault(k, []))
        try:
            out = build()
        finally:
            _ACTIVE.pop()
        ops = list(func.operations)[start:]
        if not isinstance(out, Var) or all(out.op is not op for op in ops) or out.op.op_type == "const":
            what = out.name if isinstance(out, Var) else type(out).__name__
            raise PatternDefinitionError(
                f"one_of({name!r}): alternative {k} returns {what}, which none of its own ops computes. "
                "Rule: every alternative produces the choice's variable with one of the ops it builds. Fix: "
                "return the output of the alternative's last op, not a pattern input, a constant or a "
                "variable built outside it."
            )
        record.alternatives.append((ops, out))
    return record.alternatives[0][1]


def optional(name: str, base: Callable[[], Var], extra: Callable[[Var], Var], fallback: bool = False) -> Var:
    """Declares an op that may be absent: ``one_of(name, lambda: extra(base()), base, fallback=fallback)``.

    ``base`` is built once per alternative, its ops named the same in both; it must build an op.

    Args:
        base: Builds the ops the optional op reads from, returning their variable.
        extra: Builds the optional op(s) on that variable.
        fallback: As for :func:`one_of`: without the optional op when the match with it is refused.

    Returns:
        The variable with ``extra`` applied (the first alternative).
    """
    return one_of(name, lambda: extra(base()), base, fallback=fallback)


def records_of(func: Any) -> list[Record]:
    """The choices declared at the top level of a pattern function, in the order they were declared."""
    return list(_RECORDS.get(func, []))


@dataclass
class Region:
    """The ops of one alternative, read by the compiler as if they were a function."""

    operations: list[Any]
    inputs: dict[str, Var]
    """Slot name to the outside variable it stands for."""
    outputs: list[Var]
    label: str = ""
    """The alternative as an expression of its output, e.g. ``mul(x, rsqrt(var))``, for ``explain``."""


def regions_of(ops: list[Any], records: list[Record], pattern_name: str) -> dict[int, list[Region]]:
    """Per choice among ``ops`` or nested in them (keyed by ``id`` of its :class:`Record`), its alternatives
    as regions; raises :class:`PatternDefinitionError` where a choice rule is broken."""
    found: dict[int, list[Region]] = {}
    level = [op for op in ops if op.op_type != "const"]
    for record in records:
        region = {id(op) for alt_ops, _ in record.alternatives for op in alt_ops}
        if not any(id(op) in region for op in level):
            continue
        outside = [op for op in level if id(op) not in region]
        for op in outside:
            for _, _, var in operands(op):
                if var is not record.alternatives[0][1] and var.op is not None and id(var.op) in region:
                    raise PatternDefinitionError(
                        f"Pattern {pattern_name!r}: op {op.name!r} reads {var.name!r}, built inside choice "
                        f"{record.name!r}. Only the choice's own variable (what one_of returns) may be used "
                        f"outside it; build the rest inside every alternative."
                    )
        regions = found[id(record)] = _regions(record, {op.name for op in outside}, pattern_name)
        for k, (alt_ops, _) in enumerate(record.alternatives):
            found.update(regions_of(alt_ops, record.children.get(k, []), pattern_name))
        for var in regions[0].inputs.values():
            if var.op is None or var.op.op_type == "const":
                continue
            per_alt = [
                _reads(ops, record.children.get(k, []), var) for k, (ops, _) in enumerate(record.alternatives)
            ]
            if len(set(per_alt)) > 1:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: the alternatives of choice {record.name!r} read {var.name!r} "
                    f"a different number of times ({per_alt}), so whether it has a consumer outside the "
                    "match would depend on the alternative. Read it the same number of times in each (e.g. "
                    "through one op)."
                )
    return found


def _regions(record: Record, outside_names: set[str], pattern_name: str) -> list[Region]:
    """The alternatives of ``record`` as regions whose inputs are the choice's slots."""
    owner = {id(op): k for k, (alt_ops, _) in enumerate(record.alternatives) for op in alt_ops}
    external: list[list[Var]] = []
    for k, (alt_ops, _) in enumerate(record.alternatives):
        reads: dict[int, Var] = {}
        for op in alt_ops:
            if op.op_type != "const" and op.name in outside_names:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: op name {op.name!r} in alternative {k} of choice "
                    f"{record.name!r} is also used outside the choice; rename it (only alternatives of one "
                    "choice may share names)."
                )
            for _, _, var in operands(op):
                other = owner.get(id(var.op)) if var.op is not None else None
                if other is None:
                    reads.setdefault(id(var), var)
                elif other != k:
                    raise PatternDefinitionError(
                        f"Pattern {pattern_name!r}: alternative {k} of choice {record.name!r} reads "
                        f"{var.name!r}, built by alternative {other}; alternatives are independent: rebuild "
                        f"it in alternative {k}."
                    )
        external.append(list(reads.values()))
    slots: dict[int, str] = {}
    inputs: dict[str, Var] = {}
    for var in (var for reads in external for var in reads if id(var) not in slots):
        slot = slots[id(var)] = (
            var.name if var.name.isidentifier() and var.name not in inputs else f"in{len(inputs)}"
        )
        inputs[slot] = var
    for var in inputs.values():
        missing = [k for k, reads in enumerate(external) if all(v is not var for v in reads)]
        if var.op is not None and var.op.op_type != "const" and missing:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op {var.op.name!r} is read by some alternatives of choice "
                f"{record.name!r} but not by alternative(s) {missing}, so nothing would match it: build it "
                "inside the ones reading it."
            )
    return [
        Region(list(alt_ops), {slots[id(v)]: v for v in external[k]}, [out], _label(out, slots))
        for k, (alt_ops, out) in enumerate(record.alternatives)
    ]


def _reads(ops: list[Any], nested: list[Record], var: Var) -> int:
    """How many times one spelling of ``ops`` (nested choices at their first alternative) reads ``var``."""
    inner = {id(op) for record in nested for alt_ops, _ in record.alternatives for op in alt_ops}
    own = sum(v is var for op in ops if id(op) not in inner for _, _, v in operands(op))
    return own + sum(_reads(r.alternatives[0][0], r.children.get(0, []), var) for r in nested)


def _label(out: Var, slots: dict[int, str]) -> str:
    """The alternative as an expression of its output, e.g. ``mul(x, rsqrt(var))`` (12 ops at most)."""
    budget = [12]

    def text(var: Var) -> str:
        if id(var) in slots:
            return slots[id(var)]
        op = var.op
        budget[0] -= 1
        if budget[0] < 0:
            return "..."
        args = []
        for slot, _, v in operands(op):
            if v.op is None or v.op.op_type != "const" or id(v) in slots:
                args.append(text(v))
            elif slot in ("x", "y") and v.val is not None:  # an operand; other constants are attributes
                value = np.asarray(v.val)
                if value.size == 1 and value.dtype.kind in "biuf":
                    args.append(f"{value.reshape(()).item():g}")
        return f"{op.op_type}({', '.join(args)})"

    return text(out)
