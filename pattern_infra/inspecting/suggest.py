"""``suggest``: the repeated subgraphs of a program worth fusing, as pattern sources ready to register.

What counts as a candidate: a set of 2 to ``max_ops`` non-const ops of one block (nested blocks are mined
too) with **one output op**: every other op's results are read only inside the set and are not block
outputs. That is what fusing into one op needs, and what a pattern with one last op matches. Two sets
are the same candidate when they are equal up to the pattern language's equivalence: op types, input
slots, either operand order of a commutative op (:data:`COMMUTATIVE_OPS`), the sharing of inputs, and
constants by role (a constant operand is a leaf, whatever its value).

The algorithm, near-linear in the program's size for a fixed ``max_ops``:

1. Every op is indexed once: its producers and consumers in its block, whether it may join a set (not a
   const, no nested block, not a layer op of ``layers``, no op of a match of a pass in ``covered_by``).
2. From each op as the output op, sets are grown along data edges towards producers, smallest first,
   adding a producer only when all its consumers are already in the set (so each set is grown from its
   output op only, and at most :data:`MAX_SETS_PER_OP` sets per op are grown).
3. Each set gets a canonical code: a depth-first walk from the output op, operand slots by name, the
   operands of a commutative op ordered by the code of the tree under each (ties tried both ways, the
   smallest code kept), ops and inputs numbered in the order the walk meets them. Sets are grouped by
   code (a dict: hashed).
4. Per code, occurrences are taken greedily in program order (by the sorted positions of their ops),
   each one sharing no op with those taken; a code with ``min_count`` occurrences is a candidate.
5. Ranking: by ops saved (``count * (size - 1)``), then size, then first occurrence. A candidate whose
   every occurrence lies inside an occurrence of one larger candidate saving at least as many ops is
   nested in it and hidden unless ``nested=True`` (its ``inside`` names the larger one).

Layer ops (``linear``, ``conv``, ``conv_transpose`` by default) stay out of candidates: they carry the
model's weights and sit between the repeats, so a set grown into them would join each repeat to its
neighbouring layer and hide the glue that repeats (``layers=()`` mines through them).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Operation, Program, Var

from ..authoring.find import find_matches
from ..language.graph import COMMUTATIVE_OPS
from ..passes.registry import generic_passes
from ..rewriting.blocks import walk_blocks
from ..rewriting.subpass import SubPass
from .suggest_source import candidate_module, literal, pattern_source

__all__ = ["Candidate", "LAYER_OPS", "MAX_SETS_PER_OP", "candidate_module", "suggest"]

LAYER_OPS: frozenset[str] = frozenset({"linear", "conv", "conv_transpose"})
"""Op types left out of candidates by default (see the module docstring)."""

MAX_SETS_PER_OP = 256
"""Sets grown from one output op at most, smallest first: bounds the work per op."""

LITERAL_SIZE = 16
"""Constants of at most this many elements, equal in every occurrence, are written as values (a
``constants="value"`` rule); larger or differing ones as a placeholder with a ``"const"`` rule."""


@dataclass
class Candidate:
    """A repeated subgraph worth fusing."""

    op_types: list[str]
    """Its ops' types, in pattern order (producers first, the output op last)."""
    count: int
    """Occurrences taken, sharing no op."""
    where: list[list[str]]
    """Per occurrence, the names of its program ops, in pattern order."""
    source: str
    """An ``mb.program`` pattern named ``pattern`` and the ``OPTIONS`` to find it with."""
    options: dict[str, Any] = field(default_factory=dict)
    """The options of ``source``'s ``OPTIONS`` (``constants="value"``, and ``const_rules`` if any)."""
    inside: int | None = None
    """For a nested candidate: the index (in :func:`suggest`'s full ranking) of the one it lies inside."""

    @property
    def size(self) -> int:
        """Ops per occurrence."""
        return len(self.op_types)

    @property
    def saved(self) -> int:
        """Ops saved by fusing each occurrence into one op."""
        return self.count * (self.size - 1)


