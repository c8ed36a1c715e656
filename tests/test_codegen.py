"""The compiled search (``pattern_infra.codegen``) against the interpreter it replaces.

Differential tests: for every registered generic sub-pass, every anchor and every program op of the
anchor's types, the compiled ``Matcher.match_at`` and the interpreter (``interpreter.Search``) give the same outcome,
the same :class:`Pattern` (ops, operands after any swap, roots, constants, in the same order) and the same
number of bind attempts. The programs are the benchmark chains, the programs the pass tests build, a few
converted zoo models and the fuzzer's random programs. Targeted tests pin the corners of the semantics:
operand orders, missing optional operands, tuple slots, roots, backtracking over consumers, final checks,
constant rules, and the fallbacks to the interpreter.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import linecache
import math
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import ConstRule, Matcher, Pattern, compile_pattern
from pattern_infra import generic_passes as registered_passes
from pattern_infra.codegen import INTERPRET_ENV_VAR
from pattern_infra.blocks import iter_blocks
from pattern_infra.interpreter import Search
from pattern_infra.subpass import SubPass
from pattern_infra.testing.passes import relu_exp

PASSES_DIR = Path(__file__).resolve().parent / "passes"
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the benchmark package sits next to tests/, outside the installed code
    sys.path.append(str(REPO))

from bench.workloads import conv_bn_chain, gelu_chain, layernorm_chain  # noqa: E402

SUBPASSES: list[tuple[str, SubPass]] = [
    (f"{pass_id}:{sub.name}", sub)
    for pass_id, container in registered_passes().items()
    for sub in container.passes
    if isinstance(sub, SubPass)
]
S = (2, 3)


@pytest.fixture(autouse=True)
def _compiled_path(monkeypatch):
    """Every test starts with the compiled path enabled."""
    monkeypatch.delenv(INTERPRET_ENV_VAR, raising=False)


# -- the differential check ---------------------------------------------------------------------------


def interpreted(matcher: Matcher, op: Any, block: Any, anchor: int, accept: Any = None) -> tuple[Pattern | None, int]:
    """The reference: ``interpreter.Search`` as ``match_at`` runs it without the compiled path."""
    before = matcher.bind_attempts
    search = Search(matcher, block, matcher.plans[anchor], False, None, accept)
    found = search.result if search.run(op) else None
    return found, matcher.bind_attempts - before


def compiled(matcher: Matcher, op: Any, block: Any, anchor: int, accept: Any = None) -> tuple[Pattern | None, int]:
    before = matcher.bind_attempts
    found = matcher.match_at(op, block, anchor, accept=accept)
    return found, matcher.bind_attempts - before


def every_match(search: Any, matcher: Matcher, op: Any, block: Any, anchor: int) -> tuple[list[Any], int]:
    """Every structural match at one anchor op, in search order: ``accept`` takes none of them."""
    seen: list[Any] = []

    def collect(match: Pattern) -> str:
        seen.append(content(match))
        return "collected"

    _, binds = search(matcher, op, block, anchor, collect)
    return seen, binds


def _ids(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_ids(v) for v in value)
    return (getattr(value, "name", None), id(value))


def content(p: Pattern | None) -> Any:
    """Everything a Pattern exposes, by identity and in order."""
    if p is None:
        return None
    return (
        p.pattern_name,
        [(k, _ids(v)) for k, v in p.ops.items()],
        [(k, [(slot, _ids(v)) for slot, v in d.items()]) for k, d in p._operands.items()],
        _ids(p.root_vars),
        [(k, _ids(v)) for k, v in p.consts.items()],
        _ids(p.final_ops),
        id(p.block),
    )


def assert_same(matcher: Matcher, op: Any, block: Any, anchor: int) -> Pattern | None:
    want, want_binds = interpreted(matcher, op, block, anchor)
    got, got_binds = compiled(matcher, op, block, anchor)
    where = f"{matcher.compiled.name} anchored at {matcher.nodes[anchor].name} on {op.name}"
    assert content(got) == content(want), where
    assert got_binds == want_binds, where
    if got is not None:  # both searches go on past a match not taken, through the same choices
        assert every_match(compiled, matcher, op, block, anchor) == every_match(
            interpreted, matcher, op, block, anchor
        ), where
    return got


def check_every_subpass(prog: Program) -> tuple[int, int]:
    """Compares both searches for every sub-pass, anchor and candidate op of ``prog``.

    Returns:
        (comparisons made, matches among them)
    """
    compared = matched = 0
    for block in iter_blocks(prog):
        by_type: dict[str, list[Any]] = {}
        for op in block.operations:
            by_type.setdefault(op.op_type, []).append(op)
        for _, sub in SUBPASSES:
            matcher = sub.matcher
            for anchor, node in enumerate(matcher.nodes):
                for op_type in sorted(node.op_types):
                    for op in by_type.get(op_type, ()):
                        compared += 1
                        matched += assert_same(matcher, op, block, anchor) is not None
    return compared, matched


# -- programs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [lambda: gelu_chain(3), lambda: layernorm_chain(2), lambda: conv_bn_chain(2)],
    ids=["gelu_chain", "layernorm_chain", "conv_bn_chain"],
)
def test_benchmark_chains(build):
    compared, matched = check_every_subpass(build())
    assert matched >= 2 and compared > matched


_PARAMETER_SET = type(pytest.param(None))


def _parameter_rows(test: Any) -> list[dict[str, Any]]:
    """The parameter combinations of a test's stacked ``parametrize`` marks."""
    axes = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize" or len(mark.args) < 2:
            continue
        names = mark.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = []
        for value in mark.args[1]:
            if isinstance(value, _PARAMETER_SET):
                value = value.values[0] if len(names) == 1 else value.values
            rows.append({names[0]: value} if len(names) == 1 else dict(zip(names, value)))
        axes.append(rows)
    if not axes:
        return []
    return [dict(kv for row in combo for kv in row.items()) for combo in itertools.product(*axes)]


