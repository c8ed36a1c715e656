"""A choice of a pattern, compiled: the ops of each ``one_of`` become one choice node whose alternatives
are small compiled patterns.

The compiler calls :func:`split` on the ops of one level, which checks the choice rules and returns each
alternative as a :class:`Region` (read like a function); it compiles the regions and hands them to
:func:`choice_node`, which computes depth, slots and reads and stands in for the choice's ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coremltools.converters.mil.mil import Var

from .choices import Record
from .errors import PatternDefinitionError
from .graph import Alternative, Choice, CompiledPattern, edge_positions

__all__ = ["ChoiceOp", "Region", "Split", "choice_node", "split"]


@dataclass
class Region:
    """The ops of one alternative, read by the compiler as if they were a function."""

    operations: list[Any]
    inputs: dict[str, Var]
    outputs: list[Var]


class ChoiceOp:
    """Stands for a choice among the ops of its level while the compiler reads them."""

    op_type = "one_of"
    blocks: tuple[()] = ()

    def __init__(self, name: str, inputs: dict[str, Var], output: Var, choice: Choice) -> None:
        self.name, self.inputs, self.outputs, self.choice = name, inputs, [output], choice


@dataclass
class Split:
    """A choice found among the ops of one level, its alternatives not compiled yet."""

    record: Record
    regions: list[Region]
    """Per alternative, its ops with the slots it reads as inputs."""
    inputs: dict[str, Var]
    """The choice node's slots: the outside variables its alternatives read."""
    ops: list[Any]
    """The level's ops with the choice's ops replaced by a placeholder (None) at its first op."""


def split(ops: list[Any], record: Record, pattern_name: str) -> Split | None:
    """The choice ``record`` among ``ops``, or None when none of its ops is there.

    Raises:
        PatternDefinitionError: A rule of :mod:`~pattern_infra.language.choices` is broken.
    """
    region = {id(op) for alt_ops, _ in record.alternatives for op in alt_ops}
    first = next((i for i, op in enumerate(ops) if id(op) in region), None)
    if first is None:
        return None
    outside = [op for op in ops if id(op) not in region]
    _check_outside_reads(record, outside, region, pattern_name)
    regions, inputs = _regions(record, outside, pattern_name)
    rest = ops[:first] + [None] + [op for op in ops[first:] if id(op) not in region]
    return Split(record, regions, inputs, rest)


def choice_node(found: Split, compiled: list[CompiledPattern], pattern_name: str) -> list[Any]:
    """The level's ops with the choice's ops replaced by one :class:`ChoiceOp`, from its alternatives
    compiled (``compiled``, in order)."""
    record, inputs = found.record, found.inputs
    alternatives = [Alternative(c, list(region.inputs), _label(c)) for c, region in zip(compiled, found.regions)]
    reads: dict[str, int] = {}
    for slot, var in inputs.items():
        if var.op is None or var.op.op_type == "const":
            continue
        per_alt = [_uses(a.compiled, a.slots.index(slot)) for a in alternatives]
        if len(set(per_alt)) > 1:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: the alternatives of choice {record.name!r} read {var.name!r} a "
                f"different number of times ({per_alt}), so whether it has a consumer outside the match would "
                "depend on the alternative. Read it the same number of times in each (e.g. through one op).")
        reads[slot] = per_alt[0]
    choice = Choice(
        name=record.name,
        alternatives=alternatives,
        depth=max(_depth(a.compiled) for a in alternatives),
        output_types=frozenset(t for a in alternatives for n in a.compiled.final_nodes
                               for t in a.compiled.nodes[n].op_types),
        full_slots=frozenset(s for s in inputs if all(s in a.slots for a in alternatives)),
        reads=reads,
        uses={slot: next(_uses(a.compiled, a.slots.index(slot)) for a in alternatives if slot in a.slots)
              for slot in inputs},
    )
    stand_in = ChoiceOp(record.name, inputs, record.alternatives[0][1], choice)
    return [stand_in if op is None else op for op in found.ops]


def _vars_read(op: Any) -> list[Var]:
    return [v for value in op.inputs.values() for v in (value if isinstance(value, (list, tuple)) else [value])]


