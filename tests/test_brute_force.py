"""The matcher and the driver against a brute-force matcher on random programs (issue #12).

The brute force reads the rules of the README's "What a match guarantees" directly: it tries *every*
injective map from the pattern's ops to the program's ops of an accepted type, every operand order a
commutative program op allows, and keeps the maps where

* every data edge holds (a pattern edge between two ops is the very same program variable; a pattern
  input binds one variable, consistently; two pattern inputs may bind the same variable, and an input
  may bind a constant);
* outputs of non-final ops are read only by matched ops, exactly as often as in the pattern, and are not
  block outputs;
* no pattern input and no constant slot is computed by a matched op; constants satisfy their rule;
* all ops lie in one block.

Properties, on random programs (shared constants, operand orders, extra consumers, block outputs, a
nested ``cond`` reading outer variables):

1. ``find_matches`` yields exactly the brute force's distinct sets of ops, filtered by the constraint;
2. after the pass, the brute force finds no match the constraint accepts (the pass reached a
   fixpoint), and a second run of the pass changes nothing.

``FUZZ_EXAMPLES`` sets the number of programs (``make test``: 200, ``make fuzz``: a long campaign).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Operation, Program, types
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pattern_infra import compile_pattern, find_matches, register_generic_pass
from pattern_infra.language.compiler import COMMUTATIVE_OPS, CompiledPattern, edge_positions
from pattern_infra.rewriting.blocks import walk_blocks

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
S = (2,)
UNARY = ("relu", "exp", "sigmoid")
BINARY = ("add", "mul", "sub")


# -- patterns -----------------------------------------------------------------------------------------------


def _spec(**kw: Any) -> list[mb.TensorSpec]:
    return [mb.TensorSpec(shape=S) for _ in range(kw.get("n", 1))]


@mb.program(input_specs=_spec())
def chain(x0):
    r = mb.relu(x=x0, name="r")
    return mb.exp(x=r, name="e")


@mb.program(input_specs=_spec())
def root_twice(x0):
    r = mb.relu(x=x0, name="r")
    return mb.mul(x=x0, y=r, name="m")


@mb.program(input_specs=_spec(n=2))
def two_inputs(x0, x1):
    r = mb.relu(x=x0, name="r")
    return mb.add(x=r, y=x1, name="a")


@mb.program(input_specs=_spec())
def two_finals(x0):
    r = mb.relu(x=x0, name="r")
    e = mb.exp(x=x0, name="e")
    return r, e


@mb.program(input_specs=_spec())
def by_constant(x0):
    s = mb.sigmoid(x=x0, name="s")
    return mb.sub(x=s, y=2.0, name="o")


@mb.program(input_specs=_spec())
def diamond(x0):
    r = mb.relu(x=x0, name="r")
    e = mb.exp(x=r, name="e")
    s = mb.sigmoid(x=r, name="s")
    return mb.mul(x=e, y=s, name="m")


PATTERNS: dict[str, tuple[Program, dict[str, Any]]] = {
    "chain": (chain, {}),
    "root_twice": (root_twice, {}),
    "two_inputs": (two_inputs, {}),
    "two_finals": (two_finals, {}),
    "by_constant_any": (by_constant, {"alternatives": {"o": ["sub", "add", "mul"]}}),
    "by_constant_value": (by_constant, {"alternatives": {"o": ["sub", "add"]}, "constants": "value"}),
    "diamond": (diamond, {}),
}

CONSTRAINTS: dict[str, Callable[[Any], Any] | None] = {
    "none": None,
    "roots_not_computed_by_relu": lambda p: all(v.op is None or v.op.op_type != "relu" for v in p.root_vars),
}


# -- random programs --------------------------------------------------------------------------------------

# An op: (type, operand picks); a pick indexes the variables available so far, from the newest back,
# or -1 for the shared constant and -2 for a fresh scalar 2.0.
op_specs = st.tuples(
    st.sampled_from(UNARY + BINARY),
    st.lists(st.integers(min_value=-2, max_value=6), min_size=2, max_size=2),
)
plans = st.fixed_dictionaries(
    {
        "outer": st.lists(op_specs, min_size=2, max_size=9),
        "inner": st.lists(op_specs, min_size=0, max_size=4),
        "outputs": st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=3),
    }
)


def _emit(
    specs: list[tuple[str, list[int]]], available: list[Any], shared: Any, tag: str, reach: int = 0
) -> list[Any]:
    """Appends the ops of ``specs``; an odd pick from an op of an inner block (``reach`` > 0) takes one of
    the first ``reach`` variables (the outer block's) instead of the newest ones."""
    made = []
    for i, (op_type, picks) in enumerate(specs):

        def pick(p: int) -> Any:
            if p == -1:
                return shared
            if p == -2:
                return 2.0
            if reach and p % 2:
                return available[reach - 1 - (p // 2) % reach]
            return available[-1 - (p % len(available))]

        name = f"{tag}{i}_{op_type}"
        if op_type in UNARY:
            x = pick(picks[0])
            x = shared if isinstance(x, float) else x
            var = getattr(mb, op_type)(x=x, name=name)
        else:
            x, y = pick(picks[0]), pick(picks[1])
            if isinstance(x, float) and isinstance(y, float):
                y = available[-1]
            var = getattr(mb, op_type)(x=x, y=y, name=name)
        available.append(var)
        made.append(var)
    return made


def build(plan: dict[str, Any]) -> Program:
    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=S),
            mb.TensorSpec(shape=S),
            mb.TensorSpec(shape=(1,), dtype=types.bool),
        ]
    )
    def prog(a0, a1, flag):
        shared = mb.const(val=np.array([0.5, -1.5], dtype=np.float32), name="shared")
        available = [a0, a1]
        outer = _emit(plan["outer"], available, shared, "o")
        result = [available[-1 - (k % len(available))] for k in plan["outputs"]]
        if plan["inner"]:
            visible = list(available)

            def then_branch():  # the inner ops read outer variables as often as their own
                return _emit(plan["inner"], list(visible), shared, "i", reach=len(visible))[-1]

            def else_branch():
                return mb.relu(x=a1, name="else_relu")

            result.append(
                mb.cond(pred=mb.squeeze(x=flag), _true_fn=then_branch, _false_fn=else_branch, name="c")
            )
        del outer
        return tuple(dict.fromkeys(r for r in result if r.op is None or r.op.op_type != "const"))

    return prog


