"""Turn a pattern written as an ``mb.program`` into a graph the matcher can search.

A pattern program is read once, at registration, into a :class:`CompiledPattern`:

1. Every non-``const`` op becomes a :class:`PatternNode` (name, accepted op types, number of outputs,
   one :class:`Edge` per input slot).
2. Every function input becomes a *root* (``Edge.kind == "root"``): any program variable may stand there,
   with any number of consumers outside the match.
3. Every ``const`` op becomes a *constant placeholder* (``Edge.kind == "const"``), one per use, with a
   :class:`ConstRule` for the program's variable in that slot: anything not computed inside the match
   (``"any"``, the default), a compile-time constant (``"const"``), or a constant of the same value
   within a tolerance (``"value"``).
4. The *final ops* produce the program's outputs, which may be used anywhere; every other op's outputs
   must be consumed only inside the match.

Rules, each enforced with an error naming the pattern, the op and the fix: unique op names, exactly one
last op unless the program returns several outputs, at least one op, no op named like a reserved
:class:`~pattern_infra.language.pattern.Pattern` attribute, no unused input, one connected pattern.
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
from .graph import COMMUTATIVE_OPS, CompiledPattern, ConstMode, ConstRule, Edge, PatternNode, edge_positions
from .pattern import RESERVED_NAMES

__all__ = ["COMMUTATIVE_OPS", "RESERVED_NAMES", "ConstRule", "Edge", "PatternNode", "CompiledPattern",
           "compile_pattern", "edge_positions", "renamed"]

logger = logging.getLogger(__name__)


def _function_of(ops_arrangement: Any, pattern_name: str):
    if not isinstance(ops_arrangement, Program):
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} must be a MIL program built with @mb.program, got "
            f"{type(ops_arrangement).__name__}. Decorate the pattern function with @mb.program(input_specs=[...]).")
    functions = ops_arrangement.functions
    if "main" not in functions or len(functions) != 1:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} must have exactly one function named 'main'; it has {sorted(functions)}.")
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
        commutative: ``True``: an op matches either operand order when the program op it matches is in
            :data:`COMMUTATIVE_OPS`; ``False``: operand order exactly; an iterable: the pattern ops whose
            ``x`` and ``y`` are tried in both orders *whatever op type matched* (e.g. an ``add``/``sub``
            alternative whose transform reads the sides with ``pattern.operand``), the others in order.
        alternatives: Pattern op name to the op types accepted there, e.g. ``{"add_or_sub": ["add",
            "sub"]}``; the op's own type must be among them.
        constants: Default rule for every pattern constant (``"any"``, ``"const"``, ``"value"`` or a
            :class:`ConstRule`).
        const_rules: Per-constant rules, keyed by ``"<op name>.<slot>"`` (e.g. ``"pow.y"``) or by the
            pattern's const op name.
        fanout: Pattern ops standing for every consumer of their input (one or more ops of one kind,
            captured as a list); each must be a last op reading exactly one pattern input or op output.
        equivalences: Identities also matched (``pow(x, 2)`` = ``mul(x, x)``, ...): False, True, a list
            of identity names or ``{"<op>": [names]}``; see :mod:`pattern_infra.language.equivalences`.

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
    options = dict(commutative=commutative, alternatives=alternatives, constants=constants,
                   const_rules=const_rules, fanout=fanout)
    return _compile_graph(func, ops_arrangement, pattern_name, records_of(func), options)


def _compile_graph(
    func: Any,
    program: Program,
    pattern_name: str,
    records: list[Any],
    options: dict[str, Any],
    rule_keys: set[str] | None = None,
    renames: dict[int, Var] | None = None,
) -> CompiledPattern:
    """:func:`compile_pattern` of a pattern function (``options``: its keyword arguments), of an
    alternative's region (``rule_keys`` collects the const rule keys used, checked once at the top), or of
    one spelling (``renames``: a choice's variable read as its alternative's; an input may go unused)."""
    commutative, fanout = options["commutative"], options["fanout"]
    all_ops: list[Operation] = list(func.operations)
    for op in all_ops:
        if op.blocks:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op {op.name!r} ({op.op_type}) has nested blocks; "
                f"control flow cannot be part of a pattern. Match the ops around it instead.")
    real_ops = [op for op in all_ops if op.op_type != "const"]
    if not real_ops:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} has no op other than constants. A pattern needs at least one "
            f"op to find, e.g. `return mb.relu(x=x, name='relu')`.")
    constants = options["constants"]
    default_rule = constants if isinstance(constants, ConstRule) else ConstRule(constants)
    rules = {k: (v if isinstance(v, ConstRule) else ConstRule(v)) for k, v in (options["const_rules"] or {}).items()}
    alternatives = dict(options["alternatives"] or {})
    everywhere = {op.name for op in real_ops}  # alternatives' ops included
    used_rule_keys: set[str] = set() if rule_keys is None else rule_keys
    if records:
        real_ops = _collapse_choices(real_ops, records, pattern_name, program, used_rule_keys, options)

    by_name: dict[str, int] = {}
    for i, op in enumerate(real_ops):
        if op.name in by_name:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: two ops are named {op.name!r}. Give every op a unique "
                f"`name=` argument.")
        if op.name in RESERVED_NAMES or op.name.startswith("_"):
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op name {op.name!r} is reserved by Pattern (or private). "
                f"Rename the op, e.g. name='{op.name.strip('_')}_op'.")
        if not op.name.isidentifier():
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op name {op.name!r} is not a Python identifier, so "
                f"`pattern.{op.name}` cannot read it. Use letters, digits and underscores.")
        by_name[op.name] = i
    for key in alternatives:
        if key not in everywhere:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: alternatives name op {key!r}, which the pattern does not "
                f"have. Pattern ops: {sorted(by_name)}.")
    if isinstance(commutative, bool):
        # decided per matched program op: an op may swap when any type it accepts is commutative
        swappable = {op.name for op in real_ops
                     if commutative and COMMUTATIVE_OPS.intersection(alternatives.get(op.name) or (op.op_type,))}
    else:
        swappable = set(commutative)
        if swappable - everywhere:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: commutative names unknown ops {sorted(swappable - everywhere)}.")

    root_vars: list[Var] = list(func.inputs.values())
    root_index = {id(v): i for i, v in enumerate(root_vars)}
    op_of_output = {id(o): (by_name[op.name], j) for op in real_ops for j, o in enumerate(op.outputs)}
    const_op_ids = {id(op) for op in all_ops if op.op_type == "const"}
    consts: list[tuple[str, np.ndarray | None, ConstRule]] = []
    const_names: list[str] = []

    def edge_for(var: Var, op: Operation, slot: str) -> Edge:
        var = renamed(var, renames)
        if id(var) in root_index:
            return Edge("root", root_index[id(var)])
        if id(var) in op_of_output:
            return Edge("op", *op_of_output[id(var)])
        if var.op is not None and id(var.op) in const_op_ids:
            key = f"{op.name}.{slot}"
            used_rule_keys.update(k for k in (key, var.op.name) if k in rules)
            value = None if var.val is None else np.asarray(var.val)
            consts.append((key, value, rules.get(key) or rules.get(var.op.name) or default_rule))
            const_names.append(var.op.name)
            return Edge("const", len(consts) - 1)
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: input {slot!r} of op {op.name!r} comes from {var.name!r}, "
            f"which is neither a pattern input, a pattern op nor a constant.")

    nodes: list[PatternNode] = []
    for i, op in enumerate(real_ops):
        inputs: dict[str, Edge | tuple[Edge, ...]] = {
            slot: tuple(edge_for(v, op, slot) for v in value) if isinstance(value, (tuple, list))
            else edge_for(value, op, slot)
            for slot, value in op.inputs.items()
        }
        op_types = frozenset(alternatives.get(op.name) or {op.op_type})
        if op.op_type not in op_types:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: alternatives for op {op.name!r} are {sorted(op_types)} "
                f"but the op itself is {op.op_type!r}; include it.")
        can_swap = op.name in swappable and "x" in inputs and "y" in inputs
        choice = getattr(op, "choice", None)
        nodes.append(PatternNode(
            index=i, name=op.name, op_type=op.op_type, num_outputs=len(op.outputs), inputs=inputs,
            op_types=choice.output_types if choice is not None else op_types,
            commutative=can_swap and choice is None,
            swap_any_type=can_swap and choice is None and not isinstance(commutative, bool),
            output_uses=[0] * len(op.outputs), choice=choice,
        ))
    unused_rules = set(rules) - used_rule_keys
    if unused_rules and rule_keys is None:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: const_rules name {sorted(unused_rules)}, which are not "
            f"constants of the pattern. Keys are '<op name>.<slot>' or a const op's name; constants: "
            f"{sorted({k for k, _, _ in consts} | set(const_names))}.")

    root_consumers: list[list[tuple[int, str, int]]] = [[] for _ in root_vars]
    for node in nodes:
        for slot, edge in node.inputs.items():
            for pos, e in edge_positions(edge):
                if e.kind == "root":
                    root_consumers[e.index].append((node.index, slot, pos))
                elif e.kind == "op":
                    # a choice node stands for as many reads as each of its alternatives makes
                    nodes[e.index].output_uses[e.output] += node.choice.reads.get(slot, 1) if node.choice else 1
                    nodes[e.index].consumers.append((node.index, slot, pos, e.output))
    unused = [name for name, users in zip(func.inputs, root_consumers) if not users]
    if unused and renames is None:
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: input {unused[0]!r} is used by no op. Remove it from input_specs, "
            f"or use it.")

    final_nodes = _final_nodes(pattern_name, [renamed(v, renames) for v in func.outputs], nodes, op_of_output)
    for idx in final_nodes:
        nodes[idx].is_final = True
    _mark_fanout(pattern_name, nodes, set(fanout), by_name)
    _check_connected(pattern_name, nodes, root_consumers)
    compiled = CompiledPattern(
        name=pattern_name, program=program, nodes=nodes, root_names=list(func.inputs),
        root_consumers=root_consumers, consts=consts, const_names=const_names, final_nodes=final_nodes,
        by_name=by_name, source=(func, records, options),
    )
    logger.debug("compiled %s", compiled.describe())
    return compiled


def _collapse_choices(
    real_ops: list[Any], records: list[Any], pattern_name: str, program: Program, used_rule_keys: set[str],
    options: dict[str, Any],
) -> list[Any]:
    """The ops of one level with each choice replaced by its choice node; each alternative compiled with
    the options that name its ops."""
    fan, commutative = set(options["fanout"]), options["commutative"]

    def compile_region(region: Region, name: str, inner: list[Any]) -> CompiledPattern:
        names = {op.name for op in region.operations if op.op_type != "const"}
        if names & fan:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op(s) {sorted(names & fan)} lie inside an alternative "
                f"of a one_of choice; a fan-out op must be a last op outside every choice.")
        region_options = dict(
            options, fanout=(),
            commutative=commutative if isinstance(commutative, bool) else [c for c in commutative if c in names],
            alternatives={k: v for k, v in (options["alternatives"] or {}).items() if k in names},
        )
        return _compile_graph(region, program, name, inner, region_options, used_rule_keys)

    result = list(real_ops)
    for record in records:
        found = split(result, record, pattern_name)
        if found is not None:
            compiled = [compile_region(region, f"{pattern_name}.{record.name}[{k}]", record.children.get(k, []))
                        for k, region in enumerate(found.regions)]
            result = choice_node(found, compiled, pattern_name)
    return result


def renamed(var: Var, renames: dict[int, Var] | None) -> Var:
    """``var``, or the variable a spelling reads in its place (``renames`` followed to the end)."""
    while renames and id(var) in renames:
        var = renames[id(var)]
    return var


def _final_nodes(
    pattern_name: str, outputs: list[Var], nodes: list[PatternNode], op_of_output: dict[int, tuple[int, int]]
) -> list[int]:
    finals: list[int] = []
    for out in outputs:
        if id(out) not in op_of_output:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r} returns {out.name!r}, which no pattern op computes. Return "
                f"the output of the pattern's last op.")
        if op_of_output[id(out)][0] not in finals:
            finals.append(op_of_output[id(out)][0])
    stray = [n.name for n in nodes if not n.consumers and n.index not in finals]
    if stray:
        last = [nodes[i].name for i in finals]
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} has more than one last op: {stray + last} have no consumer in "
            f"the pattern but only {last} is returned. A pattern has one last op; to match several "
            f"outputs, return every one of them from the pattern program.")
    return finals


def _mark_fanout(pattern_name: str, nodes: list[PatternNode], fanout: set[str], by_name: dict[str, int]) -> None:
    for name in sorted(fanout):
        if name not in by_name:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fanout names op {name!r}, which the pattern does not have. "
                f"Pattern ops: {sorted(by_name)}.")
        node = nodes[by_name[name]]
        if not node.is_final:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op {name!r} is consumed inside the pattern; a fan-out "
                f"op stands for a set of ops and must be a last op (return it from the pattern).")
        sources = [e for edge in node.inputs.values() for _, e in edge_positions(edge) if e.kind != "const"]
        if len(sources) != 1:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: fan-out op {name!r} must read exactly one pattern input or "
                f"pattern op output (the variable whose consumers it captures); it reads {len(sources)}.")
        node.fanout = True
    if nodes and all(n.fanout for n in nodes):
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r}: every op is a fan-out op; the pattern needs one ordinary op.")


def _check_connected(
    pattern_name: str, nodes: list[PatternNode], root_consumers: list[list[tuple[int, str, int]]]
) -> None:
    adjacency: list[set[int]] = [set() for _ in nodes]
    for node in nodes:
        for edge in node.inputs.values():
            for _, e in edge_positions(edge):
                if e.kind == "op":
                    adjacency[node.index].add(e.index)
                    adjacency[e.index].add(node.index)
    for users in root_consumers:
        for a, *_ in users:
            adjacency[a].update(u[0] for u in users)
    seen, stack = {0}, [0]
    while stack:
        fresh = adjacency[stack.pop()] - seen
        seen |= fresh
        stack.extend(sorted(fresh))
    if len(seen) != len(nodes):
        raise PatternDefinitionError(
            f"Pattern {pattern_name!r} falls apart: ops {[n.name for n in nodes if n.index not in seen]} share "
            f"no variable with op {nodes[0].name!r}. Register unrelated sequences as separate patterns.")


def compile_spelling(compiled: CompiledPattern, dropped: set[int], renames: dict[int, Var]) -> CompiledPattern:
    """One spelling of ``compiled`` as a plain pattern (:mod:`~pattern_infra.language.variants`): its ops
    but those in ``dropped`` (the alternatives not taken), each choice's variable read as ``renames`` says,
    with the options ``compiled`` was compiled with."""
    func, _, options = compiled.source
    region = Region([op for op in func.operations if id(op) not in dropped], dict(func.inputs), list(func.outputs))
    return _compile_graph(region, compiled.program, compiled.name, [], options, set(), renames)
