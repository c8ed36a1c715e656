"""Turn a pattern ``mb.program`` into one :class:`CompiledPattern` per spelling (:mod:`~.variants`), each
rule enforced with an error naming the pattern, the op and the fix (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Operation, Program, Var

from .choices import records_of, regions_of
from .equivalences import Equivalences, with_equivalences
from .errors import PatternDefinitionError
from .graph import (
    COMMUTATIVE_OPS,
    CompiledPattern,
    ConstMode,
    ConstRule,
    Edge,
    PatternNode,
    distances,
    edge_positions,
)
from .pattern import RESERVED_NAMES
from .variants import MAX_VARIANTS, Guard, Variant, combos, count, renamed

__all__ = ["compile_pattern", "pattern_name_of", "require_program"]

logger = logging.getLogger(__name__)


def pattern_name_of(ops_arrangement: Any) -> str:
    """Best-effort name of a pattern program, for messages: its ``_pattern_name``, else its last op's name."""
    if getattr(ops_arrangement, "_pattern_name", None):
        return str(ops_arrangement._pattern_name)
    if not isinstance(ops_arrangement, Program) or "main" not in ops_arrangement.functions:
        return "<pattern>"
    real = [op.name for op in ops_arrangement.functions["main"].operations if op.op_type != "const"]
    return real[-1] if real else "<empty pattern>"


def require_program(value: Any, *, where: str, what: str = "the pattern") -> None:
    """The check of every entry point taking a pattern (or a program): ``value`` must be the MIL program
    ``@mb.program`` returns, not the function it decorates nor anything else.

    Args:
        value: What the caller was given.
        where: The entry point and ``what`` the value stands for, for the message.

    Raises:
        PatternDefinitionError: ``value`` is not a ``Program``; the message names what it is and the fix.
    """
    if isinstance(value, Program):
        return
    kind = type(value).__name__
    if callable(value):
        kind = f"function {getattr(value, '__qualname__', getattr(value, '__name__', repr(value)))!r}"
    raise PatternDefinitionError(
        f"{where}: {what} is a {kind}, not a MIL program; decorate the pattern function with "
        f"@mb.program(input_specs=[...]) (or @pattern_program(input_specs=[...])) and pass the program "
        f"it gives."
    )


def compile_pattern(
    ops_arrangement: Program | Sequence[Program] | Mapping[str, Program],
    *,
    name: str | None = None,
    commutative: bool | Iterable[str] = True,
    alternatives: Mapping[str, Sequence[str]] | None = None,
    constants: ConstMode | ConstRule = "any",
    const_rules: Mapping[str, ConstMode | ConstRule] | None = None,
    fanout: Iterable[str] = (),
    equivalences: Equivalences = False,
    where: str = "compile_pattern",
) -> CompiledPattern:
    """Reads a pattern program, or several, into a :class:`CompiledPattern`, enforcing the pattern rules.
    The options, ``commutative`` to ``equivalences``, are ``register_generic_pass``'s (documented there).
    Several programs (a sequence, or a mapping of names to programs) are one pattern whose spellings are
    theirs, in order (docs/LANGUAGE.md, "Several programs").

    Args:
        ops_arrangement: The pattern, an ``mb.program`` whose ops all carry unique names; or several.
        name: Name used in messages (default: the first pattern's last op name); the programs of a sequence
            are named ``<name>[i]``, those of a mapping by their keys.
        where: The entry point, for messages.

    Returns:
        Its first spelling, holding them all in ``variants`` (of several programs: a copy; see ``parts``).

    Raises:
        PatternDefinitionError: The pattern breaks a rule; the message names the rule and the fix.
    """
    named = [(name, ops_arrangement, f"pattern {name!r}" if name else "the pattern")]
    if isinstance(ops_arrangement, Mapping):
        named = [(str(key), p, f"pattern [{i}]") for i, (key, p) in enumerate(ops_arrangement.items())]
    elif isinstance(ops_arrangement, Sequence):
        named = [(name and f"{name}[{i}]", p, f"pattern [{i}]") for i, p in enumerate(ops_arrangement)]
    if not named:
        raise PatternDefinitionError(f"{where}: an empty list of patterns; give at least one pattern.")
    options = dict(
        commutative=commutative if isinstance(commutative, bool) else set(commutative),
        alternatives=dict(alternatives or {}),
        fanout=set(fanout),
        default_rule=constants if isinstance(constants, ConstRule) else ConstRule(constants),
        rules={k: v if isinstance(v, ConstRule) else ConstRule(v) for k, v in (const_rules or {}).items()},
    )
    parts = []
    for pattern_name, program, what in named:
        require_program(program, where=where, what=what)
        parts.append(_compile_program(program, pattern_name, options, equivalences))
    variants = [v for part in parts for v in part.variants]
    _check_options(name or parts[0].name, options, [v.compiled for v in variants])
    if len(parts) == 1:
        return parts[0]
    roots = max((part.root_names for part in parts), key=len)  # the inputs are shared by position
    return replace(parts[0], name=name or parts[0].name, root_names=roots, variants=variants, parts=parts)


