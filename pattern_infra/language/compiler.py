"""Turn a pattern written as an ``mb.program`` into a graph the matcher can search.

A pattern program is read once, at registration, into a :class:`CompiledPattern`:

1. Every non-``const`` op becomes a :class:`PatternNode` (its name, the op types it accepts, its number
   of outputs, and one :class:`Edge` per input slot).
2. Every function input becomes a *root* (``Edge.kind == "root"``): any program variable may stand there,
   and it may have any number of consumers outside the match.
3. Every ``const`` op becomes a *constant placeholder* (``Edge.kind == "const"``), one per use, with a
   :class:`ConstRule` saying what the program must have in that slot: anything not computed inside the
   match (``"any"``, the default, as in the design document), a compile-time constant (``"const"``), or a
   constant of the same value within a tolerance (``"value"``).
4. The *final ops* are the ops producing the program's outputs; their outputs may be used anywhere. Every
   other op's outputs must be consumed only inside the match.

The rules of the design document are enforced here, with an error naming the pattern, the op and the fix:
unique op names, exactly one last op unless the program returns several outputs, at least one op, no op
named like a reserved :class:`~pattern_infra.language.pattern.Pattern` attribute, no unused input, one connected
pattern.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Operation, Program, Var

from .alternatives import Region, choice_node, split
from .choices import records_of
from .equivalences import Equivalences, with_equivalences
from .errors import PatternDefinitionError
from .pattern import RESERVED_NAMES
from .graph import (
    COMMUTATIVE_OPS,
    CompiledPattern,
    ConstMode,
    ConstRule,
    Edge,
    PatternNode,
    edge_positions,
)

__all__ = [
    "COMMUTATIVE_OPS",
    "RESERVED_NAMES",
    "ConstRule",
    "Edge",
    "PatternNode",
    "CompiledPattern",
    "compile_pattern",
    "edge_positions",
]

logger = logging.getLogger(__name__)

def _function_of(ops_arrangement: Any, pattern_name: str):
    if not isinstance(ops_arrangement, Program):
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} must be a MIL program built with @mb.program, got "
            f"{type(ops_arrangement).__name__}. Decorate the pattern function with "
            f"@mb.program(input_specs=[...])."
        )
    functions = ops_arrangement.functions
    if "main" not in functions or len(functions) != 1:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} must have exactly one function named 'main'; it has "
            f"{sorted(functions)}."
        )
    return functions["main"]


def pattern_name_of(ops_arrangement: Any) -> str:
    """Best-effort name of a pattern program, for messages."""
    name = getattr(ops_arrangement, "_pattern_name", None)
    if name:
        return str(name)
    try:
        ops = list(ops_arrangement.functions["main"].operations)
    except (AttributeError, KeyError):
        return "<pattern>"
    real = [op.name for op in ops if op.op_type != "const"]
    return real[-1] if real else "<empty pattern>"


def compile_pattern(
    ops_arrangement: Program,
    *,
    name: str | None = None,
    commutative: bool | Iterable[str] = True,
    alternatives: Mapping[str, Sequence[str]] | None = None,
    constants: ConstMode | ConstRule = "any",
    const_rules: Mapping[str, ConstMode | ConstRule] | None = None,
    fanout: Iterable[str] = (),
    equivalences: Equivalences = False,
) -> CompiledPattern:
    """Reads a pattern program into a :class:`CompiledPattern`, enforcing the pattern rules.

    Args:
        ops_arrangement: The pattern, an ``mb.program`` whose ops all carry unique names.
        name: Name used in messages; defaults to the name of the pattern's last op.
        commutative: ``True`` lets every op match either operand order when the program op it
            matches is in :data:`COMMUTATIVE_OPS`; ``False`` matches operand order exactly; an iterable
            names the pattern ops whose ``x`` and ``y`` are tried in both orders *whatever op type
            matched* (for alternatives such as ``add``/``sub``, whose transform then reads which side
            is which with ``pattern.operand``); the other ops then match in order.
        alternatives: Pattern op name to the op types accepted there, e.g. ``{"add_or_sub": ["add",
            "sub"]}``. The op's own type must be among them.
        constants: Default rule for every pattern constant (``"any"``, ``"const"``, ``"value"`` or a
            :class:`ConstRule`).
        const_rules: Per-constant rules, keyed by ``"<op name>.<slot>"`` (e.g. ``"pow.y"``) or by the name
            of the pattern's const op.
        fanout: Pattern ops that stand for every consumer of their input (one or more ops of the same
            kind, captured as a list). Such an op must be a last op of the pattern, with exactly one
            input coming from a pattern input or another pattern op.
        equivalences: Identities the matcher also matches (``pow(x, 2)`` = ``mul(x, x)``, ...): False,
            True, a list of identity names or ``{"<op>": [names]}``; see
            :mod:`pattern_infra.language.equivalences`.

    Returns:
        The compiled pattern.

    Raises:
        PatternDefinitionError: The pattern breaks a rule; the message names the rule and the fix.
    """
    pattern_name = name or pattern_name_of(ops_arrangement)
    func = _function_of(ops_arrangement, pattern_name)
    if equivalences:
        ops_arrangement = with_equivalences(ops_arrangement, pattern_name, equivalences)
        func = ops_arrangement.functions["main"]
    return _compile_graph(
        func,
        ops_arrangement,
        pattern_name,
        records_of(func),
        commutative=commutative,
        alternatives=alternatives,
        constants=constants,
        const_rules=const_rules,
        fanout=fanout,
        rule_keys=None,
    )


def _compile_graph(
    func: Any,
    ops_arrangement: Program,
    pattern_name: str,
    choice_records: list[Any],
    *,
    commutative: bool | Iterable[str],
    alternatives: Mapping[str, Sequence[str]] | None,
    constants: ConstMode | ConstRule,
    const_rules: Mapping[str, ConstMode | ConstRule] | None,
    fanout: Iterable[str],
    rule_keys: set[str] | None,
    renames: dict[int, Var] | None = None,
) -> CompiledPattern:
    """:func:`compile_pattern` of a pattern function, or of one alternative of a choice (a region of it).

    ``rule_keys`` is None for the whole pattern; for an alternative, the set collecting the const rule keys
    used (checked once, for the whole pattern, by the top-level call). ``renames`` is given for a spelling
    of the pattern (:mod:`~pattern_infra.language.variants`): the ops of one alternative per choice, a
    choice's variable read as the variable its alternative computes; a pattern input may then be unused.
    """
    options = dict(commutative=commutative, alternatives=alternatives, constants=constants,
                   const_rules=const_rules, fanout=fanout)
    all_ops: list[Operation] = list(func.operations)
    for op in all_ops:
        if op.blocks:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op {op.name!r} ({op.op_type}) has nested blocks; "
                f"control flow cannot be part of a pattern. Match the ops around it instead."
            )
    real_ops = [op for op in all_ops if op.op_type != "const"]
    if not real_ops:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} has no op other than constants. A pattern needs at least one "
            f"op to find, e.g. `return mb.relu(x=x, name='relu')`."
        )
    default_rule = constants if isinstance(constants, ConstRule) else ConstRule(constants)
    rules = {k: (v if isinstance(v, ConstRule) else ConstRule(v)) for k, v in (const_rules or {}).items()}
    alternatives = dict(alternatives or {})
    everywhere = {op.name for op in real_ops}  # alternatives' ops included
    used_rule_keys: set[str] = set() if rule_keys is None else rule_keys
    if choice_records:
        real_ops = _collapse_choices(
            real_ops, choice_records, pattern_name, ops_arrangement, used_rule_keys,
            commutative=commutative, alternatives=alternatives, constants=constants,
            const_rules=const_rules, fanout=fanout,
        )

    by_name: dict[str, int] = {}
    for i, op in enumerate(real_ops):
        if op.name in by_name:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: two ops are named {op.name!r}. Give every op a unique "
                f"`name=` argument."
            )
        if op.name in RESERVED_NAMES or op.name.startswith("_"):
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op name {op.name!r} is reserved by Pattern (or private). "
                f"Rename the op, e.g. name='{op.name.strip('_')}_op'."
            )
        if not op.name.isidentifier():
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op name {op.name!r} is not a Python identifier, so "
                f"`pattern.{op.name}` cannot read it. Use letters, digits and underscores."
            )
        by_name[op.name] = i
    for key in alternatives:
        if key not in everywhere:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: alternatives name op {key!r}, which the pattern does not "
                f"have. Pattern ops: {sorted(by_name)}."
            )
    if isinstance(commutative, bool):
        # Whether the slots may swap is decided per matched program op (by its type): a pattern op is
        # swappable when any type it accepts is commutative, not only the type written in the pattern.
        swappable = (
            {op.name for op in real_ops if COMMUTATIVE_OPS.intersection(alternatives.get(op.name) or (op.op_type,))}
            if commutative
            else set()
        )
    else:
        swappable = set(commutative)
        unknown = swappable - everywhere
        if unknown:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: commutative names unknown ops {sorted(unknown)}."
            )

    root_vars: list[Var] = list(func.inputs.values())
    root_index = {id(v): i for i, v in enumerate(root_vars)}
    op_of_output = {id(o): (by_name[op.name], j) for op in real_ops for j, o in enumerate(op.outputs)}
    const_op_ids = {id(op) for op in all_ops if op.op_type == "const"}

    consts: list[tuple[str, np.ndarray | None, ConstRule]] = []
    const_names: list[str] = []

    def edge_for(var: Var, op: Operation, slot: str) -> Edge:
        var = _renamed(var, renames)
        if id(var) in root_index:
            return Edge("root", root_index[id(var)])
        if id(var) in op_of_output:
            node, out = op_of_output[id(var)]
            return Edge("op", node, out)
        if var.op is not None and id(var.op) in const_op_ids:
            key = f"{op.name}.{slot}"
            rule = rules.get(key) or rules.get(var.op.name) or default_rule
            if key in rules:
                used_rule_keys.add(key)
            if var.op.name in rules:
                used_rule_keys.add(var.op.name)
            value = None if var.val is None else np.asarray(var.val)
            consts.append((key, value, rule))
            const_names.append(var.op.name)
            return Edge("const", len(consts) - 1)
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: input {slot!r} of op {op.name!r} comes from {var.name!r}, "
            f"which is neither a pattern input, a pattern op nor a constant."
        )

    nodes: list[PatternNode] = []
    for i, op in enumerate(real_ops):
        inputs: dict[str, Edge | tuple[Edge, ...]] = {}
        for slot, value in op.inputs.items():
            if isinstance(value, (tuple, list)):
                inputs[slot] = tuple(edge_for(v, op, slot) for v in value)
            else:
                inputs[slot] = edge_for(value, op, slot)
        types = alternatives.get(op.name)
        op_types = frozenset(types) if types else frozenset({op.op_type})
        if op.op_type not in op_types:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: alternatives for op {op.name!r} are {sorted(op_types)} "
                f"but the op itself is {op.op_type!r}; include it."
            )
        can_swap = op.name in swappable and "x" in inputs and "y" in inputs
        explicit = can_swap and not isinstance(commutative, bool)
        choice = getattr(op, "choice", None)
        nodes.append(
            PatternNode(
                index=i,
                name=op.name,
                op_type=op.op_type,
                op_types=choice.output_types if choice is not None else op_types,
                num_outputs=len(op.outputs),
                inputs=inputs,
                commutative=can_swap and choice is None,
                swap_any_type=explicit and choice is None,
                output_uses=[0] * len(op.outputs),
                choice=choice,
            )
        )
    unused_rules = set(rules) - used_rule_keys
    if unused_rules and rule_keys is None:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: const_rules name {sorted(unused_rules)}, which are not "
            f"constants of the pattern. Keys are '<op name>.<slot>' or a const op's name; constants: "
            f"{sorted({k for k, _, _ in consts} | set(const_names))}."
        )

    root_consumers: list[list[tuple[int, str, int]]] = [[] for _ in root_vars]
    for node in nodes:
        for slot, edge in node.inputs.items():
            for pos, e in edge_positions(edge):
                if e.kind == "root":
                    root_consumers[e.index].append((node.index, slot, pos))
                elif e.kind == "op":
                    # a choice node stands for as many reads as each of its alternatives makes
                    reads = node.choice.reads.get(slot, 1) if node.choice is not None else 1
                    nodes[e.index].output_uses[e.output] += reads
                    nodes[e.index].consumers.append((node.index, slot, pos, e.output))

    for r, users in enumerate(root_consumers):
        if not users and renames is None:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: input {list(func.inputs)[r]!r} is used by no op. Remove it "
                f"from input_specs, or use it."
            )

    final_nodes = _final_nodes(pattern_name, [_renamed(v, renames) for v in func.outputs], nodes, op_of_output)
    for idx in final_nodes:
        nodes[idx].is_final = True
    _mark_fanout(pattern_name, nodes, set(fanout), by_name)
    _check_connected(pattern_name, nodes, root_consumers)
    compiled = CompiledPattern(
        name=pattern_name,
        program=ops_arrangement,
        nodes=nodes,
        root_names=list(func.inputs),
        root_consumers=root_consumers,
        consts=consts,
        const_names=const_names,
        final_nodes=final_nodes,
        by_name=by_name,
        source=(func, choice_records, options),
    )
    logger.debug("compiled %s", compiled.describe())
    return compiled


def _collapse_choices(
    real_ops: list[Any],
    records: list[Any],
    pattern_name: str,
    program: Program,
    used_rule_keys: set[str],
    *,
    commutative: bool | Iterable[str],
    alternatives: Mapping[str, Sequence[str]],
    constants: ConstMode | ConstRule,
    const_rules: Mapping[str, ConstMode | ConstRule] | None,
    fanout: Iterable[str],
) -> list[Any]:
    """The ops of one level with each choice replaced by its choice node; alternatives compiled with the
    options that name their ops."""
    fan = set(fanout)

    def compile_region(region: Region, name: str, inner: list[Any]) -> CompiledPattern:
        names = {op.name for op in region.operations if op.op_type != "const"}
        if names & fan:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op(s) {sorted(names & fan)} lie inside an alternative "
                f"of a one_of choice; a fan-out op must be a last op outside every choice."
            )
        return _compile_graph(
            region,
            program,
            name,
            inner,
            commutative=commutative if isinstance(commutative, bool) else [c for c in commutative if c in names],
            alternatives={k: v for k, v in alternatives.items() if k in names},
            constants=constants,
            const_rules=const_rules,
            fanout=(),
            rule_keys=used_rule_keys,
        )

    result = list(real_ops)
    for record in records:
        found = split(result, record, pattern_name)
        if found is not None:
            compiled = [compile_region(region, f"{pattern_name}.{record.name}[{k}]", record.children.get(k, []))
                        for k, region in enumerate(found.regions)]
            result = choice_node(found, compiled, pattern_name)
    return result


def _renamed(var: Var, renames: dict[int, Var] | None) -> Var:
    while renames and id(var) in renames:
        var = renames[id(var)]
    return var


def _final_nodes(
    pattern_name: str,
    outputs: list[Var],
    nodes: list[PatternNode],
    op_of_output: dict[int, tuple[int, int]],
) -> list[int]:
    finals: list[int] = []
    for out in outputs:
        if id(out) not in op_of_output:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r} returns {out.name!r}, which no pattern op computes. Return "
                f"the output of the pattern's last op."
            )
        node, _ = op_of_output[id(out)]
        if node not in finals:
            finals.append(node)
    sinks = [n for n in nodes if not n.consumers]
    stray = [n.name for n in sinks if n.index not in finals]
    if stray:
        last = [nodes[i].name for i in finals]
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} has more than one last op: {stray + last} have no consumer in "
            f"the pattern but only {last} is returned. A pattern has one last op; to match several "
            f"outputs, return every one of them from the pattern program."
        )
    return finals


def _mark_fanout(
    pattern_name: str, nodes: list[PatternNode], fanout: set[str], by_name: dict[str, int]
) -> None:
    for name in sorted(fanout):
        if name not in by_name:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fanout names op {name!r}, which the pattern does not have. "
                f"Pattern ops: {sorted(by_name)}."
            )
        node = nodes[by_name[name]]
        if not node.is_final:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op {name!r} is consumed inside the pattern; a fan-out "
                f"op stands for a set of ops and must be a last op (return it from the pattern)."
            )
        sources = [e for _, edge in node.inputs.items() for _, e in edge_positions(edge) if e.kind != "const"]
        if len(sources) != 1:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op {name!r} must read exactly one pattern input or "
                f"pattern op output (the variable whose consumers it captures); it reads {len(sources)}."
            )
        node.fanout = True
    if nodes and all(n.fanout for n in nodes):
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: every op is a fan-out op; the pattern needs one ordinary op."
        )


def _check_connected(
    pattern_name: str, nodes: list[PatternNode], root_consumers: list[list[tuple[int, str, int]]]
) -> None:
    adjacency: list[set[int]] = [set() for _ in nodes]
    for node in nodes:
        for _, edge in node.inputs.items():
            for _, e in edge_positions(edge):
                if e.kind == "op":
                    adjacency[node.index].add(e.index)
                    adjacency[e.index].add(node.index)
    for users in root_consumers:
        ids = [u[0] for u in users]
        for a in ids:
            adjacency[a].update(ids)
    seen = {0}
    stack = [0]
    while stack:
        for nxt in adjacency[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    if len(seen) != len(nodes):
        apart = [n.name for n in nodes if n.index not in seen]
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} falls apart: ops {apart} share no variable with op "
            f"{nodes[0].name!r}. Register unrelated sequences as separate patterns."
        )


def compile_spelling(compiled: CompiledPattern, dropped: set[int], renames: dict[int, Var]) -> CompiledPattern:
    """One spelling of ``compiled`` as a plain pattern (:mod:`~pattern_infra.language.variants`): its ops
    but those in ``dropped`` (the alternatives not taken), each choice's variable read as ``renames`` says
    (the variable of the alternative taken), with the options ``compiled`` was compiled with."""
    func, _, options = compiled.source
    region = Region([op for op in func.operations if id(op) not in dropped], dict(func.inputs), list(func.outputs))
    return _compile_graph(region, compiled.program, compiled.name, [], rule_keys=set(), renames=renames, **options)