class _Index:
    """Step 1: every op of every block, by position; producers, consumers, whether it may join a set."""

    def __init__(self, prog: Program, barred: set[int], layers: frozenset[str]) -> None:
        self.ops: list[Operation] = []
        pos: dict[int, int] = {}
        for block, _ in walk_blocks(prog):
            for op in block.operations:
                pos[id(op)] = len(self.ops)
                self.ops.append(op)
        self.pos = pos
        n = len(self.ops)
        self.joinable = [False] * n
        self.closed = [False] * n  # every consumer in the block, no output a block output
        self.consumers: list[frozenset[int]] = [frozenset()] * n
        self.producers: list[tuple[int, ...]] = [()] * n
        self.inputs: list[dict[str, Any]] = [{}] * n  # slot -> value, slots sorted (op.inputs copies)
        self.commutative = [False] * n
        for i, op in enumerate(self.ops):
            block = op.enclosing_block
            if (
                op.op_type == "const"
                or op.op_type.startswith("constexpr_")
                or op.blocks
                or op.op_type in layers
                or id(op) in barred
            ):
                continue
            self.joinable[i] = True
            self.inputs[i] = dict(sorted(op.inputs.items()))
            self.commutative[i] = op.op_type in COMMUTATIVE_OPS and {"x", "y"} <= self.inputs[i].keys()
            outs = set(id(v) for v in block.outputs)
            users = [c for v in op.outputs for c in v.child_ops]
            self.closed[i] = bool(users) and not any(id(v) in outs for v in op.outputs)
            self.closed[i] &= all(c.enclosing_block is block for c in users)
            self.consumers[i] = frozenset(pos[id(c)] for c in users if id(c) in pos)
            self.producers[i] = tuple(
                dict.fromkeys(
                    pos[id(v.op)] for v in _vars(op) if v.op is not None and v.op.enclosing_block is block
                )
            )

    def grow(self, sink: int, max_ops: int) -> Iterable[frozenset[int]]:
        """Step 2: the sets with output op ``sink``, of 2 to ``max_ops`` ops, smallest first."""
        level = [frozenset((sink,))]
        seen: set[frozenset[int]] = set(level)
        for _ in range(max_ops - 1):
            grown = []
            for members in level:
                for member in members:
                    for p in self.producers[member]:
                        if p in members or not self.joinable[p] or not self.closed[p]:
                            continue
                        if not self.consumers[p] <= members:
                            continue
                        bigger = members | {p}
                        if bigger not in seen:
                            if len(seen) > MAX_SETS_PER_OP:
                                return
                            seen.add(bigger)
                            grown.append(bigger)
                            yield bigger
            level = grown


def _vars(op: Operation) -> Iterable[Var]:
    for value in op.inputs.values():
        yield from value if isinstance(value, (list, tuple)) else (value,)


def _is_const(var: Var) -> bool:
    return var.op is not None and var.op.op_type == "const"


