"""Every match the README's rules allow is found, and a pass ends at a fixpoint (issue #12).

Each test here failed before the mechanism it names was fixed.
"""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from pattern_infra import PassExecutionError, find_matches, register_generic_pass
from pattern_infra.testing.passes import op_types

S = (2, 3)


def _names(match) -> dict[str, str]:
    return {name: op.name for name, op in match.ops.items()}


# -- 1. commutativity follows the matched program op, not the op written in the pattern ----------------


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def relu_then_sub(x0):
    p0 = mb.relu(x=x0, name="p0")
    return mb.sub(x=p0, y=2.0, name="p1")


@pytest.mark.parametrize("const_first", [True, False], ids=["add(2, relu)", "add(relu, 2)"])
def test_an_alternative_commutative_type_matches_either_operand_order(const_first):
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(a0):
        o0 = mb.relu(x=a0, name="o0")
        return mb.add(x=2.0, y=o0, name="o1") if const_first else mb.add(x=o0, y=2.0, name="o1")

    found = list(find_matches(relu_then_sub, prog, alternatives={"p1": ["sub", "add"]}, constants="value"))
    assert [_names(m) for m in found] == [{"p0": "o0", "p1": "o1"}]
    assert found[0].operand("p1", "y").val == pytest.approx(2.0)


def test_a_non_commutative_alternative_still_matches_only_as_written():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(a0):
        o0 = mb.relu(x=a0, name="o0")
        return mb.sub(x=2.0, y=o0, name="o1")  # 2 - relu: not relu - 2

    assert (
        list(find_matches(relu_then_sub, prog, alternatives={"p1": ["sub", "add"]}, constants="value")) == []
    )


# -- 2. a rewrite in a nested block that frees a match of the outer block --------------------------------


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def sigmoid_mul(x0):
    s = mb.sigmoid(x=x0, name="s")
    return mb.mul(x=s, y=2.0, name="m")


def _to_silu_like(pattern):
    new = mb.softplus(x=pattern.root_var, name=pattern.m.outputs[0].name + "_f", before_op=pattern.m)
    pattern.replace_output(new)


def _nested_program():
    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=S),
            mb.TensorSpec(shape=S),
            mb.TensorSpec(shape=(1,), dtype=types.bool),
        ]
    )
    def prog(a0, a1, flag):
        o0 = mb.sigmoid(x=a0, name="o0")
        o1 = mb.mul(x=o0, y=2.0, name="o1")

        def then_branch():
            i0 = mb.sigmoid(x=a1, name="i0")
            return mb.mul(x=i0, y=o0, name="i1")

        def else_branch():
            return mb.relu(x=a1, name="e0")

        c = mb.cond(pred=mb.squeeze(x=flag), _true_fn=then_branch, _false_fn=else_branch, name="c")
        return mb.add(x=o1, y=c)

    return prog


def test_a_nested_rewrite_that_frees_an_outer_match_is_revisited(namespace):
    container = register_generic_pass(sigmoid_mul, None, _to_silu_like, "f", namespace, constants="any")
    prog = _nested_program()
    container(prog)
    assert container.stats.rewrites == 2
    assert "sigmoid" not in op_types(prog)
    assert list(find_matches(sigmoid_mul, prog, constants="any")) == []
    before = op_types(prog)
    container(prog)  # a fixpoint: a second run changes nothing
    assert op_types(prog) == before and container.stats.rewrites == 2


# -- 3. pattern parts joined only through a shared constant -----------------------------------------------


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def relu_and_log_of_one_input(x0):
    r = mb.relu(x=x0, name="r")
    lg = mb.log(x=x0, name="l")
    return r, lg


def test_a_rewrite_next_to_a_shared_constant_is_revisited_through_it(namespace):
    """Rewriting ``(relu(a), log(a))`` creates ``log(c)``; ``(relu(c), log(c))`` is then a match whose two
    parts meet only at the constant ``c``, which other ops share."""
    offered = []
    shared = {}

    def transform(pattern):
        offered.append(_names(pattern))
        if pattern.root_var.op is not None:
            return False  # the match through the constant: seen, left alone
        new = mb.log(x=shared["c"], name="new_log", before_op=pattern.l)
        pattern.replace_output(new, pattern.l.outputs[0])
        return True

    container = register_generic_pass(relu_and_log_of_one_input, None, transform, "f", namespace)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(a):
        c = mb.const(val=np.full(S, 0.5, dtype=np.float32), name="c")
        shared["c"] = c
        rc = mb.relu(x=c, name="rc")  # waits for a log(c); tried first, before it exists
        others = [mb.log(x=mb.sin(x=a), name=f"other_log{i}") for i in range(3)]  # relu is the rarer type
        ra = mb.relu(x=a, name="ra")
        la = mb.log(x=a, name="la")
        return mb.add(x=mb.add(x=rc, y=ra), y=mb.add(x=la, y=mb.add(x=c, y=others[0])))

    container(prog)
    assert offered[0] == {"r": "ra", "l": "la"}
    assert {"r": "rc", "l": "new_log"} in offered
    assert container.stats.rewrites == 1


# -- 4. a constraint (or a declining transform) is a filter on matches, not on the first match --------------


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def mul_by_constant(x0):
    return mb.mul(x=x0, y=2.0, name="m")


def _roots_are_inputs(pattern) -> bool:
    return all(v.op is None for v in pattern.root_vars)


def _mul_relu_program():
    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=S)])
    def prog(a0, a1):
        return mb.mul(x=mb.relu(x=a0, name="r"), y=a1, name="o")

    return prog


