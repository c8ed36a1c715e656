"""Search plans (:func:`plan`, a list of :class:`Step`), the tree the matcher merges a pattern's plans
into (:class:`Branch`, :class:`Leaf`), what a tracing search reports (:class:`Failure`) and the counters
a run fills (:class:`PassStats`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..language.graph import CompiledPattern, PatternNode, edge_positions
from ..language.variants import Guard

__all__ = ["DOWN", "UP", "Accept", "Branch", "Failure", "Leaf", "PassStats", "Step", "plan"]

Accept = Callable[[Any], Any]
"""Offered each complete structural match (a :class:`~pattern_infra.language.pattern.Pattern`): ``True``
takes it; anything else continues the search (a ``str`` is the reason reported to a tracing search)."""

UP = 0
DOWN = 1


@dataclass
class PassStats:
    """Counters of searches and rewrites: of one run of a pass (``run_log()``), or summed over its runs
    (``container.stats``). A run fills the one it is handed (``run_subpasses``, ``Matcher.match_at``)."""

    runs: int = 0
    """How many times the sub-pass was applied to a program."""
    attempts: int = 0
    """Anchor ops tried."""
    bind_attempts: int = 0
    """Ops the matcher tried to bind (anchors included): its unit of work."""
    matches: int = 0
    """Complete structural matches."""
    rejected: int = 0
    """Matches that ``var_constraints`` turned down."""
    rejections: Counter[str] = field(default_factory=Counter)
    """How often each reason was given for turning a match down (see :func:`constraint_verdict`)."""
    declined: int = 0
    """Matches whose transform returned False."""
    rewrites: int = 0
    """Matches rewritten."""
    iterations: int = 0
    """Sweeps done (the first one included)."""
    seconds: float = 0.0
    """Wall time spent."""

    def add(self, other: PassStats) -> None:
        """Adds ``other``'s counters to these."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


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


def plan(compiled: CompiledPattern, anchor: int, rank: list[int]) -> list[Step]:
    """The search order anchored at pattern op ``anchor``: each further op reached *up* (the producer of
    a slot of an op placed) or *down* (a consumer of a variable bound), up-steps first, and ops of a
    lower ``rank`` before any of a higher one."""
    nodes = compiled.nodes
    levels = sorted(set(rank))
    placed = {anchor}
    steps = [Step(UP, anchor, src_kind="anchor")]
    while len(placed) < len(nodes):
        step = None
        for level in levels:
            allowed = {m for m in range(len(nodes)) if rank[m] <= level}
            step = _next_up(nodes, placed, allowed) or _next_down(compiled, placed, allowed)
            if step is not None:
                break
        if step is None:  # compile_pattern guarantees connectivity
            raise RuntimeError(f"pattern {compiled.name!r} could not be planned")
        steps.append(step)
        placed.add(step.node)
    return steps


def _next_up(nodes: list[PatternNode], placed: set[int], allowed: set[int]) -> Step | None:
    for n in sorted(placed):
        for slot, edge in nodes[n].inputs.items():
            for pos, e in edge_positions(edge):
                if e.kind == "op" and e.index not in placed and e.index in allowed:
                    return Step(UP, e.index, "op", n, slot, pos, e.output)
    return None


def _next_down(compiled: CompiledPattern, placed: set[int], allowed: set[int]) -> Step | None:
    """The first consumer of an op placed, else the first consumer of a pattern input an op placed reads."""
    from_root = None
    for m, node in enumerate(compiled.nodes):
        if m in placed or m not in allowed:
            continue
        for slot, edge in node.inputs.items():
            for pos, e in edge_positions(edge):
                if e.kind == "op" and e.index in placed:
                    return Step(DOWN, m, "op", e.index, slot, pos, e.output)
                read = e.kind == "root" and any(c in placed for c, _, _ in compiled.root_consumers[e.index])
                if from_root is None and read:
                    from_root = Step(DOWN, m, "root", e.index, slot, pos)
    return from_root


@dataclass
class Leaf:
    """Where the plan of one spelling ends."""

    variant: int
    """Index of the spelling in ``Matcher.variants``."""
    guards: tuple[Guard, ...]
    """Its longest-spelling guards that apply from this anchor."""


@dataclass
class Branch:
    """One step of the plan tree, followed by the steps (or leaves) of the spellings that share it."""

    step: Step
    then: list[Branch | Leaf] = field(default_factory=list)
