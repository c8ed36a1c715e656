"""What a compiled pattern is: the graph :func:`~pattern_infra.compiler.compile_pattern` makes of a pattern
program (:class:`CompiledPattern`: :class:`PatternNode` ops joined by :class:`Edge` s, constant rules
:class:`ConstRule`), read by the matcher, the generator and the choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from coremltools.converters.mil.mil import Program, Var

from .choices import Choice
from .errors import PatternDefinitionError

__all__ = ["COMMUTATIVE_OPS", "CompiledPattern", "ConstMode", "ConstRule", "Edge", "PatternNode", "edge_positions"]

COMMUTATIVE_OPS: frozenset[str] = frozenset(
    {
        "add",
        "mul",
        "maximum",
        "minimum",
        "equal",
        "not_equal",
        "logical_and",
        "logical_or",
        "logical_xor",
    }
)
"""MIL binary ops whose ``x`` and ``y`` may be swapped; the matcher tries both orders itself."""

ConstMode = Literal["any", "const", "value"]


@dataclass(frozen=True)
class ConstRule:
    """What a pattern constant demands of the program variable in its slot.

    Whatever the mode, the variable may never be computed by an op inside the match.
    """

    mode: ConstMode = "any"
    """``"any"``: anything; ``"const"``: a compile-time constant; ``"value"``: a constant close to the
    pattern's value."""
    rtol: float = 1e-5
    """Relative tolerance of ``"value"``."""
    atol: float = 1e-6
    """Absolute tolerance of ``"value"``."""

    def __post_init__(self) -> None:
        if self.mode not in ("any", "const", "value"):
            raise PatternDefinitionError(
                f"ConstRule mode {self.mode!r} is not one of 'any', 'const', 'value'."
            )

    def scalar_bounds(self, expected: np.ndarray, dtype: np.dtype[Any]) -> tuple[float, float]:
        """The value a scalar constant of ``dtype`` is compared with, and the tolerance: the pattern's
        ``expected`` rounded to ``dtype`` when both are floats (a float16 program holds the float16
        rounding of the pattern's value), and ``atol + rtol * |value|``."""
        e = float(_in_dtype(expected, dtype).reshape(()))
        return e, self.atol + self.rtol * abs(e)

    def accepts(self, var: Var, expected: np.ndarray | None) -> str | None:
        """Returns None when ``var`` satisfies the rule, else the reason it does not.

        ``"value"`` compares in the program constant's dtype: the pattern's value is first rounded to it
        (see :meth:`scalar_bounds`)."""
        if self.mode == "any":
            return None
        val = var.val
        if val is None:
            return f"operand {var.name} is not a compile-time constant"
        if self.mode == "const" or expected is None:
            return None
        got = np.asarray(val)
        if got.dtype.kind not in "biuf" or expected.dtype.kind not in "biuf":
            return None if np.array_equal(got, expected) else f"constant {var.name} differs"
        if expected.size == 1 and got.size != 1:
            return f"constant {var.name} has {got.size} elements where the pattern has a scalar"
        if expected.size == 1 and got.dtype.kind in "biuf" and expected.dtype.kind in "biuf":
            g = float(got.reshape(()))
            e, tol = self.scalar_bounds(expected, got.dtype)
            if abs(g - e) <= tol:
                return None
            rounded = f" (in {got.dtype}: {e!r})" if e != float(expected.reshape(())) else ""
            return f"constant {var.name} = {g!r} differs from the pattern's {float(expected.reshape(()))!r}{rounded}"
        if expected.size != 1 and got.shape != expected.shape:
            return f"constant {var.name} has shape {got.shape}, the pattern's has {expected.shape}"
        try:
            close = np.allclose(got, _in_dtype(expected, got.dtype), rtol=self.rtol, atol=self.atol)
        except ValueError:
            close = False
        if not close:
            return (
                f"constant {var.name} = {_short(got)} differs from the pattern's {_short(expected)}"
            )
        return None