def _plain(value: Any) -> bool:
    """Data a builder can take without side effects on shared objects (no program, no module)."""
    if value is None or isinstance(value, (str, int, float, bool, np.generic, np.ndarray)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _is_builder(name: str, f: Any) -> bool:
    """A function of the module that builds a program: annotated so, or public with every parameter
    defaulted. Helpers that take a program (and may run passes on it) are never builders."""
    signature = inspect.signature(f)
    if signature.return_annotation in ("Program", Program):
        return True
    return not name.startswith(("_", "test")) and all(
        p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        for p in signature.parameters.values()
    )


def harvest(module: Any, limit: int = 25) -> list[Program]:
    """Programs a pass-test module builds, without running any of its tests.

    Its builders are called with their defaults and with its tests' parameter combinations (plain data
    only); programs its tests are parametrized with are taken as they are.
    """
    functions = {
        n: f for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__
    }
    builders = [f for n, f in functions.items() if not n.startswith("test") and _is_builder(n, f)]
    rows: list[dict[str, Any]] = [{}]
    programs: list[Program] = []
    for name, test in functions.items():
        if name.startswith("test"):
            for row in _parameter_rows(test):
                programs.extend(v for v in row.values() if isinstance(v, Program))
                rows.append(row)
    seen: set[str] = set()
    for builder in builders:
        parameters = inspect.signature(builder).parameters
        required = {n for n, p in parameters.items() if p.default is p.empty and p.kind not in (
            p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        for row in rows:
            kwargs = {k: v for k, v in row.items() if k in parameters}
            extra = row.get("kwargs")
            if isinstance(extra, dict) and set(extra) <= set(parameters):
                kwargs.update(extra)
            if not required <= set(kwargs) or not _plain(kwargs):
                continue
            key = f"{builder.__name__}{sorted((k, repr(v)) for k, v in kwargs.items())}"
            if key in seen or len(programs) >= limit:
                continue
            seen.add(key)
            try:
                result = builder(**kwargs)
            except Exception:  # noqa: BLE001 - a combination this builder does not take
                continue
            for value in result if isinstance(result, tuple) else (result,):
                if isinstance(value, Program):
                    programs.append(value)
    return programs


PASS_TEST_MODULES = sorted(p.stem for p in PASSES_DIR.glob("test_*.py"))


@pytest.mark.parametrize("module_name", PASS_TEST_MODULES)
def test_programs_of_the_pass_tests(module_name):
    if str(PASSES_DIR) not in sys.path:
        sys.path.insert(0, str(PASSES_DIR))
    module = importlib.import_module(module_name)  # the very module pytest collects, when it does
    programs = harvest(module)
    assert programs, f"no program harvested from {module_name}"
    compared = 0
    for prog in programs:
        compared += check_every_subpass(prog)[0]
    assert compared > 0


ZOO_MODELS = ("gpt2_block", "resnet_stack")


@pytest.fixture(scope="module")
def zoo_programs() -> dict[str, Program]:
    """Zoo models converted without any pass: every pattern is still written out."""
    ct = pytest.importorskip("coremltools")
    pytest.importorskip("torch")
    from pattern_infra.testing.convert import convert_torch
    from pattern_infra.testing.models import ZOO

    out = {}
    for name in ZOO_MODELS:
        module, args = ZOO[name]()
        out[name] = convert_torch(module, args, override=False, pass_pipeline=ct.PassPipeline.EMPTY)
    return out


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_model_zoo(zoo_programs, name):
    compared, matched = check_every_subpass(zoo_programs[name])
    assert compared > 0


def _fuzz():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_fuzz

    return test_fuzz


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plan=_fuzz().plans)
def test_fuzzer_programs(plan):
    prog, _ = _fuzz().build_program(plan)
    compared, _ = check_every_subpass(prog)
    assert compared > 0


# -- targeted cases -------------------------------------------------------------------------------------


def matcher_of(pattern: Program, **options: Any) -> Matcher:
    return Matcher(compile_pattern(pattern, **options))


def ops_of(prog: Program) -> dict[str, Any]:
    return {op.name: op for op in prog.functions["main"].operations}


def same_everywhere(matcher: Matcher, prog: Program) -> list[Pattern]:
    """Both searches at every anchor and every op of ``prog``'s main block; the distinct matches."""
    block = prog.functions["main"]
    found: dict[frozenset[int], Pattern] = {}
    for anchor in range(len(matcher.nodes)):
        for op in block.operations:
            p = assert_same(matcher, op, block, anchor)
            if p is not None:
                found.setdefault(frozenset(id(o) for o in p.op_set), p)
    return list(found.values())


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def half(x):
    return mb.mul(x=x, y=0.5, name="m")


@pytest.mark.parametrize("constants", ["any", "const", "value"])
def test_commutative_constant_on_either_side(constants):
    matcher = matcher_of(half, constants=constants)
    c = np.float32(0.5)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        a = mb.mul(x=x, y=c, name="xc")
        b = mb.mul(x=c, y=a, name="cx")
        d = mb.mul(x=b, y=b, name="same")  # x is y: one order only
        both = mb.mul(x=np.float32(0.5), y=np.float32(0.25), name="both")  # constants on both sides
        return mb.add(x=d, y=both)

    found = {p.m.name: p for p in same_everywhere(matcher, prog)}
    assert found["xc"].operand("m", "y").val == c and found["cx"].operand("m", "y").val == c
    assert found["cx"].root_var is ops_of(prog)["xc"].outputs[0]
    # constants on both sides: as written first; only the value rule needs the swapped order
    want_y = c if constants == "value" else np.float32(0.25)
    assert found["both"].operand("m", "y").val == want_y
    if constants == "any":  # anything goes in the constant slot, an intermediate included
        assert found["same"].root_var is ops_of(prog)["cx"].outputs[0]


def test_x_is_y_binds_both_roots_to_one_variable():
    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def pat(a, b):
        return mb.add(x=mb.relu(x=a, name="r"), y=b, name="s")

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        r = mb.relu(x=x, name="r")
        t = mb.add(x=r, y=r, name="twice")  # relu output used twice: the final check refuses it
        u = mb.relu(x=t, name="u")
        return mb.add(x=x, y=u, name="s2")  # swapped order needed

    found = same_everywhere(matcher_of(pat), prog)
    assert [p.s.name for p in found] == ["s2"]
    assert found[0].operand("s", "x").name == "u" and found[0].root_vars[1].name == "x"


def test_alternative_without_an_optional_constant_slot():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        return mb.exp(x=mb.leaky_relu(x=x, alpha=0.1, name="act"), name="e")

    matcher = matcher_of(pat, alternatives={"act": ["leaky_relu", "relu"]})

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        a = mb.exp(x=mb.relu(x=x, name="plain"), name="e1")
        return mb.exp(x=mb.leaky_relu(x=a, alpha=0.3, name="leaky"), name="e2")

    found = {p.act.name: p for p in same_everywhere(matcher, prog)}
    assert set(found) == {"plain", "leaky"}
    assert "alpha" not in found["plain"]._operands["act"] and "act.alpha" not in found["plain"].consts
    assert found["leaky"].consts["act.alpha"].val == pytest.approx(0.3)
    assert "# an alternative op type without this wildcard constant" in matcher.source(0)


def test_tuple_slots():
    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def pat(a, b):
        return mb.concat(values=(a, mb.relu(x=b, name="r")), axis=0, name="c")

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def prog(x, y):
        good = mb.concat(values=(x, mb.relu(x=y, name="r1")), axis=0, name="good")
        three = mb.concat(values=(x, mb.relu(x=y, name="r2"), y), axis=0, name="three")
        order = mb.concat(values=(mb.relu(x=x, name="r3"), y), axis=0, name="order")
        return good, three, order

    matcher = matcher_of(pat)
    # coremltools keeps a tuple input as a list in op._input_vars; a tuple is accepted the same way
    for as_tuple in (False, True):
        if as_tuple:
            for op in prog.functions["main"].operations:
                if op.op_type == "concat":
                    op._input_vars["values"] = tuple(op._input_vars["values"])
        found = same_everywhere(matcher, prog)
        assert [p.c.name for p in found] == ["good"]
        assert found[0].operand("c", "values")[1].name == "r1"


def test_roots_bound_consistently_or_not():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        return mb.sub(x=mb.relu(x=x, name="r"), y=x, name="s")

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def prog(x, y):
        ok = mb.sub(x=mb.relu(x=x, name="r1"), y=x, name="ok")
        bad = mb.sub(x=mb.relu(x=x, name="r2"), y=y, name="bad")
        return ok, bad

    found = same_everywhere(matcher_of(pat), prog)
    assert [p.s.name for p in found] == ["ok"]


def test_down_steps_backtrack_to_the_next_consumer():
    # r is final (its output may be used anywhere); m and s are reached by down-steps from r. The first
    # mul consumer of r leads nowhere (no sub after it), the second completes the match.
    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def pat(x, y):
        r = mb.relu(x=x, name="r")
        m = mb.mul(x=r, y=y, name="m")
        return mb.sub(x=m, y=y, name="s"), r

    matcher = matcher_of(pat)
    anchor = matcher.compiled.by_name["r"]
    assert [st.kind for st in matcher.plans[anchor][1:]] == [1, 1]  # two down-steps

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def prog(x, y):
        r = mb.relu(x=x, name="r")
        dead_end = mb.mul(x=r, y=y, name="m1")
        other_root = mb.mul(x=y, y=r, name="m2")  # swapped operands
        s_wrong = mb.sub(x=other_root, y=x, name="s_wrong")  # y differs: fails, then the next consumer
        m3 = mb.mul(x=r, y=y, name="m3")
        s = mb.sub(x=m3, y=y, name="s")
        return dead_end, s_wrong, s

    block = prog.functions["main"]
    p = assert_same(matcher, ops_of(prog)["r"], block, anchor)
    assert p is not None and (p.m.name, p.s.name) == ("m3", "s")
    assert p.operand("m", "x").name == "r"
    assert same_everywhere(matcher, prog)


def test_several_outputs_with_shared_input():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        return mb.exp(x=x, name="e"), mb.sin(x=x, name="s")

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return mb.exp(x=x, name="e1"), mb.exp(x=x, name="e2"), mb.sin(x=x, name="s1"), mb.cos(x=x)

    found = same_everywhere(matcher_of(pat), prog)
    assert {(p.e.name, p.s.name) for p in found} == {("e1", "s1"), ("e2", "s1")}


def test_final_check_extra_consumer_and_block_output():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        a = mb.exp(x=mb.relu(x=x, name="r1"), name="e1")
        r2 = mb.relu(x=a, name="r2")
        b = mb.exp(x=r2, name="e2")
        c = mb.sin(x=r2, name="extra")  # second consumer of an intermediate
        r3 = mb.relu(x=c, name="r3")
        d = mb.exp(x=r3, name="e3")
        return b, d, r3  # r3 is a block output

    found = same_everywhere(matcher_of(relu_exp), prog)
    assert [p.e.name for p in found] == ["e1"]


def test_final_check_root_or_constant_computed_inside_the_match():
    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def pat(x, a):
        r = mb.relu(x=x, name="r")
        return mb.add(x=r, y=a, name="s"), r

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        r = mb.relu(x=x, name="r1")
        return mb.add(x=r, y=r, name="s1")  # root a is r's own output

    assert same_everywhere(matcher_of(pat), prog) == []

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def scaled(x):
        r = mb.relu(x=x, name="r")
        return mb.mul(x=r, y=2.0, name="m"), r

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog2(x):
        r = mb.relu(x=x, name="r1")
        return mb.mul(x=r, y=r, name="m1")  # the constant slot is wired from the match

    assert same_everywhere(matcher_of(scaled, constants="any"), prog2) == []


@pytest.mark.parametrize(
    "dtype, value, expected, fused",
    [
        (types.fp32, np.float32(0.5), 0.5, True),
        (types.fp32, np.float32(0.5 + 1e-4), 0.5, False),
        (types.fp32, np.float32(0.5 + 5.9e-6), 0.5, True),  # tolerance 1e-6 + 1e-5 * 0.5 = 6e-6
        (types.fp32, np.float32(0.5 + 6.1e-6), 0.5, False),
        (types.fp32, np.float32(math.nan), 0.5, False),
        (types.fp32, np.array([0.5], np.float32), 0.5, True),
        (types.fp32, np.array([0.5, 0.5, 0.5], np.float32), 0.5, False),
        (types.fp16, np.float16(0.5), 0.5, True),
        (types.int32, np.int32(2), 2.0, True),
        (types.int32, np.int32(3), 2.0, False),
    ],
)
def test_value_rule_fast_path_agrees_with_const_rule(dtype, value, expected, fused):
    @mb.program(input_specs=[mb.TensorSpec(shape=S, dtype=dtype)])
    def pat(x):
        return mb.mul(x=x, y=np.array(expected, dtype=np.asarray(value).dtype), name="m")

    @mb.program(input_specs=[mb.TensorSpec(shape=S, dtype=dtype)])
    def prog(x):
        return mb.mul(x=x, y=value, name="m1")

    for rule in ("value", "const"):
        found = same_everywhere(matcher_of(pat, constants=rule), prog)
        assert bool(found) == (fused or rule == "const")


@pytest.mark.parametrize(
    "program_value, fused",
    [
        (np.float16(1 / 6), True),  # 0.1666259765625: the pattern's 1/6 rounded to float16
        (np.float16(1.702), True),
        (np.float16(1 / 6) + np.float16(0.0001), False),  # the next float16 values are not its rounding
        (np.array([1 / 6], np.float16), True),
        (np.float32(np.float16(1 / 6)), False),  # in float32 the rounding is a different value
    ],
)
def test_value_rule_compares_in_the_program_constants_dtype(program_value, fused):
    """A float32 pattern constant matches its own float16 rounding in a float16 program, in the generated
    search and in ConstRule.accepts alike (``same_everywhere`` compares both)."""
    expected = 1.702 if np.asarray(program_value).ravel()[0] > 1 else 1 / 6
    dtype = types.fp16 if np.asarray(program_value).dtype == np.float16 else types.fp32

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        return mb.mul(x=x, y=np.float32(expected), name="m")

    @mb.program(input_specs=[mb.TensorSpec(shape=S, dtype=dtype)])
    def prog(x):
        return mb.mul(x=x, y=program_value, name="m1")

    assert bool(same_everywhere(matcher_of(pat, constants="value"), prog)) == fused
    (const,) = [op for op in prog.functions["main"].operations if op.op_type == "const"]
    reason = ConstRule("value").accepts(const.outputs[0], np.asarray(np.float32(expected)))
    assert (reason is None) == fused
    assert fused or "differs from the pattern's" in reason


@pytest.mark.parametrize("value, fused", [(0.549, True), (0.551, False), (0.451, True), (0.449, False)])
def test_value_rule_relative_tolerance(value, fused):
    matcher = matcher_of(half, const_rules={"m.y": ConstRule("value", rtol=0.1, atol=0.0)})

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return mb.mul(x=np.float32(value), y=x, name="m1")

    assert bool(same_everywhere(matcher, prog)) == fused


def test_const_rule_on_a_symbolic_value():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def pat(x):
        return mb.reshape(x=x, shape=np.array([3, 2], np.int32), name="rs")

    matcher = matcher_of(pat, constants="const")
    sym = mb.TensorSpec(shape=(get_new_symbol(), 3))

    @mb.program(input_specs=[sym])
    def symbolic(x):
        return mb.reshape(x=x, shape=mb.shape(x=x), name="rs1")  # not a compile-time constant

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def static(x):
        return mb.reshape(x=x, shape=mb.shape(x=x), name="rs2")  # known at compile time

    assert same_everywhere(matcher, symbolic) == []
    assert len(same_everywhere(matcher, static)) == 1


def test_wrong_type_outputs_and_block():
    matcher = matcher_of(relu_exp)

    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 2))])
    def prog(x):
        a, b = mb.split(x=x, num_splits=2, axis=0, name="sp")
        return mb.exp(x=mb.relu(x=a, name="r"), name="e"), mb.tanh(x=b)

    same_everywhere(matcher, prog)
    other = gelu_chain(1).functions["main"]
    op = ops_of(prog)["e"]
    assert assert_same(matcher, op, other, 1) is None  # another block