# -- the brute force ----------------------------------------------------------------------------------------


def _operand_orders(compiled: CompiledPattern, node_index: int, op: Operation) -> list[dict[str, Any]]:
    node = compiled.nodes[node_index]
    values = {slot: op._input_vars.get(slot) for slot in node.inputs}
    if any(v is None for v in values.values()):
        return []
    orders = [values]
    # the README's "What a match guarantees", not the compiled flags: either slot of a commutative
    # *program* op (the patterns here keep the default commutative=True)
    if "x" in values and "y" in values and op.op_type in COMMUTATIVE_OPS and values["x"] is not values["y"]:
        orders.append({**values, "x": values["y"], "y": values["x"]})
    return orders


def brute_force(
    compiled: CompiledPattern, prog: Program, constraint: Callable[[Any], Any] | None
) -> set[frozenset[str]]:
    """Every set of program ops (by name) forming a match the README's "What a match guarantees" allows.

    A constraint sees the match as ``find_matches`` builds it; the brute force asks it through
    ``find_matches`` on the same program restricted to the candidate set, so it needs none of its own.
    """
    found: set[frozenset[str]] = set()
    nodes = compiled.nodes
    for block, _ in walk_blocks(prog):
        ops = list(block.operations)
        for chosen in itertools.permutations(ops, len(nodes)):
            if any(
                op.op_type not in node.op_types or len(op.outputs) != node.num_outputs
                for op, node in zip(chosen, nodes)
            ):
                continue
            if _allowed(compiled, chosen, block):
                found.add(frozenset(op.name for op in chosen))
    return found


def _allowed(compiled: CompiledPattern, chosen: tuple[Operation, ...], block: Block) -> bool:
    nodes = compiled.nodes
    matched = set(chosen)
    for assignment in itertools.product(*(_operand_orders(compiled, i, op) for i, op in enumerate(chosen))):
        ok = edges_hold(compiled, nodes, assignment, lambda index: chosen[index], matched)
        if ok and _outputs_stay_inside(compiled, chosen, matched):
            return True
    return False


