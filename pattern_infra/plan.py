"""The search plan's vocabulary, shared by the interpreter (:mod:`~pattern_infra.matcher`), the generated
search (:mod:`~pattern_infra.codegen`) and the choices (:mod:`~pattern_infra.choices`): steps, the
failure a tracing search reports, and reading a binding's slots.

A plan (``Matcher.plans[anchor]``) is a list of :class:`Step`: the first binds the anchor, each further
one reaches a pattern op *up* (the producer of a slot of an op already bound) or *down* (a consumer of
a variable already bound). The interpreter walks it; the generator writes it out as Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coremltools.converters.mil.mil import Operation
from coremltools.converters.mil.mil.var import InternalVar

if TYPE_CHECKING:
    from .compiler import CompiledPattern, Edge

__all__ = ["DOWN", "UP", "Accept", "Failure", "Step", "input_value", "optional_const", "slot_value"]

Accept = Callable[[Any], Any]
"""Offered each complete structural match (a :class:`~pattern_infra.pattern.Pattern`): ``True`` takes it; anything else continues the search (a
``str`` is the reason reported to a tracing search)."""

UP = 0
DOWN = 1


@dataclass(frozen=True)
class Step:
    """One step of a plan: bind ``node`` up (``kind`` UP) or down (DOWN) from what is bound."""

    kind: int
    node: int
    # up: (source node, slot, position, output index); down: source is a root or a node output
    src_kind: str = ""
    src: int = 0
    slot: str = ""
    pos: int = -1
    out: int = 0


@dataclass
class Failure:
    """Why the search stopped where it did: the nearest partial match of an anchor."""

    bound: int
    """How many pattern ops were bound when it failed."""
    node: str
    """The pattern op being bound (or checked) when it failed."""
    reason: str
    """What differed, in words."""
    ops: dict[str, str] = field(default_factory=dict)
    """Pattern op name to the program op name bound at that moment."""


def input_value(op: Operation, slot: str) -> Any:
    """The variable ``op`` reads at ``slot``, or None (absent, or an internal variable)."""
    value = op._input_vars.get(slot)  # read-only use of the private map: op.inputs copies it
    if value is None or isinstance(value, InternalVar):
        return None
    return value


def slot_value(assign: list[dict[str, Any] | None], node: int, slot: str, pos: int) -> Any:
    assigned = assign[node]
    if assigned is None:
        return None
    value = assigned.get(slot)
    if pos >= 0:
        return value[pos] if isinstance(value, (list, tuple)) and pos < len(value) else None
    return value



def optional_const(compiled: CompiledPattern, edge: Edge | tuple[Edge, ...]) -> bool:
    """Whether ``edge`` is one constant slot of rule ``"any"`` (a wildcard slot: it may be absent)."""
    return not isinstance(edge, tuple) and edge.kind == "const" and compiled.consts[edge.index][2].mode == "any"
