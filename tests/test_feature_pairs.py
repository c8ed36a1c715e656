"""Every pair of language features, against the brute force, on random programs.

The features: ``one_of``, ``optional``, ``equivalences=``, commutativity, fan-out, constant rules, several
inputs or outputs. Each pattern below combines several; together they cross every pair (the table in
:data:`FEATURES` says which pattern holds which). A pattern with choices stands for its spellings, each a
plain pattern (``pattern_infra.language.variants``): the brute force of ``tests/test_brute_force.py`` is
run on every spelling, and a spelling's match is left out when the longest-spelling rule refuses it (an
earlier alternative of a choice ending the pattern matches, alone, with the later one's last op inside).
``find_matches`` must yield exactly those sets of ops, and the pass must leave none.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
from coremltools.converters.mil import Builder as mb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_brute_force import EXAMPLES, S, _emit, _fresh_namespace, _operand_orders, edges_hold, op_specs

from pattern_infra import compile_pattern, find_matches, one_of, optional, register_generic_pass
from pattern_infra.language.graph import edge_positions
from pattern_infra.rewriting.blocks import walk_blocks

SPEC = [mb.TensorSpec(shape=S)]


@mb.program(input_specs=SPEC)
def choice_and_optional(x0):
    """one_of x optional, commutativity (mul), constant rule (value: the sub's 2.0)."""
    a = one_of("act", lambda: mb.relu(x=x0, name="r"), lambda: mb.exp(x=x0, name="e"))
    return optional("scaled", lambda: mb.sub(x=a, y=2.0, name="s"), lambda n: mb.mul(x=n, y=x0, name="m"))


@mb.program(input_specs=SPEC)
def choice_with_equivalence(x0):
    """one_of x equivalences (``add(x, -2)`` is also ``sub(x, 2)``), constant rule."""
    a = one_of("act", lambda: mb.sigmoid(x=x0, name="g"), lambda: mb.relu(x=x0, name="r"))
    return mb.add(x=a, y=-2.0, name="shift")


@mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
def choice_two_inputs(x0, x1):
    """one_of x several inputs x commutativity: an alternative reads the second input."""
    a = one_of(
        "mix", lambda: mb.add(x=mb.exp(x=x0, name="e"), y=x1, name="j"), lambda: mb.mul(x=x0, y=x1, name="j")
    )
    return mb.relu(x=a, name="out")


@mb.program(input_specs=SPEC)
def choice_two_outputs(x0):
    """one_of x several outputs."""
    a = one_of("act", lambda: mb.relu(x=x0, name="r"), lambda: mb.sigmoid(x=x0, name="g"))
    return a, mb.exp(x=x0, name="e")


@mb.program(input_specs=SPEC)
def choice_then_fanout(x0):
    """one_of x fan-out: every consumer of the choice's variable, all exp."""
    a = one_of("act", lambda: mb.relu(x=x0, name="r"), lambda: mb.sigmoid(x=x0, name="g"))
    return mb.exp(x=a, name="f")


@mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
def optional_two_inputs(x0, x1):
    """optional x several inputs x commutativity x equivalences (on the add)."""
    return optional(
        "w", lambda: mb.add(x=mb.relu(x=x0, name="r"), y=x1, name="a"), lambda n: mb.mul(x=n, y=x1, name="m")
    )


@mb.program(input_specs=SPEC)
def optional_fanout(x0):
    """optional x fan-out x constant rule."""
    n = optional(
        "o", lambda: mb.sub(x=mb.exp(x=x0, name="e"), y=2.0, name="s"), lambda n: mb.relu(x=n, name="r")
    )
    return mb.sigmoid(x=n, name="f")


@mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
def equivalence_fanout_outputs(x0, x1):
    """equivalences x fan-out x several inputs x commutativity x constant rule."""
    s = mb.sub(x=mb.add(x=x0, y=x1, name="a"), y=2.0, name="s")
    return mb.relu(x=s, name="f")


PATTERNS: dict[str, tuple[Any, dict[str, Any]]] = {
    "choice_and_optional": (choice_and_optional, {"constants": "value"}),
    "choice_with_equivalence": (
        choice_with_equivalence,
        {"constants": "value", "equivalences": ["add_const"]},
    ),
    "choice_two_inputs": (choice_two_inputs, {}),
    "choice_two_outputs": (choice_two_outputs, {}),
    "choice_then_fanout": (choice_then_fanout, {"fanout": ["f"]}),
    "optional_two_inputs": (optional_two_inputs, {"equivalences": ["add_const"]}),
    "optional_fanout": (optional_fanout, {"fanout": ["f"], "constants": "value"}),
    "equivalence_fanout_outputs": (
        equivalence_fanout_outputs,
        {"equivalences": ["sub_const"], "fanout": ["f"], "constants": "value"},
    ),
}

FEATURES = {
    "choice_and_optional": {"one_of", "optional", "commutative", "constants"},
    "choice_with_equivalence": {"one_of", "equivalences", "constants", "commutative"},
    "choice_two_inputs": {"one_of", "roots_outputs", "commutative"},
    "choice_two_outputs": {"one_of", "roots_outputs"},
    "choice_then_fanout": {"one_of", "fanout"},
    "optional_two_inputs": {"optional", "roots_outputs", "commutative", "equivalences"},
    "optional_fanout": {"optional", "fanout", "constants"},
    "equivalence_fanout_outputs": {"equivalences", "fanout", "roots_outputs", "commutative", "constants"},
}
ALL = {"one_of", "optional", "equivalences", "commutative", "fanout", "constants", "roots_outputs"}


def test_the_patterns_cross_every_pair_of_features():
    covered = {
        frozenset(pair) for features in FEATURES.values() for pair in itertools.combinations(features, 2)
    }
    missing = [pair for pair in itertools.combinations(sorted(ALL), 2) if frozenset(pair) not in covered]
    assert missing == []


def _names(ops: Any) -> frozenset[str]:
    return frozenset(o.name for o in ops)


def expected(name: str, prog: Any) -> set[frozenset[str]]:
    """The brute force of every spelling, less what the longest-spelling guards refuse."""
    pattern, options = PATTERNS[name]
    found: set[frozenset[str]] = set()
    for variant in compile_pattern(pattern, **options).variants:
        for ops, bound in brute_force_bound(variant.compiled, prog):
            if not any(_refused(guard, bound[guard.end], prog) for guard in variant.guards):
                found.add(ops)
    return found


def _refused(guard: Any, end: Any, prog: Any) -> bool:
    """Whether an earlier alternative of the guard's choice matches alone with ``end`` inside, not last."""
    for earlier in guard.earlier:
        for spelling in earlier.variants:
            last = spelling.compiled.final_names[0]
            if any(
                end.name in ops and bound[last] is not end
                for ops, bound in brute_force_bound(spelling.compiled, prog)
            ):
                return True
    return False


def brute_force_bound(compiled: Any, prog: Any) -> list[tuple[frozenset[str], dict[str, Any]]]:
    """The brute force of ``tests/test_brute_force.py`` (every injective map, every operand order of a
    commutative op), keeping each match's map; a fan-out op stands for every consumer of its input, all
    of its type, each outside the rest of the match."""
    out = []
    nodes = [n for n in compiled.nodes if not n.fanout]
    fan = [n for n in compiled.nodes if n.fanout]
    for block, _ in walk_blocks(prog):
        for chosen in itertools.permutations(list(block.operations), len(nodes)):
            if any(
                op.op_type not in n.op_types or len(op.outputs) != n.num_outputs
                for op, n in zip(chosen, nodes)
            ):
                continue
            bound = {n.name: op for n, op in zip(nodes, chosen)}
            members = _fan_members(compiled, fan, bound, set(chosen), block)
            if members is None:
                continue
            if _holds(compiled, bound, members, block):
                ops = _names(chosen) | frozenset(o.name for group in members.values() for o in group)
                out.append((ops, bound))
    return out


def _fan_members(compiled: Any, fan: list[Any], bound: dict[str, Any], chosen: set[Any], block: Any) -> Any:
    members = {}
    for node in fan:
        (edge,) = [e for _, e in edge_positions(next(iter(node.inputs.values())))]
        if edge.kind != "op":
            return None  # the patterns here read a pattern op's output
        users = list(dict.fromkeys(bound[compiled.nodes[edge.index].name].outputs[edge.output].child_ops))
        if not users or any(
            u.op_type not in node.op_types or u in chosen or u.enclosing_block is not block for u in users
        ):
            return None
        members[node.name] = users
    return members


def _holds(compiled: Any, bound: dict[str, Any], members: dict[str, list[Any]], block: Any) -> bool:
    matched = set(bound.values()) | {o for group in members.values() for o in group}
    nodes = [n for n in compiled.nodes if not n.fanout]
    orders = [_operand_orders(compiled, n.index, bound[n.name]) for n in nodes]
    for assignment in itertools.product(*orders):
        ok = edges_hold(compiled, nodes, assignment, lambda index: bound[compiled.nodes[index].name], matched)
        if ok and _inside(compiled, bound, members, matched):
            return True
    return False


def _inside(compiled: Any, bound: dict[str, Any], members: dict[str, list[Any]], matched: set[Any]) -> bool:
    for node in compiled.nodes:
        if node.is_final or node.fanout:
            continue
        op = bound[node.name]
        uses = list(node.output_uses)
        for consumer, _, _, out in node.consumers:
            if compiled.nodes[consumer].fanout:
                uses[out] += len(members[compiled.nodes[consumer].name]) - 1
        for j, var in enumerate(op.outputs):
            if (
                var.consuming_blocks
                or len(var.child_ops) != uses[j]
                or any(u not in matched for u in var.child_ops)
            ):
                return False
    return True


def build(name: str, spelling: int, noise: list[Any], extra: int, fans: int) -> Any:
    """A random program holding one instance of a spelling of the pattern (inputs picked among the
    program's variables, constants as the pattern writes them, a commutative op's operands in either
    order, ``fans`` consumers of a fan-out op), an extra consumer of one of its ops when ``extra`` says
    so, and random ops around it."""
    pattern, options = PATTERNS[name]
    variants = compile_pattern(pattern, **options).variants
    variant = variants[spelling % len(variants)].compiled

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def prog(a0, a1, a2):
        shared = mb.const(val=np.array([0.5, -1.5], dtype=np.float32), name="shared")
        available = [a0, a1, a2]
        _emit(noise[: len(noise) // 2], available, shared, "n")
        made: list[Any] = []
        inputs = [available[-1 - (r * 3 + extra) % len(available)] for r in range(len(variant.root_names))]
        for node in variant.nodes:
            copies = max(fans, 1) if node.fanout else 1
            for c in range(copies):
                args = {}
                for slot, edge in node.inputs.items():
                    if edge.kind == "root":
                        args[slot] = inputs[edge.index]
                    elif edge.kind == "op":
                        args[slot] = (
                            made[edge.index].outputs[edge.output]
                            if not isinstance(made[edge.index], list)
                            else made[edge.index][0].outputs[edge.output]
                        )
                    else:
                        value = variant.consts[edge.index][1]
                        args[slot] = np.float32(value) if value is not None and value.size == 1 else shared
                if node.op_type in ("add", "mul") and (extra + node.index) % 2:  # the other operand order
                    args["x"], args["y"] = args["y"], args["x"]
                op = getattr(mb, node.op_type)(**args, name=f"p_{node.name}{c}").op
                made.append(op) if c == 0 else None
            available.extend(m.outputs[0] for m in made[-1:])
        if extra % 3 == 1 and len(made) > 1:
            available.append(mb.relu(x=made[0].outputs[0], name="extra_use"))
        _emit(noise[len(noise) // 2 :], available, shared, "m")
        outs = [m.outputs[0] for m in made if not any(u for u in m.outputs[0].child_ops)] + [available[-1]]
        return tuple(dict.fromkeys(outs))

    return prog


@settings(
    max_examples=max(EXAMPLES // 2, 50),
    deadline=None,
    derandomize="FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    name=st.sampled_from(sorted(PATTERNS)),
    spelling=st.integers(0, 7),
    noise=st.lists(op_specs, max_size=6),
    extra=st.integers(0, 5),
    fans=st.integers(1, 2),
)
def test_find_matches_and_the_pass_agree_with_the_brute_force_on_every_pair(
    name, spelling, noise, extra, fans
):
    pattern, options = PATTERNS[name]
    prog = build(name, spelling, noise, extra, fans)
    got = list(find_matches(pattern, prog, **options))
    sets = [_names(m.op_set) for m in got]
    assert len(sets) == len(set(sets)), "find_matches yielded a set of ops twice"
    assert set(sets) == expected(name, prog)

    def to_zeros(p: Any) -> None:  # an op of no pattern, of each output's shape (an input may be a scalar)
        anchor = p.op_list()[0]
        p.replace_outputs(
            [
                mb.fill(shape=list(v.shape), value=0.0, name=f"{v.name}_zeros", before_op=anchor)
                for v in p.output_vars()
            ]
        )

    container = register_generic_pass(pattern, None, to_zeros, "pairs", _fresh_namespace(), **options)
    container(prog)
    prog.validate()
    assert list(find_matches(pattern, prog, **options)) == []