def test_find_matches_offers_the_other_operand_order_when_the_constraint_refuses_the_first():
    found = list(find_matches(mul_by_constant, _mul_relu_program(), _roots_are_inputs, constants="any"))
    assert len(found) == 1
    assert found[0].root_var.name == "a1"


def test_explain_reports_the_match_the_other_operand_order_gives():
    from pattern_infra import explain

    report = explain(mul_by_constant, _mul_relu_program(), _roots_are_inputs, constants="any")
    assert [m.root_var.name for m in report.matches] == ["a1"]


def test_the_pass_offers_the_other_operand_order_when_the_constraint_refuses_the_first(namespace):
    def to_scale(pattern):
        new = mb.add(x=pattern.root_var, y=pattern.root_var, name=pattern.m.name + "_s", before_op=pattern.m)
        pattern.replace_output(new)

    container = register_generic_pass(
        mul_by_constant, _roots_are_inputs, to_scale, "f", namespace, constants="any"
    )
    prog = _mul_relu_program()
    container(prog)
    assert container.stats.rewrites == 1
    (new,) = [op for op in prog.functions["main"].operations if op.name == "o_s"]
    assert new.x.name == "a1"


def test_a_declining_transform_lets_the_search_go_on_at_the_same_anchor(namespace):
    offered = []

    def only_input_roots(pattern):
        offered.append(pattern.root_var.name)
        if pattern.root_var.op is not None:
            return False
        new = mb.add(x=pattern.root_var, y=pattern.root_var, name=pattern.m.name + "_s", before_op=pattern.m)
        pattern.replace_output(new)
        return True

    container = register_generic_pass(
        mul_by_constant, None, only_input_roots, "f", namespace, constants="any"
    )
    container(_mul_relu_program())
    assert offered == ["r", "a1"]
    assert (container.stats.declined, container.stats.rewrites) == (1, 1)


# -- 5. the error after a failing transform names the ops as they are again ----------------------------------


def test_the_error_names_the_ops_as_restored_not_as_the_transform_renamed_them(namespace):
    def rename_then_fail(pattern):
        for op in pattern.op_list():
            op.name = op.name + "_byhand"
        raise ValueError("boom")

    container = register_generic_pass(sigmoid_mul, None, rename_then_fail, "f", namespace, constants="any")

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(a0):
        return mb.mul(x=mb.sigmoid(x=a0, name="o0"), y=2.0, name="o1")

    with pytest.raises(PassExecutionError) as info:
        container(prog)
    message = str(info.value)
    assert "o0 (sigmoid)" in message and "o1 (mul)" in message
    assert "_byhand" not in message


# -- a constraint may say why it refused (issue #15) -------------------------------------------------------


@pytest.mark.parametrize(
    "refusal", [(False, "root is not a graph input"), "root is not a graph input"], ids=["pair", "string"]
)
def test_a_constraints_reason_is_counted_and_explained(namespace, refusal):
    from pattern_infra import explain

    def only_graph_inputs(pattern):
        return True if pattern.root_var.op is None else refusal

    def to_double(pattern):
        new = mb.add(x=pattern.root_var, y=pattern.root_var, name=pattern.m.name + "_s", before_op=pattern.m)
        pattern.replace_output(new)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(a0):
        return mb.mul(x=mb.relu(x=a0, name="r"), y=2.0, name="o")

    container = register_generic_pass(
        mul_by_constant, only_graph_inputs, to_double, "f", namespace, constants="value"
    )
    container(prog)
    reason = "constraint returned False: root is not a graph input"
    assert dict(container.stats.rejections) == {reason: 1} and container.stats.rewrites == 0
    report = explain(mul_by_constant, prog, only_graph_inputs, constants="value")
    assert [m.reason for m in report.near_misses][:1] == [reason]
    assert reason in str(report)


def test_several_passes_in_one_call_each_reach_their_fixpoint_before_the_next(namespace):
    """With ``passes=``, a later pass's rewrite is not revisited by an earlier pass (as pass by pass);
    without it, all sub-passes form one pass and it is."""
    from pattern_infra.language.compiler import compile_pattern
    from pattern_infra.rewriting.driver import run_subpasses
    from pattern_infra.rewriting.subpass import SubPass

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def relu_exp_chain(x0):
        return mb.exp(x=mb.relu(x=x0, name="r"), name="e")

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def sigmoid_only(x0):
        return mb.sigmoid(x=x0, name="s")

    def to_zero(pattern):
        zero = mb.const(
            val=np.zeros(S, dtype=np.float32), name=pattern.final_op.name + "_z", before_op=pattern.final_op
        )
        pattern.replace_output(zero)

    def program():
        @mb.program(input_specs=[mb.TensorSpec(shape=S)])
        def prog(a0):
            r = mb.relu(x=a0, name="r0")
            return mb.exp(x=r, name="e0"), mb.sigmoid(x=r, name="s0")  # s0 keeps relu from the chain

        return prog

    results = []
    for passes in (None, ["first", "second"]):
        subs = [
            SubPass(compile_pattern(relu_exp_chain), None, to_zero),
            SubPass(compile_pattern(sigmoid_only), None, to_zero),
        ]
        prog = program()
        run_subpasses(prog, subs, "two", passes=passes)
        results.append(
            sorted(op.op_type for op in prog.functions["main"].operations if op.op_type != "const")
        )
    assert results == [[], ["exp", "relu"]]
