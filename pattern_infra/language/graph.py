"""A compiled pattern: the graph :func:`~pattern_infra.language.compiler.compile_pattern` makes of a
pattern program, :class:`PatternNode` ops joined by :class:`Edge` s, with :class:`ConstRule` constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from coremltools.converters.mil.mil import Operation, Var

from .errors import PatternDefinitionError

__all__ = [
    "COMMUTATIVE_OPS",
    "CompiledPattern",
    "ConstMode",
    "ConstRule",
    "Edge",
    "PatternNode",
    "distances",
    "edge_positions",
    "is_compressed",
    "operands",
]

COMMUTATIVE_OPS: frozenset[str] = frozenset(
    {"add", "mul", "maximum", "minimum", "equal", "not_equal", "logical_and", "logical_or", "logical_xor"}
)
"""MIL binary ops whose ``x`` and ``y`` may be swapped; the matcher tries both orders itself."""

ConstMode = Literal["any", "const", "value", "weight"]


@dataclass(frozen=True)
class ConstRule:
    """What a pattern constant demands of the program variable in its slot (never computed in the match)."""

    mode: ConstMode = "any"
    """``"any"``: anything; ``"const"``: a compile-time constant; ``"value"``: a constant close to the
    pattern's; ``"weight"``: a compile-time constant or a compressed one (see :func:`is_compressed`)."""
    rtol: float = 1e-5
    """Relative tolerance of ``"value"``."""
    atol: float = 1e-6
    """Absolute tolerance of ``"value"``."""

    def __post_init__(self) -> None:
        if self.mode not in ("any", "const", "value", "weight"):
            raise PatternDefinitionError(
                f"ConstRule mode {self.mode!r} is not one of 'any', 'const', 'value', 'weight'."
            )

    def accepts(self, var: Var, expected: np.ndarray | None) -> str | None:
        """Returns None when ``var`` satisfies the rule, else the reason it does not. ``"value"`` compares
        in the program constant's dtype, the pattern's value rounded to it (float16 in a float16 program)."""
        if self.mode == "any":
            return None
        if self.mode == "weight":
            if var.val is not None or is_compressed(var):
                return None
            return (
                f"operand {var.name} is neither a compile-time constant nor a compressed weight "
                "(a chain of constexpr_* ops over constants)"
            )
        if var.val is None:
            return f"operand {var.name} is not a compile-time constant"
        if self.mode == "const" or expected is None:
            return None
        got = np.asarray(var.val)
        if got.dtype.kind not in "biuf" or expected.dtype.kind not in "biuf":
            return None if np.array_equal(got, expected) else f"constant {var.name} differs"
        if expected.size == 1:
            if got.size != 1:
                return f"constant {var.name} has {got.size} elements where the pattern has a scalar"
            g, written = float(got.reshape(())), float(expected.reshape(()))
            e = float(_in_dtype(expected, got.dtype).reshape(()))
            if abs(g - e) <= self.atol + self.rtol * abs(e):
                return None
            rounded = f" (in {got.dtype}: {e!r})" if e != written else ""
            return f"constant {var.name} = {g!r} differs from the pattern's {written!r}{rounded}"
        if got.shape != expected.shape:
            return f"constant {var.name} has shape {got.shape}, the pattern's has {expected.shape}"
        if np.allclose(got, _in_dtype(expected, got.dtype), rtol=self.rtol, atol=self.atol):
            return None
        return f"constant {var.name} = array{got.shape} differs from the pattern's array{expected.shape}"


def is_compressed(var: Var) -> bool:
    """Whether ``var`` is a compressed weight (no value at compile time): the output of a ``constexpr_*``
    op reading only ``const`` ops or, in turn, compressed weights (a LUT dequantized by another)."""
    op = var.op
    if op is None or not op.op_type.startswith("constexpr_"):
        return False
    return all(v.op is not None and (v.op.op_type == "const" or is_compressed(v)) for _, _, v in operands(op))


def operands(op: Operation) -> list[tuple[str, int, Var]]:
    """Every variable ``op`` reads: (slot, position in a tuple slot or -1, variable)."""
    return [
        (slot, pos, v)
        for slot, value in op.inputs.items()
        for pos, v in (enumerate(value) if isinstance(value, (list, tuple)) else [(-1, value)])
    ]