# -- the compiled function itself -------------------------------------------------------------------------


def test_source_is_readable_and_registered():
    matcher = matcher_of(relu_exp)
    text = matcher.source(1)
    assert "def search(_m, op, block, order, accept):" in text and "'r'" in text and "'e'" in text
    assert "# step 1: up to 'r' (relu)" in text
    fn = matcher._build(1).function
    assert fn.__source__ == text
    filename = fn.__code__.co_filename
    assert filename.startswith(f"<pattern_infra.codegen:{matcher.compiled.name}:1")
    assert linecache.getline(filename, 1).startswith("# Generated by pattern_infra.codegen")
    # two patterns of one name: each keeps its own lines for tracebacks
    first, second = matcher_of(relu_exp, name="twin"), matcher_of(half, name="twin")
    names = [m._build(0).function.__code__.co_filename for m in (first, second)]
    assert names[0] != names[1] and all(n.startswith("<pattern_infra.codegen:twin:0") for n in names)
    assert "'r' (relu)" in linecache.getline(names[0], 2) + linecache.getline(names[0], 1)
    assert "'m' (mul)" in linecache.getline(names[1], 2) + linecache.getline(names[1], 1)


def test_tracebacks_show_the_generated_lines():
    matcher = matcher_of(relu_exp)

    class Broken:
        """An op whose inputs cannot be read."""

        op_type = "exp"
        _output_vars = [object()]
        enclosing_block = None

        @property
        def _input_vars(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError) as info:
        matcher.match_at(Broken(), None, 1)
    text = "".join(traceback.format_exception(info.value))
    assert "<pattern_infra.codegen:" in text and "_iv = o1._input_vars" in text


