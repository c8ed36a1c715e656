"""The alternatives of a pattern's choices, read like functions: :func:`regions_of` checks the choice rules
of :mod:`~pattern_infra.language.choices` at every level and returns each alternative as a
:class:`Region` whose inputs (the choice's *slots*) are the outside variables it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Var

from .choices import Record
from .errors import PatternDefinitionError

__all__ = ["Region", "regions_of"]


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
    """Per choice among ``ops`` and nested in its alternatives (keyed by ``id`` of its :class:`Record`),
    its alternatives as regions, in order.

    Raises:
        PatternDefinitionError: A rule of :mod:`~pattern_infra.language.choices` is broken.
    """
    found: dict[int, list[Region]] = {}
    level = [op for op in ops if op.op_type != "const"]
    for record in records:
        region = {id(op) for alt_ops, _ in record.alternatives for op in alt_ops}
        if not any(id(op) in region for op in level):
            continue
        outside = [op for op in level if id(op) not in region]
        _check_outside_reads(record, outside, region, pattern_name)
        regions = found[id(record)] = _regions(record, outside, pattern_name)
        for k, (alt_ops, _) in enumerate(record.alternatives):
            found.update(regions_of(alt_ops, record.children.get(k, []), pattern_name))
        _check_reads(record, regions, pattern_name)
    return found


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


def _regions(record: Record, outside: list[Any], pattern_name: str) -> list[Region]:
    """The alternatives of ``record`` as regions whose inputs are the choice's slots."""
    outside_names = {op.name for op in outside}
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
    regions = []
    for k, (alt_ops, out) in enumerate(record.alternatives):
        names = {id(v): slots[id(v)] for v in external[k]}
        regions.append(Region(list(alt_ops), {names[id(v)]: v for v in external[k]}, [out], _label(out, names)))
    return regions


def _check_reads(record: Record, regions: list[Region], pattern_name: str) -> None:
    """An outside op's output is read as many times by every alternative: whether it has a consumer
    outside the match must not depend on the alternative."""
    for slot, var in regions[0].inputs.items():
        if var.op is None or var.op.op_type == "const":
            continue
        per_alt = [_reads(ops, record.children.get(k, []), var) for k, (ops, _) in enumerate(record.alternatives)]
        if len(set(per_alt)) > 1:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: the alternatives of choice {record.name!r} read {var.name!r} a "
                f"different number of times ({per_alt}), so whether it has a consumer outside the match would "
                "depend on the alternative. Read it the same number of times in each (e.g. through one op).")


def _reads(ops: list[Any], nested: list[Record], var: Var) -> int:
    """How many times one spelling of ``ops`` (nested choices at their first alternative) reads ``var``."""
    inner = {id(op) for record in nested for alt_ops, _ in record.alternatives for op in alt_ops}
    own = sum(v is var for op in ops if id(op) not in inner for v in _vars_read(op))
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
        for slot, value in op.inputs.items():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v.op is None or v.op.op_type != "const" or id(v) in slots:
                    args.append(text(v))
                elif slot in ("x", "y") and v.val is not None:  # an operand; other constants are attributes
                    value = np.asarray(v.val)
                    if value.size == 1 and value.dtype.kind in "biuf":
                        args.append(f"{value.reshape(()).item():g}")
        return f"{op.op_type}({', '.join(args)})"

    return text(out)