class _Canon:
    """Step 3: the canonical code of a set, and its ops and inputs in the code's order."""

    def __init__(self, index: _Index, members: frozenset[int]) -> None:
        self.index, self.members = index, members
        self.tree: dict[int, tuple[Any, ...]] = {}

    def ref(self, var: Var) -> tuple[Any, ...]:
        if var.op is not None and self.index.pos.get(id(var.op)) in self.members:
            return ("o", var.op.outputs.index(var), self.tree_code(self.index.pos[id(var.op)]))
        return ("c",) if _is_const(var) else ("r",)

    def tree_code(self, i: int) -> tuple[Any, ...]:
        """The code of the tree under op ``i`` (sharing ignored), the same in either operand order."""
        if i not in self.tree:
            op = self.index.ops[i]
            slots = []
            for slot, value in self.index.inputs[i].items():
                items = value if isinstance(value, (list, tuple)) else None
                slots.append(
                    (slot, tuple(self.ref(v) for v in items) if items is not None else self.ref(value))
                )
            if self.index.commutative[i]:
                (sx, cx), (sy, cy) = [s for s in slots if s[0] in "xy"]
                rest = [s for s in slots if s[0] not in ("x", "y")]
                slots = [(sx, min(cx, cy)), (sy, max(cx, cy)), *rest]
            self.tree[i] = (op.op_type, len(op.outputs), tuple(slots))
        return self.tree[i]

    def code(self, sink: int) -> tuple[tuple[Any, ...], list[int], list[Var], list[tuple[int, str, int]]]:
        """The code, the ops in its order, the inputs in its order and the constant slots (op, slot, k)."""
        inputs = self.index.inputs
        ties = [
            i
            for i in sorted(self.members)
            if self.index.commutative[i]
            and inputs[i]["x"] is not inputs[i]["y"]
            and self.ref(inputs[i]["x"]) == self.ref(inputs[i]["y"])
        ][:4]
        best = None
        for flips in itertools.product((False, True), repeat=len(ties)):
            found = self._walk(sink, dict(zip(ties, flips)))
            if best is None or found[0] < best[0]:
                best = found
        assert best is not None
        return best

    def _walk(self, sink: int, flips: dict[int, bool]) -> Any:
        number: dict[int, int] = {}
        roots: dict[int, int] = {}
        root_vars: list[Var] = []
        order: list[int] = []
        entries: list[Any] = []
        consts: list[tuple[int, str, int]] = []

        def operands(i: int) -> list[tuple[str, Any, str]]:
            """(pattern slot, value, program slot): a commutative op's operands in canonical order."""
            inputs = self.index.inputs[i]
            swap = False
            if self.index.commutative[i]:
                rx, ry = self.ref(inputs["x"]), self.ref(inputs["y"])
                swap = ry < rx or (rx == ry and flips.get(i, False))
            other = {"x": "y", "y": "x"}
            return [
                (s, inputs[other[s]], other[s]) if swap and s in other else (s, value, s)
                for s, value in inputs.items()
            ]

        def visit(i: int) -> None:
            pairs = operands(i)
            for _, value, _ in pairs:
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    p = self.index.pos.get(id(v.op)) if v.op is not None else None
                    if p in self.members and p not in number:
                        visit(p)
            refs = []
            for slot, value, program_slot in pairs:
                items: list[tuple[Any, ...]] = []
                for k, v in enumerate(value if isinstance(value, (list, tuple)) else (value,)):
                    p = self.index.pos.get(id(v.op)) if v.op is not None else None
                    if p in self.members:
                        items.append(("o", number[p], v.op.outputs.index(v)))
                    elif _is_const(v):
                        items.append(("c",))
                        consts.append((len(order), program_slot, k))
                    else:
                        if id(v) not in roots:
                            roots[id(v)] = len(roots)
                            root_vars.append(v)
                        items.append(("r", roots[id(v)]))
                refs.append((slot, tuple(items) if isinstance(value, (list, tuple)) else items[0]))
            op = self.index.ops[i]
            number[i] = len(order)
            order.append(i)
            entries.append((op.op_type, len(op.outputs), tuple(refs)))

        visit(sink)
        return tuple(entries), order, root_vars, consts


def _covered(prog: Program, covered_by: Iterable[Any] | None) -> set[int]:
    """Ids of the ops of every match of the passes (or patterns) in ``covered_by``."""
    sources: list[Any] = []
    for item in generic_passes().values() if covered_by is None else covered_by:
        subs = getattr(item, "passes", None)
        sources += [s for s in subs if isinstance(s, SubPass)] if subs is not None else [item]
    return {id(op) for source in sources for match in find_matches(source, prog) for op in match.op_list()}