def _check_outside_reads(record: Record, outside: list[Any], region: set[int], pattern_name: str) -> None:
    kept = record.alternatives[0][1]
    for op in outside:
        for var in _vars_read(op):
            if var is not kept and var.op is not None and id(var.op) in region:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: op {op.name!r} reads {var.name!r}, built inside choice "
                    f"{record.name!r}. Only the choice's own variable (what one_of returns) may be used "
                    f"outside it; build the rest inside every alternative.")


def _regions(record: Record, outside: list[Any], pattern_name: str) -> tuple[list[Region], dict[str, Var]]:
    """The alternatives of ``record`` as regions whose inputs are the choice's slots, and the slots."""
    outside_names = {op.name for op in outside if op.op_type != "const"}
    alt_region = [{id(op) for op in alt_ops} for alt_ops, _ in record.alternatives]
    external: list[list[Var]] = []
    for k, (alt_ops, _) in enumerate(record.alternatives):
        reads: dict[int, Var] = {}
        for op in alt_ops:
            if op.op_type != "const" and op.name in outside_names:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: op name {op.name!r} in alternative {k} of choice "
                    f"{record.name!r} is also used outside the choice. Alternatives of one choice may "
                    f"share names; rename it so it differs from the ops outside.")
            for var in _vars_read(op):
                if var.op is not None and id(var.op) in alt_region[k]:
                    continue
                other = next((j for j, ids in enumerate(alt_region) if var.op is not None and id(var.op) in ids), None)
                if other is not None:
                    raise PatternDefinitionError(
                        f"Pattern {pattern_name!r}: alternative {k} of choice {record.name!r} reads "
                        f"{var.name!r}, built by alternative {other}. Alternatives are independent: "
                        f"build it again inside alternative {k}.")
                reads.setdefault(id(var), var)
        external.append(list(reads.values()))
    slots: dict[int, str] = {}
    inputs: dict[str, Var] = {}
    for var in (var for reads in external for var in reads if id(var) not in slots):
        slot = slots[id(var)] = var.name if var.name.isidentifier() and var.name not in inputs else f"in{len(inputs)}"
        inputs[slot] = var
    for var in inputs.values():
        missing = [k for k, reads in enumerate(external) if all(v is not var for v in reads)]
        if var.op is not None and var.op.op_type != "const" and missing:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op {var.op.name!r} is read by some alternatives of choice "
                f"{record.name!r} but not by alternative(s) {missing}, so nothing would match it when "
                f"those do. Build it inside the alternatives that read it.")
    return [Region(list(alt_ops), {slots[id(v)]: v for v in external[k]}, [out])
            for k, (alt_ops, out) in enumerate(record.alternatives)], inputs


def _uses(compiled: CompiledPattern, root: int) -> int:
    """How many times a match of ``compiled`` reads its input ``root``, through nested choices too."""
    return sum(compiled.nodes[n].choice.reads_of(slot) if compiled.nodes[n].choice else 1
               for n, slot, _ in compiled.root_consumers[root])


def _depth(compiled: CompiledPattern) -> int:
    depth: list[int] = []
    for node in compiled.nodes:
        own = node.choice.depth if node.choice is not None else 1
        preds = [depth[e.index] for edge in node.inputs.values() for _, e in edge_positions(edge) if e.kind == "op"]
        depth.append(own + max(preds, default=0))
    return max(depth)


def _label(compiled: CompiledPattern) -> str:
    """The alternative as an expression of its output, e.g. ``mul(x, rsqrt(var))``."""

    def text(index: int, budget: list[int]) -> str:
        node = compiled.nodes[index]
        budget[0] -= 1
        if budget[0] < 0:
            return "..."
        args = []
        for slot, edge in node.inputs.items():
            for _, e in edge_positions(edge):
                if e.kind == "root":
                    args.append(compiled.root_names[e.index])
                elif e.kind == "op":
                    args.append(text(e.index, budget))
                elif slot in ("x", "y"):  # an operand; other constants are attributes (axes, epsilon)
                    value = compiled.consts[e.index][1]
                    if value is not None and value.size == 1 and value.dtype.kind in "biuf":
                        args.append(f"{value.reshape(()).item():g}")
        kind = node.choice.name if node.choice is not None else node.op_type
        return f"{kind}({', '.join(args)})"

    return text(compiled.final_nodes[0], [12])