def _compile_program(
    ops_arrangement: Program, pattern_name: str | None, options: dict[str, Any], equivalences: Equivalences
) -> CompiledPattern:
    """One program's spellings (the first holding all); no control flow, no fan-out op inside a choice."""
    pattern_name = pattern_name or pattern_name_of(ops_arrangement)
    if set(ops_arrangement.functions) != {"main"}:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} must have exactly one function named 'main'; it "
            f"has {sorted(ops_arrangement.functions)}."
        )
    func = ops_arrangement.functions["main"]
    if equivalences:
        regions_of(list(func.operations), records_of(func), pattern_name)  # the choices' rules, as written
        func = with_equivalences(func, pattern_name, equivalences)
    records = records_of(func)
    regions = regions_of(list(func.operations), records, pattern_name)
    for op in func.operations:
        if op.blocks:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op {op.name!r} ({op.op_type}) has nested blocks: "
                f"control flow cannot be part of a pattern; match the ops around it."
            )
    inside = {op.name for found in regions.values() for region in found for op in region.operations}
    if inside & options["fanout"]:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: fan-out op(s) {sorted(inside & options['fanout'])} "
            f"lie inside a choice; a fan-out op must be a last op outside every choice."
        )
    total = count(records, regions)
    if total > MAX_VARIANTS:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} stands for {total} spellings (the product of its choices' "
            f"alternatives), at most {MAX_VARIANTS} are searched (each compiles as a pattern of its own). "
            "Fix: register its parts as separate patterns (a list), or name fewer ops in equivalences=."
        )
    compiled = _compile(func, pattern_name, records, regions, options)
    spellings = [v.compiled for v in compiled.variants]
    unused = [name for r, name in enumerate(func.inputs) if not any(c.root_consumers[r] for c in spellings)]
    if unused:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: input {unused[0]!r} is used by no op. Remove it from input_specs, or "
            "use it."
        )
    return compiled


def _compile(
    func: Any,
    pattern_name: str,
    records: list[Any],
    regions: dict[int, Any],
    options: dict[str, Any],
) -> CompiledPattern:
    """Every spelling of a pattern function or region (inputs: the choice's slots), the first holding all."""
    earlier: dict[tuple[int, int], CompiledPattern] = {}

    def alternative(record: Any, k: int) -> CompiledPattern:  # compiled once, for the guards
        if (id(record), k) not in earlier:
            earlier[id(record), k] = _compile(
                regions[id(record)][k],
                f"{pattern_name}.{record.name}[{k}]",
                record.children.get(k, []),
                regions,
                dict(options, fanout=set()),
            )
        return earlier[id(record), k]

    variants = combos(records, list(func.outputs), regions)
    for variant in variants:
        variant.compiled = _compile_graph(func, pattern_name, options, variant)
        guards = []
        for record, k, out in variant.ends:
            alternatives = tuple(alternative(record, j) for j in range(k))
            spellings = [v.compiled for a in alternatives for v in a.variants]
            guards.append(
                Guard(
                    record.name,
                    k,
                    renamed(out, variant.renames).op.name,
                    record.fallback,
                    alternatives,
                    max(map(_depth, spellings)),
                    frozenset(t for c in spellings for n in c.final_nodes for t in c.nodes[n].op_types),
                )
            )
        variant.guards = tuple(guards)
    variants[0].compiled.variants = variants
    return variants[0].compiled