def _in_dtype(expected: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``expected`` rounded to ``dtype`` when both are floating-point, else as it is."""
    if expected.dtype.kind == "f" and dtype.kind == "f" and expected.dtype != dtype:
        with np.errstate(over="ignore"):
            return expected.astype(dtype)
    return expected


def _short(value: np.ndarray) -> str:
    flat = np.asarray(value).ravel()
    return repr(flat[0].item()) if flat.size == 1 else f"array{tuple(np.shape(value))}"


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
    """The edges of one input slot with their position: ``(-1, edge)`` for a single value, ``(i, e)``
    for each element of a tuple slot."""
    if isinstance(edge, tuple):
        return list(enumerate(edge))
    return [(-1, edge)]


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
    """Number of outputs the program op must have."""
    inputs: dict[str, Edge | tuple[Edge, ...]]
    """Input slot name to its edge (a tuple for tuple inputs such as ``concat(values=...)``)."""
    commutative: bool
    """Whether ``x`` and ``y`` may be swapped when the matched program op is commutative."""
    swap_any_type: bool = False
    """Whether ``x`` and ``y`` are tried in both orders whatever op type matched (named explicitly in
    ``commutative=[...]``, e.g. for an ``add``/``sub`` alternative whose transform reads the sides)."""
    is_final: bool = False
    """Whether the outputs may be used outside the match."""
    fanout: bool = False
    """Whether this node stands for *every* consumer of its input variable (all of one kind): the
    match captures them as a list (TFLite's ``MultipleSameOps``)."""
    output_uses: list[int] = field(default_factory=list)
    """For each output, how many pattern edges consume it."""
    consumers: list[tuple[int, str, int, int]] = field(default_factory=list)
    """Edges leaving this node: (consumer node, slot, position in a tuple slot or -1, output index)."""
    choice: Choice | None = None
    """For a choice node (:func:`~pattern_infra.choices.one_of`): its alternatives, each a small compiled
    pattern; its slots are the outside variables they read, and it binds the op computing its variable."""

    @property
    def op_type_label(self) -> str:
        """The accepted op types, for messages."""
        return "|".join(sorted(self.op_types))


@dataclass
class CompiledPattern:
    """A pattern program read into nodes, roots and constants; immutable once built."""

    name: str
    """The pattern's name (the function name of the ``mb.program``)."""
    program: Program
    """The pattern program itself."""
    nodes: list[PatternNode]
    """Pattern ops in the pattern's program order."""
    root_names: list[str]
    """Names of the pattern's inputs, in order."""
    root_consumers: list[list[tuple[int, str, int]]]
    """For each root: (consumer node, slot, position or -1)."""
    consts: list[tuple[str, np.ndarray | None, ConstRule]]
    """For each constant use: (key ``"<op>.<slot>"``, value, rule)."""
    const_names: list[str]
    """For each constant use: the name of the pattern's const op."""
    final_nodes: list[int]
    """Indices of the final nodes, in the order the pattern returns them."""
    by_name: dict[str, int]
    """Node name to node index."""

    @cached_property
    def node_names(self) -> tuple[str, ...]:
        """The nodes' names, in node order."""
        return tuple(node.name for node in self.nodes)

    @cached_property
    def const_keys(self) -> tuple[str, ...]:
        """The keys of ``consts``, in order."""
        return tuple(key for key, _, _ in self.consts)

    @cached_property
    def spellings(self) -> dict[frozenset[tuple[str, int]], Any]:
        """The :class:`~pattern_infra.spelling.Spelling` of each spelling matched so far, by its choices
        (:func:`~pattern_infra.spelling.spelling_of`)."""
        return {}

    @cached_property
    def final_names(self) -> tuple[str, ...]:
        """The names of the final nodes, in the order the pattern returns them."""
        return tuple(self.nodes[i].name for i in self.final_nodes)

    def node(self, name: str) -> PatternNode:
        """Returns the node named ``name``."""
        return self.nodes[self.by_name[name]]

    def describe(self) -> str:
        """A one-line summary, for logs and messages."""
        ops = ", ".join(f"{n.name}:{n.op_type_label}" for n in self.nodes)
        return f"pattern {self.name!r} [{ops}]"