def edges_hold(
    compiled: CompiledPattern,
    nodes: list[Any],
    assignment: tuple[dict[str, Any], ...],
    op_of: Callable[[int], Operation],
    matched: set[Operation],
) -> bool:
    """Whether every data edge of ``nodes`` holds with their operands ``assignment`` (a pattern edge
    between two ops is the very same variable, a pattern input binds one variable, and no input or
    constant is computed inside the match, a constant satisfying its rule); ``op_of`` gives the program
    op bound to a pattern op."""
    roots: dict[int, Any] = {}
    for node, operands in zip(nodes, assignment):
        for slot, edge in node.inputs.items():
            for pos, e in edge_positions(edge):
                var = operands[slot] if pos < 0 else operands[slot][pos]
                if e.kind == "op":
                    ok = var is op_of(e.index).outputs[e.output]
                elif e.kind == "root":
                    ok = roots.setdefault(e.index, var) is var and (var.op is None or var.op not in matched)
                else:
                    _, expected, rule = compiled.consts[e.index]
                    ok = (var.op is None or var.op not in matched) and rule.accepts(var, expected) is None
                if not ok:
                    return False
    return True


def _outputs_stay_inside(
    compiled: CompiledPattern, chosen: tuple[Operation, ...], matched: set[Operation]
) -> bool:
    for node, op in zip(compiled.nodes, chosen):
        if node.is_final:
            continue
        for j, var in enumerate(op.outputs):
            if var.consuming_blocks or len(var.child_ops) != node.output_uses[j]:
                return False
            if any(user not in matched for user in var.child_ops):
                return False
    return True


def accepted(
    compiled_name: str, options: dict[str, Any], prog: Program, constraint: Any, sets: set[frozenset[str]]
) -> set[frozenset[str]]:
    """The sets the constraint accepts, asking it of each set through the match ``find_matches`` gives."""
    if constraint is None:
        return sets
    pattern, _ = PATTERNS[compiled_name]
    every = {frozenset(o.name for o in m.op_set): m for m in find_matches(pattern, prog, **options)}
    keep = set()
    for ops in sets:
        match = every.get(ops)
        assert match is not None, f"find_matches misses {sorted(ops)} even without the constraint"
        if constraint(match):
            keep.add(ops)
    return keep


# -- properties ----------------------------------------------------------------------------------------------


def _replace_with_identity(pattern: Any) -> None:
    """Each output becomes ``identity(first input)``: the inputs keep a user."""
    root = pattern.root_vars[0]
    anchor = pattern.op_list()[0]  # the first matched op: it reads the first input, precedes every user
    news = [mb.identity(x=root, name=f"{var.name}_id", before_op=anchor) for var in pattern.output_vars()]
    pattern.replace_outputs(news)


def _replace_with_constant(pattern: Any) -> None:
    """Each output becomes a constant: the match's inputs lose their users there, which may free a match
    elsewhere (in another block, or through a shared constant)."""
    anchor = pattern.op_list()[0]  # before every user of the outputs
    news = [
        mb.const(val=np.zeros(S, dtype=np.float32), name=f"{var.name}_zero", before_op=anchor)
        for var in pattern.output_vars()
    ]
    pattern.replace_outputs(news)


REPLACEMENTS = {"identity": _replace_with_identity, "constant": _replace_with_constant}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    plan=plans,
    pattern_name=st.sampled_from(sorted(PATTERNS)),
    constraint_name=st.sampled_from(sorted(CONSTRAINTS)),
    replacement=st.sampled_from(sorted(REPLACEMENTS)),
)
@example(  # an inner rewrite frees an outer match: relu(a0) loses its inner consumer
    plan={
        "outer": [("relu", [1, 0]), ("exp", [0, 0])],
        "inner": [("relu", [3, 1]), ("exp", [0, 0])],
        "outputs": [0],
    },
    pattern_name="chain",
    constraint_name="none",
    replacement="constant",
)
def test_find_matches_and_the_pass_agree_with_the_brute_force(
    plan, pattern_name, constraint_name, replacement
):
    pattern, options = PATTERNS[pattern_name]
    constraint = CONSTRAINTS[constraint_name]
    compiled = compile_pattern(pattern, **options)
    prog = build(plan)

    want = accepted(pattern_name, options, prog, constraint, brute_force(compiled, prog, constraint))
    got = [frozenset(o.name for o in m.op_set) for m in find_matches(pattern, prog, constraint, **options)]
    assert len(got) == len(set(got)), "find_matches yielded a set of ops twice"
    assert set(got) == want

    container = register_generic_pass(
        pattern, constraint, REPLACEMENTS[replacement], "brute", _fresh_namespace(), **options
    )
    container(prog)
    prog.validate()
    left = accepted(pattern_name, options, prog, constraint, brute_force(compiled, prog, constraint))
    assert left == set(), f"the pass stopped with matches left: {sorted(map(sorted, left))}"
    before = str(prog)
    rewrites = container.stats.rewrites
    container(prog)
    assert str(prog) == before and container.stats.rewrites == rewrites