def test_compiled_lazily_and_cached():
    matcher = matcher_of(relu_exp)
    prog = gelu_chain(1)
    block = prog.functions["main"]
    assert all(fn is not None and not callable(fn) for fn in matcher._compiled_fns)
    op = next(iter(block.operations))
    matcher.match_at(op, block, 0)
    first = matcher._compiled_fns[0]
    assert callable(first) and not callable(matcher._compiled_fns[1])
    matcher.match_at(op, block, 0)
    assert matcher._compiled_fns[0] is first


def _forbid_compiled(matcher: Matcher) -> None:
    def fail(*args: Any) -> None:
        raise AssertionError("the compiled search ran")

    matcher._compiled_fns = [fail] * len(matcher.nodes)


def test_environment_variable_trace_and_root_hint_use_the_interpreter(monkeypatch):
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return mb.exp(x=mb.relu(x=x, name="r"), name="e")

    block = prog.functions["main"]
    e = ops_of(prog)["e"]
    matcher = matcher_of(relu_exp)
    _forbid_compiled(matcher)
    monkeypatch.setenv(INTERPRET_ENV_VAR, "1")
    assert matcher.match_at(e, block, 1) is not None
    monkeypatch.delenv(INTERPRET_ENV_VAR)
    assert matcher.match_at(e, block, 1, trace=True) is not None
    assert matcher.match_at(e, block, 1, root_hint=block.inputs["x"]) is not None
    with pytest.raises(AssertionError, match="compiled search ran"):
        matcher.match_at(e, block, 1)