def _compile_graph(func: Any, pattern_name: str, options: dict[str, Any], combo: Variant) -> CompiledPattern:
    """One spelling of a pattern function or region as a plain pattern: the ops of ``combo``'s choices."""
    all_ops = [op for op in func.operations if id(op) not in combo.dropped]
    real_ops = [op for op in all_ops if op.op_type != "const"]
    if not real_ops:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} has no op other than constants; give it one to find, "
            f"e.g. `return mb.relu(x=x, name='relu')`."
        )
    rules, alternatives, commutative = options["rules"], options["alternatives"], options["commutative"]
    any_type = not isinstance(commutative, bool)

    by_name: dict[str, int] = {}
    for i, op in enumerate(real_ops):
        # a choice may share its name only with the op computing its variable
        if op.name in by_name or op.name in combo.chosen and op.name not in combo.aliases.get(op.name, ()):
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: two ops are named {op.name!r}. Give every op a unique `name=` "
                "argument."
            )
        if op.name in RESERVED_NAMES or op.name.startswith("_"):
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op name {op.name!r} is reserved by Pattern (or "
                f"private). Rename the op, e.g. name='{op.name.strip('_')}_op'."
            )
        if not op.name.isidentifier():
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op name {op.name!r} is not a Python identifier "
                f"(`pattern.{op.name}` reads it). Use letters, digits and underscores."
            )
        by_name[op.name] = i
    root_index = {id(v): i for i, v in enumerate(func.inputs.values())}
    op_of_output = {id(o): (by_name[op.name], j) for op in real_ops for j, o in enumerate(op.outputs)}
    const_op_ids = {id(op) for op in all_ops if op.op_type == "const"}
    outputs = [renamed(v, combo.renames) for v in func.outputs]
    for out in outputs:
        if id(out) not in op_of_output:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r} returns {out.name!r}, which no op of it computes; "
                f"return the output of the pattern's last op."
            )
    final_nodes = list(dict.fromkeys(op_of_output[id(out)][0] for out in outputs))
    consts: list[tuple[str, np.ndarray | None, ConstRule]] = []
    const_names: list[str] = []

    def edge_for(var: Var, op: Operation, slot: str) -> Edge:
        var = renamed(var, combo.renames)
        if id(var) in root_index:
            return Edge("root", root_index[id(var)])
        if id(var) in op_of_output:
            return Edge("op", *op_of_output[id(var)])
        if var.op is not None and id(var.op) in const_op_ids:
            key = f"{op.name}.{slot}"
            value = None if var.val is None else np.asarray(var.val)
            consts.append((key, value, rules.get(key) or rules.get(var.op.name) or options["default_rule"]))
            const_names.append(var.op.name)
            return Edge("const", len(consts) - 1)
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: input {slot!r} of op {op.name!r} comes from "
            f"{var.name!r}, which is neither a pattern input, a pattern op nor a constant."
        )

    nodes: list[PatternNode] = []
    root_consumers: list[list[tuple[int, str, int]]] = [[] for _ in func.inputs]
    for i, op in enumerate(real_ops):
        inputs: dict[str, Edge | tuple[Edge, ...]] = {
            slot: tuple(edge_for(v, op, slot) for v in value)
            if isinstance(value, (tuple, list))
            else edge_for(value, op, slot)
            for slot, value in op.inputs.items()
        }
        op_types = frozenset(alternatives.get(op.name) or {op.op_type})
        if op.op_type not in op_types:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: alternatives for op {op.name!r} are "
                f"{sorted(op_types)} but the op itself is {op.op_type!r}; include it."
            )
        # decided per matched program op: an op may swap when any type it accepts is commutative
        can_swap = (
            "x" in inputs
            and "y" in inputs
            and (op.name in commutative if any_type else commutative and bool(COMMUTATIVE_OPS & op_types))
        )
        nodes.append(
            PatternNode(
                index=i,
                name=op.name,
                op_type=op.op_type,
                num_outputs=len(op.outputs),
                inputs=inputs,
                op_types=op_types,
                commutative=can_swap,
                swap_any_type=can_swap and any_type,
                is_final=i in final_nodes,
                output_uses=[0] * len(op.outputs),
            )
        )
        for slot, edge in inputs.items():  # a producer comes before its consumers
            for pos, e in edge_positions(edge):
                if e.kind == "root":
                    root_consumers[e.index].append((i, slot, pos))
                elif e.kind == "op":
                    nodes[e.index].output_uses[e.output] += 1
                    nodes[e.index].consumers.append((i, slot, pos, e.output))

    stray = [n.name for n in nodes if not n.consumers and n.index not in final_nodes]
    if stray:
        last = [nodes[i].name for i in final_nodes]
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} has more than one last op: {stray + last} have no consumer in the "
            f"pattern but only {last} is returned. To match several outputs, return every one of them from "
            "the pattern program."
        )
    compiled = CompiledPattern(
        name=pattern_name,
        nodes=nodes,
        root_names=list(func.inputs),
        root_consumers=root_consumers,
        consts=consts,
        const_names=const_names,
        final_nodes=final_nodes,
        by_name=by_name,
    )
    _mark_fanout(compiled, options["fanout"])
    reached = distances(compiled.hops(True), 0)
    if len(reached) != len(nodes):
        apart = [n.name for n in nodes if n.index not in reached]
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} falls apart: ops {apart} share no variable with op "
            f"{nodes[0].name!r}. Register unrelated sequences as separate patterns."
        )
    logger.debug(
        "compiled pattern %r [%s]", pattern_name, ", ".join(f"{n.name}:{n.op_type_label}" for n in nodes)
    )
    return compiled