_namespaces = itertools.count()


def _fresh_namespace() -> str:
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    for key in [k for k in PASS_REGISTRY.passes if k.startswith("brute")]:
        del PASS_REGISTRY.passes[key]
    return f"brute{next(_namespaces)}"


@pytest.mark.parametrize("pattern_name", sorted(PATTERNS))
def test_the_brute_force_sees_what_it_should(pattern_name):
    """The brute force itself is not vacuous: on a program written to hold one instance of each pattern,
    it finds that instance."""
    pattern, options = PATTERNS[pattern_name]
    compiled = compile_pattern(pattern, **options)

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def prog(a0, a1):
        r = mb.relu(x=a0, name="r")
        e = mb.exp(x=r, name="e")  # chain
        m = mb.mul(x=r, y=a0, name="m")  # root_twice, operands swapped
        a = mb.add(x=a1, y=mb.relu(x=a1, name="r1"), name="a")  # two_inputs, swapped
        s = mb.sigmoid(x=a1, name="s")
        o = mb.add(x=2.0, y=s, name="o")  # by_constant through the add alternative, swapped
        r2 = mb.relu(x=a1, name="r2")
        d = mb.mul(x=mb.exp(x=r2, name="e2"), y=mb.sigmoid(x=r2, name="s2"), name="d")  # diamond
        x2 = mb.exp(x=a0, name="e3")  # two_finals with r (relu(a0))
        m3 = mb.mul(x=mb.relu(x=a1, name="r3"), y=a1, name="m3")  # root_twice, operands swapped
        return e, m, a, o, d, x2, m3

    found = brute_force(compiled, prog, None)
    expected = {
        "chain": set(),  # relu(a0) has a second consumer (m); relu(a1) ops feed add or two ops
        "root_twice": {frozenset({"r3", "m3"})},  # relu(a0) has a second consumer (e)
        "two_inputs": {frozenset({"r1", "a"})},
        "by_constant_any": {
            frozenset({"s", "o"}),
            frozenset({"s2", "d"}),
        },  # "any": any y not computed inside
        "by_constant_value": {frozenset({"s", "o"})},
        "diamond": {frozenset({"r2", "e2", "s2", "d"})},
        "two_finals": {frozenset({"r", "e3"})},
    }[pattern_name]
    assert found == expected
    assert {frozenset(o.name for o in m.op_set) for m in find_matches(pattern, prog, **options)} == found


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    plan=plans,
    names=st.lists(st.sampled_from(sorted(PATTERNS)), min_size=2, max_size=3, unique=True),
    replacement=st.sampled_from(sorted(REPLACEMENTS)),
)
@example(  # the second sub-pass's rewrite frees a match of the first: relu(a0) loses its other consumer
    plan={
        "outer": [("relu", [1, 0]), ("exp", [0, 0]), ("sigmoid", [1, 0]), ("sub", [0, -2])],
        "inner": [],
        "outputs": [0, 2],
    },
    names=["chain", "by_constant_value"],
    replacement="constant",
)
def test_a_pass_of_several_patterns_ends_at_a_fixpoint(plan, names, replacement):
    """A rewrite by a later sub-pass may create or free a match of an earlier one: the pass revisits it,
    so no match of any of its patterns is left."""
    namespace = _fresh_namespace()
    for name in names:
        pattern, options = PATTERNS[name]
        container = register_generic_pass(
            pattern, None, REPLACEMENTS[replacement], "several", namespace, **options
        )
    prog = build(plan)
    container(prog)
    prog.validate()
    for name in names:
        pattern, options = PATTERNS[name]
        left = brute_force(compile_pattern(pattern, **options), prog, None)
        assert left == set(), f"{name}: the pass stopped with matches left: {sorted(map(sorted, left))}"