def test_fanout_patterns_keep_the_interpreter():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        r = mb.relu(x=x, name="r")
        return mb.exp(x=r, name="users")

    matcher = matcher_of(pat, fanout=["users"])
    assert "not compiled" in matcher.source(0) and "fan-out" in matcher.source(0)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        r = mb.relu(x=x, name="r")
        return mb.exp(x=r, name="e1"), mb.exp(x=r, name="e2")

    block = prog.functions["main"]
    found = matcher.match_at(ops_of(prog)["r"], block, 0)
    assert [op.name for op in found.users] == ["e1", "e2"]
    assert matcher._compiled_fns == [None, matcher._compiled_fns[1]]


def test_too_many_choice_points_fall_back_to_the_interpreter():
    depth = 22

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        y = x
        for i in range(depth):
            y = mb.add(x=y, y=x, name=f"a{i}")
        return y

    matcher = matcher_of(pat)
    anchor = depth - 1
    assert "does not compile" in matcher._build(anchor).reason or "nested" in matcher._build(anchor).reason

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        y = x
        for i in range(depth):
            y = mb.add(x=x, y=y, name=f"p{i}")
        return y

    block = prog.functions["main"]
    p = assert_same(matcher, ops_of(prog)[f"p{depth - 1}"], block, anchor)
    assert p is not None and matcher._compiled_fns[anchor] is None


