"""``pattern_infra.suggest`` and ``mil-patterns suggest``: repeated subgraphs found, ranked, emitted.

* A PyTorch model with six copies of ``x - x * tanh(softplus(x))`` between linear layers (and SiLUs, which
  a registered pass fuses), saved as an .mlpackage and read back: the block ranks first with count 6, its
  ``source`` executed finds all six with ``find_matches``; nothing holding the SiLU is suggested.
* Random programs (``test_brute_force``'s generator): every reported subgraph is judged by brute force
  (occurrences disjoint, one output op, pairwise isomorphic under the pattern language's equivalence,
  each found by the emitted pattern); on small programs, an exhaustive enumeration of the subgraphs of
  2-3 ops finds no class more frequent than what ``suggest`` reports.
"""

from __future__ import annotations

import itertools
import os
import runpy

import numpy as np
import pytest
from click.testing import CliRunner
from coremltools.converters.mil import Builder as mb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_brute_force import build, plans
from test_fuzz import build_program
from test_fuzz import plans as fragment_plans

from pattern_infra import COMMUTATIVE_OPS, PatternInfraError, find_matches, suggest
from pattern_infra.cli.commands import main
from pattern_infra.cli.mlpackage import load_mlpackage
from pattern_infra.rewriting.blocks import walk_blocks

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
repeating_plans = st.tuples(plans, st.integers(min_value=1, max_value=3)).map(
    lambda pair: {**pair[0], "outer": pair[0]["outer"] * pair[1], "inner": pair[0]["inner"] * pair[1]}
)
"""``test_brute_force``'s random programs, their ops written once to three times over (repeats to find)."""
BLOCK = ["softplus", "tanh", "mul", "sub"]


def _exec(source: str) -> dict:
    namespace: dict = {}
    exec(source, namespace)  # the emitted text, as a user pasting it runs it
    return namespace


def _matched_sets(source: str, prog) -> set[frozenset[str]]:
    ns = _exec(source)
    return {
        frozenset(op.name for op in m.op_list()) for m in find_matches(ns["pattern"], prog, **ns["OPTIONS"])
    }


@pytest.fixture(scope="module")
def mish_package(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from pattern_infra.testing.convert import convert_torch_model

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fcs = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(13))

        def forward(self, x):
            for i, fc in enumerate(self.fcs[:-1]):
                x = fc(x)
                if i % 2 == 0:
                    x = x - x * torch.tanh(torch.nn.functional.softplus(x))
                else:
                    x = x * torch.sigmoid(x)
            return self.fcs[-1](x)

    torch.manual_seed(0)
    mlmodel = convert_torch_model(Model(), (torch.randn(4, 16),), override=False)
    path = tmp_path_factory.mktemp("suggest") / "mish.mlpackage"
    mlmodel.save(str(path))
    return path


def test_the_repeated_block_ranks_first_and_its_source_finds_all_six(mish_package):
    prog = load_mlpackage(mish_package).program
    candidates = suggest(prog)
    first = candidates[0]
    assert sorted(first.op_types) == sorted(BLOCK) and first.count == 6 and first.saved == 18
    assert len({name for names in first.where for name in names}) == 24  # six disjoint occurrences
    found = _matched_sets(first.source, prog)
    assert all(frozenset(names) in found for names in first.where)


def test_a_block_a_registered_pass_matches_is_not_suggested():
    """``x * sigmoid(x)`` between linear layers (coremltools' conversion would fuse it already): the
    SiLU pass matches it, so no candidate holds it; without the passes' coverage it is the top one."""
    rng = np.random.default_rng(0)

    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 16))])
    def prog(x):
        for _ in range(6):
            x = mb.linear(x=x, weight=rng.normal(size=(16, 16)).astype(np.float32))
            x = mb.mul(x=x, y=mb.sigmoid(x=x))
        return x

    assert all("sigmoid" not in c.op_types for c in suggest(prog, nested=True))
    top = suggest(prog, covered_by=())[0]
    assert sorted(top.op_types) == ["mul", "sigmoid"] and top.count == 6


def test_pieces_of_the_block_are_nested_and_hidden(mish_package):
    prog = load_mlpackage(mish_package).program
    shown = suggest(prog)
    every = suggest(prog, nested=True)
    pieces = [c for c in every if c.inside is not None]
    assert pieces and all(c not in shown for c in pieces)
    assert any(
        c.op_types == ["softplus", "tanh"] and every[c.inside].op_types == shown[0].op_types for c in pieces
    )