def _in_dtype(expected: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``expected`` rounded to ``dtype`` when both are floating-point, else as it is."""
    if expected.dtype.kind == "f" and dtype.kind == "f" and expected.dtype != dtype:
        with np.errstate(over="ignore"):
            return expected.astype(dtype)
    return expected


@dataclass(frozen=True)
class Edge:
    """Where one input slot of a pattern op takes its value from."""

    kind: Literal["root", "op", "const"]
    """``root``: a pattern input; ``op``: an output of another pattern op; ``const``: a constant."""
    index: int
    """Root index, node index or constant index, according to ``kind``."""
    output: int = 0
    """Output index of the producing node, for ``kind == "op"``."""


def edge_positions(edge: Edge | tuple[Edge, ...]) -> list[tuple[int, Edge]]:
    """The edges of one input slot with their position: ``(-1, edge)``, or ``(i, e)`` per tuple element."""
    return list(enumerate(edge)) if isinstance(edge, tuple) else [(-1, edge)]


@dataclass
class PatternNode:
    """One non-const op of the pattern."""

    index: int
    """Position in :attr:`CompiledPattern.nodes` (program order of the pattern)."""
    name: str
    """The op's unique name in the pattern, used as ``pattern.<name>``."""
    op_type: str
    """The op type written in the pattern."""
    op_types: frozenset[str]
    """Op types accepted at this node (one, or several alternatives)."""
    num_outputs: int
    inputs: dict[str, Edge | tuple[Edge, ...]]
    """Input slot name to its edge (a tuple for tuple inputs such as ``concat(values=...)``)."""
    commutative: bool
    """Whether ``x`` and ``y`` may be swapped when the matched program op is commutative."""
    swap_any_type: bool = False
    """Whether ``x`` and ``y`` are tried in both orders whatever op type matched (``commutative=[...]``)."""
    is_final: bool = False
    """Whether the outputs may be used outside the match."""
    fanout: bool = False
    """Whether this node stands for *every* consumer of its input variable (all of one kind), as a list."""
    output_uses: list[int] = field(default_factory=list)
    """For each output, how many pattern edges consume it."""
    consumers: list[tuple[int, str, int, int]] = field(default_factory=list)
    """Edges leaving this node: (consumer node, slot, position in a tuple slot or -1, output index)."""

    @property
    def op_type_label(self) -> str:
        """The accepted op types, for messages."""
        return "|".join(sorted(self.op_types))


@dataclass
class CompiledPattern:
    """A pattern program read into nodes, roots and constants; immutable once built."""

    name: str
    nodes: list[PatternNode]
    """Pattern ops in the pattern's program order."""
    root_names: list[str]
    """The pattern's input names, in order."""
    root_consumers: list[list[tuple[int, str, int]]]
    """For each root: (consumer node, slot, position or -1)."""
    consts: list[tuple[str, np.ndarray | None, ConstRule]]
    """For each constant use: (key ``"<op>.<slot>"``, value, rule)."""
    const_names: list[str]
    """For each constant use: the name of the pattern's const op."""
    final_nodes: list[int]
    """Indices of the final nodes, in the order the pattern returns them."""
    by_name: dict[str, int]
    variants: list[Any] = field(default_factory=list)
    """Its spellings (:class:`~.variants.Variant`), this pattern the first; set by the compiler."""
    parts: list[CompiledPattern] = field(default_factory=list)
    """Of a pattern of several programs, each program's pattern (with its own spellings), in order."""

    @cached_property
    def node_names(self) -> tuple[str, ...]:
        """The nodes' names, in node order."""
        return tuple(node.name for node in self.nodes)

    @cached_property
    def const_keys(self) -> tuple[str, ...]:
        """The keys of ``consts``, in order."""
        return tuple(key for key, _, _ in self.consts)

    @cached_property
    def const_slots(self) -> list[tuple[int, str, int]]:
        """Where each constant use sits, in ``consts`` order: (node, slot, position or -1)."""
        return [
            (node.index, slot, pos)
            for node in self.nodes
            for slot, edge in node.inputs.items()
            for pos, e in edge_positions(edge)
            if e.kind == "const"
        ]

    @cached_property
    def has_fanout(self) -> bool:
        """Whether a node (of any program's) is a fan-out op (captured as a list)."""
        return any(node.fanout for node in self.nodes) or any(part.has_fanout for part in self.parts)

    @cached_property
    def final_names(self) -> tuple[str, ...]:
        """The names of the final nodes, in the order the pattern returns them."""
        return tuple(self.nodes[i].name for i in self.final_nodes)

    def hops(self, through_roots: bool) -> list[dict[int, int]]:
        """Per node, its neighbours and their distance: 1 through a data edge, 2 through a pattern input
        both read (only ``through_roots``)."""
        hops: list[dict[int, int]] = [{} for _ in self.nodes]
        for node in self.nodes:
            for consumer, _, _, _ in node.consumers:
                hops[node.index][consumer] = hops[consumer][node.index] = 1
        for users in self.root_consumers if through_roots else ():
            for a, _, _ in users:
                for b, _, _ in users:
                    if a != b:
                        hops[a].setdefault(b, 2)
        return hops


def distances(hops: list[dict[int, int]], start: int) -> dict[int, int]:
    """Fewest steps from node ``start`` to each node it reaches over :meth:`CompiledPattern.hops`."""
    dist = {start: 0}
    frontier = [start]
    while frontier:  # relax until nothing improves
        reached = []
        for n in frontier:
            for m, w in hops[n].items():
                if dist[n] + w < dist.get(m, 1 << 30):
                    dist[m] = dist[n] + w
                    reached.append(m)
        frontier = reached
    return dist