def _check_options(pattern_name: str, options: dict[str, Any], spellings: list[CompiledPattern]) -> None:
    """Every op the options name and every const rule's constant is one of some spelling."""
    everywhere = {name for c in spellings for name in c.node_names}
    for option in ("alternatives", "commutative", "fanout"):
        unknown = set() if isinstance(options[option], bool) else set(options[option]) - everywhere
        if unknown:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: {option} names op(s) {sorted(unknown)}, which the "
                f"pattern does not have. Pattern ops: {sorted(everywhere)}."
            )
    known = {key for c in spellings for key in (*c.const_keys, *c.const_names)}
    unknown = set(options["rules"]) - known
    if unknown:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: const_rules name {sorted(unknown)}, which are not constants of the "
            f"pattern. Keys are '<op name>.<slot>' or a const op's name; constants: {sorted(known)}."
        )


def _depth(compiled: CompiledPattern) -> int:
    """Most ops on a path through ``compiled`` (its nodes come in program order, producers first)."""
    depth = [1] * len(compiled.nodes)
    for node in compiled.nodes:
        for consumer, _, _, _ in node.consumers:
            depth[consumer] = max(depth[consumer], depth[node.index] + 1)
    return max(depth)


def _mark_fanout(compiled: CompiledPattern, fanout: set[str]) -> None:
    pattern_name, nodes = compiled.name, compiled.nodes
    for name in sorted(fanout & compiled.by_name.keys()):  # another program of a list may have the op
        node = nodes[compiled.by_name[name]]
        if not node.is_final:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op {name!r} is consumed in the pattern; "
                f"a fan-out op must be a last op (return it from the pattern)."
            )
        sources = [e for edge in node.inputs.values() for _, e in edge_positions(edge) if e.kind != "const"]
        if len(sources) != 1:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op {name!r} reads {len(sources)} variables"
                f"; it must read one (an input or op output), whose consumers it captures."
            )
        node.fanout = True
    if all(n.fanout for n in nodes):  # nodes is never empty
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: every op is a fan-out op; it needs one ordinary op."
        )