def test_the_command_prints_a_table_and_writes_runnable_modules(mish_package, tmp_path, capsys):
    out = tmp_path / "cands"
    result = CliRunner().invoke(main, ["suggest", str(mish_package), "--top", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "x6" in lines[0] and "saves    18" in lines[0] and "softplus" in lines[0]
    files = sorted(out.glob("*.py"))
    assert files and len(files) == sum(line.startswith("wrote ") for line in lines)
    module = runpy.run_path(str(files[0]))
    prog = load_mlpackage(mish_package).program
    assert len(list(find_matches(module["pattern"], prog, **module["OPTIONS"]))) == 6
    with pytest.raises(NotImplementedError):
        module["transform"](type("AnyPattern", (), {"__getattr__": lambda self, name: None})())


def test_bad_arguments_are_refused_with_the_fix():
    prog = mb.program(input_specs=[mb.TensorSpec(shape=(2,))])(lambda x: mb.relu(x=x))
    with pytest.raises(PatternInfraError, match="2 or more"):
        suggest(prog, max_ops=1)


def test_constants_equal_everywhere_become_values_and_differing_ones_const_rules():
    @mb.program(input_specs=[mb.TensorSpec(shape=(4,))])
    def prog(x):
        for i in range(3):
            x = mb.relu(x=mb.add(x=mb.mul(x=x, y=np.float32(2.0)), y=np.float32(i)))
        return x

    cand = suggest(prog, covered_by=())[0]
    assert cand.op_types == ["mul", "add", "relu"] and cand.count == 3
    assert cand.options == {"constants": "value", "const_rules": {"add_0.y": "const"}}
    assert "np.float32(2.0)" in cand.source
    assert len(_matched_sets(cand.source, prog)) == 3
    ns = _exec(cand.source)  # the value rule holds: a different factor is not matched
    other = mb.program(input_specs=[mb.TensorSpec(shape=(4,))])(
        lambda x: mb.relu(x=mb.add(x=mb.mul(x=x, y=np.float32(3.0)), y=np.float32(1.0)))
    )
    assert list(find_matches(ns["pattern"], other, **ns["OPTIONS"])) == []


@pytest.mark.parametrize("swap", [False, True])
def test_operand_orders_of_commutative_ops_are_one_candidate(swap):
    @mb.program(input_specs=[mb.TensorSpec(shape=(4,))])
    def prog(x):
        for i in range(4):
            s = mb.sigmoid(x=mb.exp(x=x))
            x = mb.mul(x=s, y=x) if (i % 2 and swap) else mb.mul(x=x, y=s)
            x = mb.relu(x=x)
        return x

    top = suggest(prog, max_ops=4, covered_by=())[0]
    assert top.count == 4 and sorted(top.op_types) == ["exp", "mul", "relu", "sigmoid"]


# -- the judge on random programs ----------------------------------------------------------------------------


def _ops(prog):
    return [op for _, ops in walk_blocks(prog) for op in ops]


def _flat(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _single_output(ops) -> bool:
    """One block; every op but one read only inside the set and not a block output; connected."""
    block = ops[0].enclosing_block
    if any(op.enclosing_block is not block or op.op_type == "const" for op in ops):
        return False
    inside = {id(op) for op in ops}
    outs = {id(v) for v in block.outputs}
    open_ops = [
        op
        for op in ops
        if any(id(v) in outs for v in op.outputs)
        or any(id(c) not in inside for v in op.outputs for c in v.child_ops)
        or not any(c for v in op.outputs for c in v.child_ops)
    ]
    return (
        len(open_ops) <= 1
        and sum(1 for op in ops if not any(id(c) in inside for v in op.outputs for c in v.child_ops)) == 1
    )


def _isomorphic(a, b) -> bool:
    """Brute force: a bijection of ops keeping types, slots (either order of a commutative op), edges,
    shared inputs and constants by role."""
    if sorted(op.op_type for op in a) != sorted(op.op_type for op in b):
        return False
    for perm in itertools.permutations(b):
        f = {id(x): y for x, y in zip(a, perm)}
        if any(x.op_type != y.op_type or set(x.inputs) != set(y.inputs) for x, y in zip(a, perm)):
            continue
        if _edges_map(a, f, 0, {}):
            return True
    return False


def _edges_map(a, f, i, roots) -> bool:
    if i == len(a):
        return True
    x, y = a[i], f[id(a[i])]
    orders = [{s: s for s in x.inputs}]
    if x.op_type in COMMUTATIVE_OPS and "x" in x.inputs:
        orders.append({**orders[0], "x": "y", "y": "x"})
    for order in orders:
        bound = dict(roots)
        if all(
            _same_edge(u, w, f, bound)
            for s in x.inputs
            for u, w in zip(_flat(x.inputs[s]), _flat(y.inputs[order[s]]))
        ) and all(len(_flat(x.inputs[s])) == len(_flat(y.inputs[order[s]])) for s in x.inputs):
            if _edges_map(a, f, i + 1, bound):
                return True
    return False


def _same_edge(u, w, f, roots) -> bool:
    if u.op is not None and id(u.op) in f:
        return f[id(u.op)] is w.op and u.op.outputs.index(u) == w.op.outputs.index(w)
    if w.op is not None and any(w.op is g for g in f.values()):
        return False
    u_const, w_const = (
        u.op is not None and u.op.op_type == "const",
        w.op is not None and w.op.op_type == "const",
    )
    if u_const or w_const:
        return u_const and w_const
    if id(u) in roots:
        return roots[id(u)] is w
    if any(v is w for v in roots.values()):
        return False
    roots[id(u)] = w
    return True


def _judge(prog, candidates) -> None:
    by_name = {op.name: op for op in _ops(prog)}
    for cand in candidates:
        assert cand.count == len(cand.where) >= 2
        names = [n for occ in cand.where for n in occ]
        assert len(names) == len(set(names)), "occurrences overlap"
        occurrences = [[by_name[n] for n in occ] for occ in cand.where]
        assert all(_single_output(occ) for occ in occurrences)
        assert all(_isomorphic(occurrences[0], occ) for occ in occurrences[1:])
        found = _matched_sets(cand.source, prog)
        assert all(frozenset(occ) in found for occ in cand.where)


def _greedy(occurrences) -> int:
    taken, used = 0, set()
    for occ in sorted(occurrences, key=lambda o: sorted(o)):
        if used.isdisjoint(occ):
            taken, used = taken + 1, used | set(occ)
    return taken


def _exhaustive_best(prog) -> tuple[int, list[list[frozenset[int]]]]:
    """Every set of 2-3 ops with one output op, grouped into classes by brute-force isomorphism; the
    greedy count (in program order) of the best class, and the classes reaching it."""
    position = {id(op): k for k, op in enumerate(_ops(prog))}
    classes: list[list] = []
    for block, _ in walk_blocks(prog):
        ops = [op for op in block.operations if op.op_type != "const" and not op.blocks]
        for size in (2, 3):
            for combo in itertools.combinations(ops, size):
                if not _single_output(list(combo)):
                    continue
                for cls in classes:
                    if _isomorphic(cls[0], list(combo)):
                        cls.append(list(combo))
                        break
                else:
                    classes.append([list(combo)])
    counted = [(_greedy([frozenset(position[id(o)] for o in occ) for occ in cls]), cls) for cls in classes]
    best = max((n for n, _ in counted), default=0)
    return best, [[frozenset(o.name for o in occ) for occ in cls] for n, cls in counted if n == best]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=repeating_plans)
def test_every_reported_subgraph_repeats_disjointly(plan):
    prog = build(plan)
    _judge(prog, suggest(prog, max_ops=4, covered_by=(), nested=True))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=repeating_plans)
def test_the_most_frequent_small_subgraph_is_not_missed(plan):
    prog = build(plan)
    best, classes = _exhaustive_best(prog)
    reported = suggest(prog, max_ops=3, covered_by=(), nested=True)
    if best < 2:
        return
    for cls in classes:
        members = set(cls)
        assert any(c.count == best and all(frozenset(occ) in members for occ in c.where) for c in reported), (
            cls
        )


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
@given(plan=fragment_plans.map(lambda plan: plan * 2))
def test_repeated_fragments_and_decoys_are_judged_too(plan):
    """``test_fuzz``'s programs (GELUs, SiLUs, linear biases, with decoys), their fragments twice over:
    with and without the passes' coverage, every candidate repeats disjointly."""
    prog, _ = build_program(plan)
    uncovered = suggest(prog, max_ops=4, covered_by=(), nested=True)
    assert uncovered
    _judge(prog, uncovered)
    _judge(prog, suggest(prog, max_ops=4))