def test_order_reaches_the_pattern():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return mb.exp(x=mb.relu(x=x, name="r"), name="e")

    block = prog.functions["main"]

    def backwards(ops):
        return list(reversed(ops))

    found = matcher_of(relu_exp).match_at(ops_of(prog)["e"], block, 1, order=backwards)
    assert [op.name for op in found.op_list()] == ["e", "r"]


def test_commutative_op_with_an_optional_constant_keeps_the_interpreter():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        return mb.exp(x=mb.add(x=x, y=1.0, name="a"), name="e")

    matcher = matcher_of(pat, alternatives={"a": ["add", "relu"]})
    assert "not compiled" in matcher.source(1) and "optional constant" in matcher.source(1)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return mb.exp(x=mb.relu(x=x, name="r"), name="e1"), mb.exp(x=mb.add(x=2.0, y=x), name="e2")

    assert len(same_everywhere(matcher, prog)) == 2


# -- choices (one_of, equivalences=) -----------------------------------------------------------------------


def test_choice_patterns_compiled_and_interpreted_agree():
    """Every anchor of the 12-spelling RMSNorm pattern (and of a pattern with equivalences) on every
    candidate op of programs holding every spelling, decoys included: same Pattern, same bind attempts."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_choices import SPELLINGS, rms_norm, rms_program

    from pattern_infra import compile_pattern

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))])
    def shifted_square(x):
        sq = mb.pow(x=x, y=2.0, name="sq")
        return mb.sub(x=mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean"), y=0.5, name="shift")

    matchers = [Matcher(compile_pattern(rms_norm, constants="const")),
                Matcher(compile_pattern(shifted_square, equivalences=True, constants="value"))]
    programs = [rms_program(*s) for s in SPELLINGS] + [rms_program("mul", "div_sqrt", True, extra_consumer=True)]

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def squares(x):
        a = mb.add(x=mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[-1], keep_dims=True), y=-0.5)
        b = mb.sub(x=mb.reduce_mean(x=mb.pow(x=x, y=2.0), axes=[-1], keep_dims=True), y=0.25)
        return a, b

    compared = matched = 0
    for prog in programs + [squares]:
        block = prog.functions["main"]
        for matcher in matchers:
            assert all(matcher._build(a).function is not None for a in range(len(matcher.nodes)))
            for anchor, node in enumerate(matcher.nodes):
                for op in block.operations:
                    if op.op_type in node.op_types:
                        compared += 1
                        found = assert_same(matcher, op, block, anchor)
                        matched += found is not None
                        if found is not None:
                            assert found.choices == interpreted(matcher, op, block, anchor)[0].choices
    assert compared > 100 and matched >= 12 * 4 + 1


@pytest.mark.parametrize("after_the_choice", [False, True], ids=["choice_final", "choice_then_relu"])
def test_an_op_of_a_sub_match_is_not_bound_again(monkeypatch, after_the_choice):
    """Injectivity across a choice: ``sq`` and the alternative's ``inner`` both fit the program's one
    ``mul(x, x)``; the interpreter refuses (its ``used`` map holds the sub-match's ops), and so must the
    generated search, whichever is bound first: an outer op bound after the choice compared with the
    sub-match's ops, an alternative's op compared with the outer ops bound before the choice."""
    from pattern_infra import find_matches
    from pattern_infra.choices import one_of

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pattern(x):
        sq = mb.mul(x=x, y=x, name="sq")
        c = one_of("c", lambda: mb.mul(x=mb.mul(x=x, y=x, name="inner"), y=x, name="cube"),
                   lambda: mb.pow(x=x, y=3.0, name="cube"))
        return (mb.relu(x=c, name="out") if after_the_choice else c), sq

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        cube = mb.mul(x=mb.mul(x=x, y=x), y=x)
        return mb.relu(x=cube) if after_the_choice else cube

    matcher = matcher_of(pattern)
    block = prog.functions["main"]
    compared = 0
    for anchor, node in enumerate(matcher.nodes):
        for op in block.operations:
            if op.op_type in node.op_types:
                compared += 1
                assert assert_same(matcher, op, block, anchor) is None
    assert compared >= 4 and list(find_matches(pattern, prog)) == []


def _spelled_norms(draw: Any) -> Program:
    """A program of 1 to 3 RMSNorms of random spellings on one input, with decoys: a weight read in
    either operand order, an intermediate with a consumer outside, a square shared by two norms."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_choices import NORMALIZERS, SQUARES

    norms = draw(st.lists(st.tuples(st.sampled_from(sorted(SQUARES)), st.sampled_from(sorted(NORMALIZERS)),
                                    st.booleans(), st.booleans(), st.sampled_from([None, "sq", "v", "norm"])),
                          min_size=1, max_size=3))
    share_square = draw(st.booleans())

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 8)), mb.TensorSpec(shape=(8,))])
    def prog(x, w):
        outs, shared = [], None
        for square, normalizer, weighted, swap, extra in norms:
            sq = shared if share_square and shared is not None else SQUARES[square](x)
            shared = sq
            v = mb.add(x=mb.reduce_mean(x=sq, axes=[-1], keep_dims=True), y=1e-6)
            y = NORMALIZERS[normalizer](x, v)
            if extra:
                outs.append(mb.relu(x={"sq": sq, "v": v, "norm": y}[extra]))
            outs.append((mb.mul(x=w, y=y) if swap else mb.mul(x=y, y=w)) if weighted else mb.exp(x=y))
        return tuple(outs)

    return prog


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_spellings_compiled_and_interpreted_agree(data):
    """Random programs of RMSNorm spellings sharing their input (several consumers of ``x`` for every
    down-step; sub-matches that overlap another norm's ops): the 12-spelling pattern's generated search,
    alternatives inline, and the interpreter agree at every anchor and op, bind attempts included."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_choices import rms_norm

    prog = _spelled_norms(data.draw)
    matcher = Matcher(compile_pattern(rms_norm, constants="const"))
    same_everywhere(matcher, prog)  # assert_same at each anchor and op: same Pattern, same bind attempts


def test_a_match_writes_a_flat_alternatives_entries_in_place():
    """The tanh-GELU patterns' one choice (the cube, ``pow(x, 3)`` or ``x * x * x``) holds no choice of
    its own: the rest of the search after it is small, so it is written into each alternative where the
    alternative finds its sub-match (no rest function, no call, no row), specialised to it: the match is
    written once per alternative, the alternative's entries in its own dict displays instead of merged
    (``**``) in; the fused programs agree with the interpreter's (the differential tests), and here on
    both spellings."""
    from generic_passes._gelu_common import GELU_CONSTANTS
    from generic_passes.fuse_gelu_tanh_approximation import gelu_tanh_pattern_1, gelu_tanh_pattern_2

    for pattern in (gelu_tanh_pattern_1, gelu_tanh_pattern_2):
        matcher = Matcher(compile_pattern(pattern, constants=GELU_CONSTANTS))
        for anchor in range(len(matcher.nodes)):
            source = matcher.source(anchor)
            assert "_p = _rest" not in source and "def _rest" not in source, anchor
            assert source.count("_of_search(") == 2, anchor
            assert "**_pt" not in source, anchor
            spellings = re.findall(r"_FINALS, (_S\d+)\)", source)  # each leaf's spelling, a constant of the search
            namespace = matcher._build(anchor).function.__globals__
            assert sorted(namespace[s]["cube"] for s in spellings) == [0, 1], anchor

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4, 8))])
    def both_spellings(x):
        outs = []
        for power, first in itertools.product((True, False), (True, False)):
            cube = mb.pow(x=x, y=3.0) if power else mb.mul(x=mb.mul(x=x, y=x), y=x)
            inner = mb.mul(x=mb.add(x=x, y=mb.mul(x=cube, y=0.044715)), y=0.7978845834732056)
            one_plus = mb.add(x=mb.tanh(x=inner), y=1.0)
            outs.append(mb.mul(x=x, y=mb.mul(x=one_plus, y=0.5)) if first
                        else mb.mul(x=mb.mul(x=x, y=0.5), y=one_plus))
        return tuple(outs)

    for pattern in (gelu_tanh_pattern_1, gelu_tanh_pattern_2):
        found = same_everywhere(Matcher(compile_pattern(pattern, constants=GELU_CONSTANTS)), both_spellings)
        assert sorted(p.choices["cube"] for p in found if p is not None) == [0, 1], pattern


def test_alternatives_are_written_into_the_search_that_holds_the_choice():
    """The 12-spelling RMSNorm's generated searches search every alternative inline: no call into
    ``choice_search`` per alternative, no ``binding.build_pattern`` (the match's dicts are literals),
    every sub-match a call of the rest of the search with its row's fields written out, no sub-match object;
    and they match (the agreement with the interpreter, match by match, is the test above)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_choices import SPELLINGS, rms_norm, rms_program

    from pattern_infra import compile_pattern

    matcher = Matcher(compile_pattern(rms_norm, constants="const"))
    for anchor in range(len(matcher.nodes)):
        source = matcher.source(anchor)
        calls = [name for name in ("_choice_matches(", "_entered(", "_build_pattern(", "_SM(", "_SMB(", ".row(")
                 if name in source]
        assert calls == [] and matcher._build(anchor).function is not None, (anchor, calls)
    prog = rms_program(*SPELLINGS[3])
    block = prog.functions["main"]
    final = [op for op in block.operations if op.op_type != "const"][-1]
    found = matcher.match_at(final, block, matcher.compiled.by_name["weighted"])
    assert found is not None and found.final_op is final and found.choices["square"] == 0


def _twelve_spellings_written(merged: bool) -> int:
    """The 12-spelling RMSNorm's generated searches, at every anchor: the rows alternatives of choices
    written per alternative call the rest of the search with hold locals (no dict), nothing merged
    (``**``) unless ``merged``; on a program of all 12
    spellings, every spelling found, the same matches as the interpreter's (``same_everywhere``).
    Returns the number of matches written out per search (the same at every anchor)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_choices import SPELLINGS, rms_norm

    from bench.choices import chain
    from pattern_infra import compile_pattern

    matcher = Matcher(compile_pattern(rms_norm, constants="const"))
    written = set()
    for anchor in range(len(matcher.nodes)):
        source = matcher.source(anchor)
        written.add(len({line.strip() for line in source.splitlines() if re.search(r"_(of_search|pattern_of)\(", line)}))
        # a row: the arguments of a call of the rest of the search, or assigned where it is written in
        rows = [line for line in source.splitlines() if "_p = _rest" in line or re.match(r" *_pt\w+ = ", line)]
        assert ("**_pt" in source) == merged, anchor
        assert merged or not any("{" in row for row in rows), anchor

    found = same_everywhere(matcher, chain(SPELLINGS, len(SPELLINGS)))  # every spelling, side by side
    spellings = {(p.choices["square"], p.choices["weighted"], p.choices["normed"]) for p in found}
    assert len(spellings) == len(SPELLINGS), sorted(spellings)
    assert len(written) == 1
    return written.pop()


def test_every_choice_of_the_12_spellings_is_written_per_alternative():
    """The 12-spelling RMSNorm has three choices, one nested in another (``normed`` inside ``weighted``):
    fewer spellings than ``MAX_WRITTEN_MATCHES``, so each search writes the match once per spelling,
    its rows hold locals and nothing is merged."""
    from pattern_infra.codegen_choices import MAX_WRITTEN_MATCHES

    assert MAX_WRITTEN_MATCHES >= 12
    assert _twelve_spellings_written(merged=False) == 12


def test_past_the_cap_a_choice_is_written_per_alternative_its_nested_ones_merged(monkeypatch):
    """With at most 4 matches written out, ``weighted`` (6 spellings with ``normed`` nested in it) is
    written per alternative alone, ``normed`` merged into it, and the square written with it (2 x 2 = 4
    matches); the same matches as the interpreter, every spelling."""
    from pattern_infra import codegen_choices

    monkeypatch.setattr(codegen_choices, "MAX_WRITTEN_MATCHES", 4)
    assert _twelve_spellings_written(merged=True) == 4


def test_a_choice_left_to_its_helper_is_merged_into_the_match():
    """A choice whose alternative the generator cannot write (an op of two types whose wildcard constant
    one of them lacks) is searched by ``choice_search``'s helper and its sub-match merged into the match,
    although it is the choice a match would write per alternative: same matches as the interpreter."""
    from pattern_infra import one_of

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        act = one_of("act_or_sigmoid", lambda: mb.leaky_relu(x=x, alpha=0.1, name="act"),
                     lambda: mb.sigmoid(x=x, name="sg"))
        return mb.exp(x=act, name="e")

    matcher = matcher_of(pat, alternatives={"act": ["leaky_relu", "relu"]})
    sources = [matcher.source(anchor) for anchor in range(len(matcher.nodes))]
    assert all("_choice_matches(" in text or "_entered(" in text for text in sources)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return (mb.exp(x=mb.relu(x=x, name="plain")), mb.exp(x=mb.leaky_relu(x=x, alpha=0.3, name="leaky")),
                mb.exp(x=mb.sigmoid(x=x, name="sig")))

    found = same_everywhere(matcher, prog)
    assert sorted(p.act_or_sigmoid.name for p in found) == ["leaky", "plain", "sig"]
    assert sorted(p.choices["act_or_sigmoid"] for p in found) == [0, 0, 1]


def test_an_alternative_is_searched_no_further_than_the_first_match_taken():
    """A choice entered from a variable: its first alternative finds a sub-match at each ``relu`` below
    ``a``; the search goes on from the first one the moment it is found and takes the match, so the
    second ``relu`` is never bound. Interpreted and compiled: 3 bind attempts (``a``, the first ``relu``,
    its ``exp``), where searching the alternative to its end first made 4 (both ``relu``)."""
    from pattern_infra import one_of

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pat(x):
        a = mb.abs(x=x, name="a")
        act = one_of("act", lambda: mb.relu(x=a, name="r"), lambda: mb.sigmoid(x=a, name="s"))
        return a, mb.exp(x=act, name="e")  # `a` is an output too: its other uses are free

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        a = mb.abs(x=x, name="abs")
        return a, mb.exp(x=mb.relu(x=a, name="first")), mb.exp(x=mb.relu(x=a, name="second"))

    matcher = matcher_of(pat)
    block = prog.functions["main"]
    anchor = matcher.compiled.by_name["a"]
    op = next(op for op in block.operations if op.op_type == "abs")
    for search in (interpreted, compiled):
        found, attempts = search(matcher, op, block, anchor)
        assert found is not None and found.act.name == "first" and attempts == 3, (search.__name__, attempts)
    assert "_p = _rest" not in matcher.source(anchor)  # the rest after the choice written where it is found


def test_an_alternative_is_a_loop_only_when_a_check_of_its_own_leaves_it():
    """An alternative's search is written in ``for _ in _ONCE`` when a failed check outside its own loops
    must leave it (``continue``); else in a plain block. The 12-spelling RMSNorm's square (its operands
    checked first) is a loop, the alternatives entered from ``var`` (each first loops over consumers)
    are blocks; both find every spelling as the interpreter does (``_twelve_spellings_written``)."""
    from pattern_infra.codegen_rests import leaves_early

    assert leaves_early(["o1 = o0", "if o1 is None:  # why", "    continue"])
    assert not leaves_early(["r1 = _ent0", "for o1 in r1._child_ops:", "    if o1 is None:", "        continue",
                              "    # continue", "o2 = o1"])
    assert leaves_early(["for o1 in c:", "    pass", "if o1 is None:", "    break  # why"])
    sys.path.insert(0, str(Path(__file__).parent))
    from test_choices import rms_norm

    source = Matcher(compile_pattern(rms_norm, constants="const")).source(2)  # anchored at var
    assert "for _ in _ONCE:  # alternative 0" in source and "if True:  # alternative 0" in source
    _twelve_spellings_written(merged=False)
