"""Alternatives at any point of a pattern (rules and examples: docs/LANGUAGE.md): ``one_of`` and ``optional``
record which ops each alternative made, a :class:`Record` per choice, for :mod:`~.alternatives` and
:mod:`~.variants`."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil.mil import Operation, Var
from coremltools.converters.mil.mil import block as _block

from .errors import PatternDefinitionError

__all__ = ["Record", "one_of", "optional", "records_of"]


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

    Alternatives are tried in the order written; write the longest first. When the choice ends the
    pattern, a later alternative is by default never matched inside a match of an earlier one (``norm *
    w`` is the weighted spelling, not the unweighted one and an unrelated ``mul``), whatever the
    constraints say of that match. Choices nest; ``pattern.choices[name]`` is the index of the alternative
    that matched. What alternatives may read and how their ops are named: docs/LANGUAGE.md.

    Args:
        name: The choice's name: ``pattern.<name>`` is the op computing the variable in a match.
        *alternatives: Functions of no argument building ops with ``mb`` and returning the variable,
            computed by one of their own ops.
        fallback: Offer a later alternative inside an earlier one's match too, after it, when the choice
            is reached from one of its inputs (a weight the fusion cannot absorb stays an op after the
            fused one). ``find_matches`` then reports both.

    Returns:
        The first alternative's variable, for the rest of the pattern to use.

    Raises:
        PatternDefinitionError: Called outside a pattern program, fewer than two alternatives, or an
            alternative that does not return a variable computed by one of its own ops.
    """
    func = _block.curr_block() if _block.BLOCK_STACK else None
    if func is None:
        raise PatternDefinitionError(
            f"one_of({name!r}) must be called while an @mb.program pattern is built, inside the "
            f"decorated function.")
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise PatternDefinitionError(
            f"one_of: the choice name {name!r} must be a Python identifier not starting with '_' (it "
            f"is read as pattern.<name>).")
    if len(alternatives) < 2 or not all(callable(a) for a in alternatives):
        raise PatternDefinitionError(
            f"one_of({name!r}) needs at least two alternatives, each a function of no argument building "
            f"ops (e.g. lambda: mb.mul(x=x, y=x, name='sq')); got {len(alternatives)}.")
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
                f"Rule: every alternative produces the choice's variable with one of the ops it builds. "
                f"Fix: return the output of the alternative's last op (e.g. lambda: mb.mul(x=x, y=x, "
                f"name='sq')), not a pattern input, a constant or a variable built outside it.")
        record.alternatives.append((ops, out))
    return record.alternatives[0][1]


def optional(name: str, base: Callable[[], Var], extra: Callable[[Var], Var], fallback: bool = False) -> Var:
    """Declares an op that may be absent: ``one_of(name, lambda: extra(base()), base, fallback=fallback)``.

    ``base`` is built once per alternative, its ops named the same in both. Not supported: a ``base`` of
    no op (an optional op on a pattern input).

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