def suggest(
    program: Program,
    max_ops: int = 8,
    min_count: int = 2,
    covered_by: Iterable[Any] | None = None,
    *,
    layers: Iterable[str] = LAYER_OPS,
    nested: bool = False,
) -> list[Candidate]:
    """The repeated subgraphs of ``program`` worth fusing, best first (see the module docstring).

    Args:
        program: The program to mine (every block, nested ones too); not changed.
        max_ops: Most ops in a candidate (at least 2).
        min_count: Fewest occurrences, sharing no op, of a candidate (at least 2).
        covered_by: Passes (``PassContainer`` s, pass ids) or patterns whose matches are left out: an op
            of one of their matches joins no candidate. Default: the registered generic passes
            (``import generic_passes`` registers the project's); ``()`` for none.
        layers: Op types that join no candidate.
        nested: Also return candidates nested inside a larger, better one.

    Returns:
        The candidates, ranked by ops saved.

    Raises:
        PatternInfraError: ``max_ops`` or ``min_count`` below 2.
    """
    from ..language.errors import PatternInfraError

    if max_ops < 2 or min_count < 2:
        raise PatternInfraError(
            f"suggest: max_ops={max_ops}, min_count={min_count}; a repeat needs at least 2 ops and 2 "
            f"occurrences: give values of 2 or more."
        )
    index = _Index(program, _covered(program, covered_by), frozenset(layers))
    groups: dict[tuple[Any, ...], list[tuple[tuple[int, ...], list[int], list[Var], list[Any]]]] = {}
    for sink in range(len(index.ops)):
        if not index.joinable[sink]:
            continue
        for members in index.grow(sink, max_ops):
            code, order, roots, consts = _Canon(index, members).code(sink)
            groups.setdefault(code, []).append((tuple(sorted(members)), order, roots, consts))
    ranked = []
    for code, found in groups.items():
        if len(found) < min_count:
            continue
        found.sort(key=lambda item: item[0])
        taken: list[Any] = []
        used: set[int] = set()
        for item in found:
            if used.isdisjoint(item[0]):
                taken.append(item)
                used.update(item[0])
        if len(taken) >= min_count:
            ranked.append(_candidate(index, program, code, taken))
    ranked.sort(key=lambda c: (-c.saved, -c.size, c.where[0]))
    _mark_nested(ranked)
    return ranked if nested else [c for c in ranked if c.inside is None]


def _mark_nested(ranked: list[Candidate]) -> None:
    """Step 5: sets ``inside`` of each candidate whose every occurrence lies in one of a larger one."""
    holders: dict[str, list[tuple[int, frozenset[str]]]] = {}
    for k, cand in enumerate(ranked):
        for names in cand.where:
            held = frozenset(names)
            for name in names:
                holders.setdefault(name, []).append((k, held))
    for k, cand in enumerate(ranked):
        common: set[int] | None = None
        for names in cand.where:
            held = frozenset(names)
            here = {
                j
                for j, other in holders[names[0]]
                if j != k and held < other and ranked[j].saved >= cand.saved
            }
            common = here if common is None else common & here
            if not common:
                break
        if common:
            cand.inside = min(common)


def _candidate(index: _Index, prog: Program, code: Any, taken: list[Any]) -> Candidate:
    _, first, roots, consts = taken[0]
    ops = [index.ops[i] for i in first]
    where = [[index.ops[i].name for i in order] for _, order, _, _ in taken]
    names: list[str] = []
    per_type: dict[str, int] = {}
    for op in ops:
        k = per_type.get(op.op_type, 0)
        per_type[op.op_type] = k + 1
        names.append(f"{op.op_type}_{k}")
    written: dict[tuple[int, str, int], str] = {}
    const_rules: dict[str, str] = {}
    for j, (position, slot, k) in enumerate(consts):
        values = [_const_at(index.ops[order[c[j][0]]], c[j][1], c[j][2]) for _, order, _, c in taken]
        first_value = values[0]
        same = all(_same(first_value, v) for v in values[1:])
        if same and first_value.size <= LITERAL_SIZE:
            written[(position, slot, k)] = literal(first_value)
        else:
            written[(position, slot, k)] = (
                literal(first_value)
                if first_value.size <= LITERAL_SIZE
                else f"np.zeros({first_value.shape}, dtype=np.{first_value.dtype.name})"
            )
            const_rules[f"{names[position]}.{slot}"] = "const"
    options: dict[str, Any] = {"constants": "value"}
    if const_rules:
        options["const_rules"] = const_rules
    source = pattern_source(ops, names, roots, written, options, prog)
    return Candidate([op.op_type for op in ops], len(taken), where, source, options)


def _const_at(op: Operation, slot: str, k: int) -> np.ndarray:
    value = op.inputs[slot]
    var = value[k] if isinstance(value, (list, tuple)) else value
    return np.asarray(var.val)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
