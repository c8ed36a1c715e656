"""Alternatives, fan-out, predicates, match-only search, declarative replacement, explain, statistics."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra import (
    PassExecutionError,
    PatternDefinitionError,
    explain,
    find_matches,
    register_generic_pass,
    replace_with,
    run_log,
)
from pattern_infra import (
    predicates as P,
)
from pattern_infra.testing.passes import op_types

S = (2, 3)


def one_input(fn):
    return mb.program(input_specs=[mb.TensorSpec(shape=S)])(fn)


@one_input
def relu_then_add_or_sub(x):
    r = mb.relu(x=x, name="r")
    return mb.add(x=r, y=1.0, name="add_or_sub")


@pytest.mark.parametrize("op", ["add", "sub"])
def test_alternatives_accept_each_listed_type(op):
    @one_input
    def prog(x):
        return getattr(mb, op)(x=mb.relu(x=x), y=1.0)

    found = list(find_matches(relu_then_add_or_sub, prog, alternatives={"add_or_sub": ["add", "sub"]}))
    assert [m.add_or_sub.op_type for m in found] == [op]
    assert op == "add" or list(find_matches(relu_then_add_or_sub, prog)) == []


def test_alternatives_must_include_the_pattern_op_and_name_real_ops():
    with pytest.raises(PatternDefinitionError, match="include it"):
        list(find_matches(relu_then_add_or_sub, relu_then_add_or_sub, alternatives={"add_or_sub": ["sub"]}))
    with pytest.raises(PatternDefinitionError, match="does not have"):
        list(find_matches(relu_then_add_or_sub, relu_then_add_or_sub, alternatives={"nope": ["sub"]}))


def test_alternative_sub_patterns_are_one_registration(namespace):
    @one_input
    def exp_form(x):
        return mb.exp(x=mb.relu(x=x, name="r"), name="last")

    @one_input
    def sin_form(x):
        return mb.sin(x=mb.relu(x=x, name="r"), name="last")

    names = []

    def to_tanh(p):
        names.append(p.pattern_name)
        p.replace_output(mb.tanh(x=p.root_var, before_op=p.last))

    c = register_generic_pass([exp_form, sin_form], None, to_tanh, "p", namespace, name="either")
    assert c.order == ["either"]  # one sub-pass, one plan tree per anchor for both programs
    assert [v.compiled.name for v in c.passes[0].compiled.variants] == ["either[0]", "either[1]"]

    @one_input
    def prog(x):
        return mb.sin(x=mb.relu(x=mb.exp(x=mb.relu(x=x))))

    c(prog)
    assert op_types(prog) == ["tanh", "tanh"]
    assert names == ["either[0]", "either[1]"]


def two_inputs(fn):
    return mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])(fn)


@two_inputs
def scaled_sum(a, b):  # inputs (a, b), last op "out"
    return mb.mul(x=mb.add(x=a, y=b, name="total"), y=2.0, name="out")


@one_input
def doubled(b):  # one input, named like the second of scaled_sum; last op "total"
    return mb.exp(x=mb.add(x=b, y=b, name="total"), name="e")


def test_programs_of_a_list_differ_in_inputs_and_last_ops(namespace):
    """Each spelling reads its own program's inputs (shared with the others by name) and ends where its
    program ends; the search starts from the op name they share."""
    seen = []

    def record(p):
        seen.append((p.pattern_name, [v.name for v in p.root_vars], [op.name for op in p.final_ops]))
        return False

    programs = {"sum": scaled_sum, "double": doubled}
    c = register_generic_pass(programs, None, record, "p", namespace, commutative=False)
    assert c.passes[0].compiled.root_names == ["a", "b"]
    assert [a.name for a in c.passes[0].matcher.nodes] == ["total"]

    @two_inputs
    def prog(x, y):
        s = mb.mul(x=mb.add(x=x, y=y, name="s"), y=2.0, name="s2")
        return mb.exp(x=mb.add(x=s, y=s, name="d"), name="d2")

    c(prog)
    assert seen == [("sum", ["x", "y"], ["s2"]), ("double", ["s2"], ["d2"])]


def test_an_earlier_program_of_a_list_wins_where_both_match(namespace):
    @one_input
    def longer(x):
        return mb.exp(x=mb.relu(x=mb.sin(x=x, name="s"), name="r"), name="e")

    @one_input
    def shorter(x):
        return mb.exp(x=mb.relu(x=x, name="r"), name="e")

    def to_tanh(p):
        p.replace_output(mb.tanh(x=p.root_var, name=p.pattern_name, before_op=p.e))

    for order, want in (([longer, shorter], ["tanh"]), ([shorter, longer], ["sin", "tanh"])):
        c = register_generic_pass(order, None, to_tanh, f"p{len(want)}", namespace)

        @one_input
        def prog(x):
            return mb.exp(x=mb.relu(x=mb.sin(x=x)))

        c(prog)
        assert op_types(prog) == want


def test_programs_of_a_list_need_an_op_name_in_common(namespace):
    @one_input
    def other(x):
        return mb.exp(x=mb.relu(x=x, name="r2"), name="e2")

    with pytest.raises(
        PatternDefinitionError, match="no op name in common.*Name the ops that correspond alike"
    ):
        register_generic_pass([relu_then_add_or_sub, other], None, lambda p: None, "p", namespace)
    assert f"{namespace}::p" not in PASS_REGISTRY


def test_an_option_of_a_list_names_an_op_or_constant_of_one_of_its_programs(namespace):
    c = register_generic_pass(
        [scaled_sum, doubled], None, lambda p: False, "p", namespace, const_rules={"out.y": "value"}
    )
    assert len(c.passes) == 1
    with pytest.raises(PatternDefinitionError, match="const_rules name"):
        register_generic_pass(
            [scaled_sum, doubled], None, lambda p: None, "q", namespace, const_rules={"e.y": "const"}
        )


@one_input
def quant_fanout(x):
    q = mb.relu(x=x, name="q")
    return mb.exp(x=q, name="dq")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fanout_captures_every_consumer(n):
    @one_input
    def prog(x):
        q = mb.relu(x=x, name="q")
        return [mb.exp(x=q, name=f"d{i}") for i in range(n)]

    (m,) = find_matches(quant_fanout, prog, fanout=["dq"])
    assert [op.name for op in m.dq] == [f"d{i}" for i in range(n)]
    assert [op.name for op in m.final_ops] == [f"d{i}" for i in range(n)]
    assert [op.name for op in m.op_list()] == ["q"] + [f"d{i}" for i in range(n)]


def test_fanout_needs_every_consumer_of_the_kind():
    @one_input
    def prog(x):
        q = mb.relu(x=x, name="q")
        return mb.exp(x=q), mb.sin(x=q)

    assert list(find_matches(quant_fanout, prog, fanout=["dq"])) == []


def test_fanout_must_be_a_last_op():
    with pytest.raises(PatternDefinitionError, match="must be a last op"):
        list(find_matches(quant_fanout, quant_fanout, fanout=["q"]))


def test_predicates():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 4, 5)), mb.TensorSpec(shape=(get_new_symbol(), 5))])
    def prog(x, y):
        r = mb.reduce_mean(x=x, axes=[-1, 1], keep_dims=True, name="m")
        s = mb.mul(x=r, y=0.5, name="h")
        return mb.add(x=s, y=1.0, name="a"), mb.relu(x=y, name="ry")

    ops = {op.name: op for op in prog.functions["main"].operations}
    half = ops["h"].y
    assert P.is_constant(half) and not P.is_constant(ops["h"].x)
    assert P.scalar_close_to(half, 0.5) and not P.scalar_close_to(half, 0.6)
    assert P.has_one_consumer(ops["m"].outputs[0]) and not P.has_consumers(ops["m"].outputs[0], 2)
    assert P.rank_is(ops["m"].x, 4) and not P.rank_is(ops["m"].x, 3)
    assert P.dtype_is(ops["m"].x, "fp32") and not P.dtype_is(ops["m"].x, "fp16")
    assert P.shape_known(ops["m"].x) and not P.shape_known(ops["ry"].x)
    assert P.broadcastable(ops["m"].outputs[0], ops["m"].x)
    assert not P.broadcastable(ops["m"].x, ops["ry"].x)
    assert P.axes_are(ops["m"].axes, 4, [1, 3]) and not P.axes_are(ops["m"].axes, 4, [3])
    assert not P.not_block_output([ops["a"]]) and P.not_block_output([ops["m"]])
    assert not P.is_constexpr(half)


def test_find_matches_is_lazy_and_read_only():
    @one_input
    def prog(x):
        for _ in range(3):
            x = mb.add(x=mb.relu(x=x), y=1.0)
        return x

    before = str(prog)
    gen = find_matches(relu_then_add_or_sub, prog)
    first = next(gen)
    assert first.r.name == "relu_0" if "relu_0" in before else True
    assert len(list(gen)) == 2 and str(prog) == before


def test_find_matches_with_constraints():
    @one_input
    def prog(x):
        return mb.add(x=mb.relu(x=mb.add(x=mb.relu(x=x), y=1.0)), y=2.0)

    found = list(
        find_matches(
            relu_then_add_or_sub, prog, lambda p: P.scalar_close_to(p.operand("add_or_sub", "y"), 2.0)
        )
    )
    assert len(found) == 1


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))])
def softplus_replacement(x):
    return mb.softplus(x=x)


@one_input
def relu_exp(x):
    return mb.exp(x=mb.relu(x=x, name="r"), name="e")


def test_declarative_replacement_keeps_names(namespace):
    register_generic_pass(relu_exp, None, replace_with(softplus_replacement), "p", namespace)

    @one_input
    def prog(x):
        y = mb.exp(x=mb.relu(x=x), name="keep_me")
        return mb.sin(x=y)

    PASS_REGISTRY[f"{namespace}::p"](prog)
    ops = [op for op in prog.functions["main"].operations if op.op_type != "const"]
    assert [(op.op_type, op.name) for op in ops][0] == ("softplus", "keep_me")
    assert op_types(prog) == ["softplus", "sin"]


def test_declarative_replacement_with_bound_operand(namespace):
    @one_input
    def scale_pattern(x):
        return mb.mul(x=mb.relu(x=x, name="r"), y=3.0, name="m")

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=(1,))])
    def scale_first(x, s):
        return mb.relu(x=mb.mul(x=x, y=s))

    register_generic_pass(
        scale_pattern,
        lambda p: P.is_constant(p.operand("m", "y")),
        replace_with(scale_first, bind={"s": "m.y"}),
        "p",
        namespace,
    )

    @one_input
    def prog(x):
        return mb.mul(x=2.0, y=mb.relu(x=x))

    PASS_REGISTRY[f"{namespace}::p"](prog)
    assert op_types(prog) == ["mul", "relu"]
    mul = next(op for op in prog.functions["main"].operations if op.op_type == "mul")
    assert float(mul.y.val) == 2.0


def test_declarative_replacement_errors():
    with pytest.raises(PatternDefinitionError, match="not inputs of the replacement"):
        replace_with(softplus_replacement, bind={"nope": "x"})
    with pytest.raises(PatternDefinitionError, match="@mb.program"):
        replace_with(lambda x: x)


def _explain_reasons(prog, **kw):
    return [m.reason for m in explain(relu_exp, prog, top=10, **kw).near_misses]


def test_explain_reports_type_mismatch_and_extra_consumer():
    @one_input
    def prog(x):
        r = mb.relu(x=x, name="rr")
        return mb.exp(x=r, name="ee"), mb.sin(x=r)

    text = str(explain(relu_exp, prog))
    assert "0 full match" in text and "extra consumer of intermediate rr" in text

    @one_input
    def other(x):
        return mb.exp(x=mb.tanh(x=x, name="t"), name="ee")

    reasons = _explain_reasons(other)
    assert any("op type differs at r: pattern wants relu, program has tanh" in r for r in reasons)


def test_explain_reports_slot_constant_constraint_and_declined():
    @one_input
    def swapped(x):
        return mb.sub(x=x, y=mb.relu(x=x, name="r"), name="s")

    @one_input
    def sub_pat(x):
        return mb.sub(x=mb.relu(x=x, name="r"), y=x, name="s")

    assert any("operand slot differs" in m.reason for m in explain(sub_pat, swapped, top=10).near_misses)

    @one_input
    def scaled(x):
        return mb.mul(x=mb.relu(x=x, name="r"), y=3.0, name="m")

    @one_input
    def prog(x):
        return mb.mul(x=mb.relu(x=x), y=4.0)

    misses = explain(scaled, prog, constants="value").near_misses
    assert any("constant differs" in m.reason and "4.0" in m.reason for m in misses)

    @one_input
    def ok(x):
        return mb.exp(x=mb.relu(x=x))

    assert explain(relu_exp, ok).matches
    assert "constraint returned False" in _explain_reasons(ok, var_constraints=lambda p: False)
    assert "transform declined" in _explain_reasons(ok, transform_pattern=lambda p: False)
    before = str(ok)
    assert len(explain(relu_exp, ok, transform_pattern=lambda p: None).matches) == 1
    assert str(ok) == before


def test_statistics_and_run_log(namespace):
    c = register_generic_pass(
        relu_exp, lambda p: p.e.name != "skip", replace_with(softplus_replacement), "p", namespace
    )

    @one_input
    def prog(x):
        a = mb.exp(x=mb.relu(x=x), name="skip")
        return mb.exp(x=mb.relu(x=a))

    run_log(clear=True)
    copied = copy.deepcopy(prog)
    started = time.perf_counter()
    c(copied)
    elapsed = time.perf_counter() - started
    s = c.stats
    # the rejected match sits next to the rewrite, so the second round looks at it again
    assert (s.runs, s.rewrites, s.declined) == (1, 1, 0) and s.rejected >= 1
    assert s.matches == s.rewrites + s.rejected
    assert s.attempts >= 2 and 0 < s.seconds <= elapsed  # the pass's own time, within the call's
    (entry,) = run_log()
    assert entry[0] == f"{namespace}::p" and entry[2].rewrites == 1
    np.testing.assert_equal(len(run_log(clear=True)), 1)
    assert run_log() == []


@one_input
def scale_by_two(x):
    return mb.relu(x=mb.mul(x=x, y=2.0, name="m"), name="r")


def test_commutative_order_puts_constants_in_constant_slots():
    @one_input
    def prog(x):
        return mb.relu(x=mb.mul(x=3.0, y=x))

    (m,) = find_matches(scale_by_two, prog)
    assert m.root_var.name == "x" and P.is_constant(m.operand("m", "y"))


def test_an_alternative_type_does_not_inherit_commutativity():
    @one_input
    def prog(x):
        return mb.relu(x=mb.real_div(x=2.0, y=x))

    @one_input
    def in_order(x):
        return mb.relu(x=mb.real_div(x=x, y=2.0))

    options = {"alternatives": {"m": ["mul", "real_div"]}, "constants": "const"}
    assert list(find_matches(scale_by_two, prog, **options)) == []
    assert len(list(find_matches(scale_by_two, in_order, **options))) == 1
    # named explicitly, both orders are tried whatever type matched; the transform reads the sides
    (m,) = find_matches(scale_by_two, prog, commutative=["m"], **options)
    assert m.operand("m", "y").val is not None and m.m.x.val is not None  # sides reversed


def test_alternatives_may_lack_a_wildcard_constant_slot():
    @one_input
    def flatten(x):
        return mb.exp(x=mb.reshape(x=mb.relu(x=x, name="r"), shape=[6], name="rs"), name="e")

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 6))])
    def prog(x):
        return mb.exp(x=mb.squeeze(x=mb.relu(x=x), axes=[0]))

    (m,) = find_matches(flatten, prog, alternatives={"rs": ["reshape", "squeeze"]})
    assert m.rs.op_type == "squeeze" and "rs.shape" not in m.consts
    with pytest.raises(KeyError):
        m.operand("rs", "shape")


def _builds_nothing(pattern):
    return None


def _forgets_replace_output(pattern):
    mb.softplus(x=pattern.root_var, before_op=pattern.final_op, name="built")


@pytest.mark.parametrize(
    "transform, message",
    [
        (_builds_nothing, r"returned None without changing the program.*replace_output"),
        (_forgets_replace_output, r"built \[built\] but nothing uses them.*replace_output"),
    ],
    ids=["changes nothing", "forgets replace_output"],
)
def test_a_transform_that_rewrites_nothing_is_named_with_the_fix_not_a_fixpoint(
    namespace, transform, message
):
    calls = []
    c = register_generic_pass(relu_exp, None, lambda p: calls.append(p) or transform(p), "p", namespace)

    @one_input
    def prog(x):
        return mb.exp(x=mb.relu(x=x))

    before = str(prog)
    with pytest.raises(PassExecutionError, match=message):
        c(prog)
    assert str(prog) == before and len(calls) == 1


def test_a_transform_that_returns_false_declines(namespace):
    c = register_generic_pass(relu_exp, None, lambda p: False, "p", namespace)

    @one_input
    def prog(x):
        return mb.exp(x=mb.relu(x=x))

    before = str(prog)
    c(prog)
    assert str(prog) == before
    assert (c.stats.rewrites, c.stats.declined) == (0, 1)


def test_explain_runs_the_transform_on_every_alternative_anchor_type():
    # the anchor (the last op) is add or sub: explain must try the transform on matches of both types
    @one_input
    def prog(x):
        return mb.add(x=mb.relu(x=x), y=1.0), mb.sub(x=mb.relu(x=x), y=1.0)

    report = explain(
        relu_then_add_or_sub,
        prog,
        transform_pattern=lambda p: False,
        alternatives={"add_or_sub": ["add", "sub"]},
        top=10,
    )
    declined = [m for m in report.near_misses if m.reason == "transform declined"]
    assert sorted(m.ops["add_or_sub"].split("_")[0] for m in declined) == ["add", "sub"]


def test_pass_options_are_readable_before_any_pipeline(namespace):
    c = register_generic_pass(relu_exp, None, replace_with(softplus_replacement), "p", namespace)
    assert c.options == {}
