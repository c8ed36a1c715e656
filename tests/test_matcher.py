"""The matching rules of the core issue, each with positive and negative cases."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

from pattern_infra import (
    Matcher,
    Pattern,
    PatternDefinitionError,
    compile_pattern,
    detect_pattern,
    find_matches,
    lists_op_equality,
    pattern_detected,
)
from pattern_infra.testing.passes import relu_exp

S = (2, 3)


def spec(*shapes):
    return [mb.TensorSpec(shape=s) for s in (shapes or (S,))]


@mb.program(input_specs=spec())
def add_to_root(x):
    r = mb.relu(x=x, name="r")
    return mb.add(x=r, y=x, name="a")


@mb.program(input_specs=spec())
def sub_to_root(x):
    r = mb.relu(x=x, name="r")
    return mb.sub(x=r, y=x, name="s")


def names(matches):
    return [sorted(op.name for op in m.op_list()) for m in matches]


def test_chain_matches_once_per_occurrence():
    @mb.program(input_specs=spec())
    def prog(x):
        a = mb.exp(x=mb.relu(x=x, name="r1"), name="e1")
        b = mb.exp(x=mb.relu(x=a, name="r2"), name="e2")
        return mb.sin(x=b, name="out")

    found = list(find_matches(relu_exp, prog))
    assert names(found) == [["e1", "r1"], ["e2", "r2"]]
    assert [m.r.name for m in found] == ["r1", "r2"]
    assert found[0].root_var.name == "x" and found[1].root_var.name == "e1"


def test_op_type_must_match():
    @mb.program(input_specs=spec())
    def prog(x):
        return mb.exp(x=mb.tanh(x=x, name="t"), name="e")

    assert list(find_matches(relu_exp, prog)) == []


def test_number_of_outputs_must_match():
    @mb.program(input_specs=spec((4, 2)))
    def pat(x):
        a, b = mb.split(x=x, num_splits=2, axis=0, name="sp")
        return mb.add(x=a, y=b, name="ad")

    @mb.program(input_specs=spec((6, 2)))
    def prog(x):
        a, b, c = mb.split(x=x, num_splits=3, axis=0, name="sp")
        return mb.add(x=a, y=b, name="ad"), c

    @mb.program(input_specs=spec((4, 2)))
    def good(x):
        a, b = mb.split(x=x, num_splits=2, axis=0, name="sp")
        return mb.add(x=a, y=b, name="ad")

    assert list(find_matches(pat, prog)) == []
    assert len(list(find_matches(pat, good))) == 1


def test_distinct_program_ops_for_distinct_pattern_ops():
    # The pattern needs two relus of x; the program has one relu used twice.
    @mb.program(input_specs=spec())
    def pat(x):
        a = mb.relu(x=x, name="ra")
        b = mb.relu(x=x, name="rb")
        return mb.add(x=a, y=b, name="ad")

    @mb.program(input_specs=spec())
    def shared(x):
        a = mb.relu(x=x, name="r")
        return mb.add(x=a, y=a, name="ad")

    @mb.program(input_specs=spec())
    def two(x):
        return mb.add(x=mb.relu(x=x, name="r1"), y=mb.relu(x=x, name="r2"), name="ad")

    assert list(find_matches(pat, shared)) == []
    (m,) = find_matches(pat, two)
    assert {m.ra.name, m.rb.name} == {"r1", "r2"}


@pytest.mark.parametrize("order", ["relu_first", "root_first"])
def test_commutative_operand_order_either_way(order):
    @mb.program(input_specs=spec())
    def prog(x):
        r = mb.relu(x=x, name="r")
        return mb.add(x=r, y=x, name="a") if order == "relu_first" else mb.add(x=x, y=r, name="a")

    (m,) = find_matches(add_to_root, prog)
    assert m.a.name == "a"
    assert m.operand("a", "x") is m.r.outputs[0]
    assert m.operand("a", "y") is m.root_var


def test_non_commutative_operand_order_is_exact():
    @mb.program(input_specs=spec())
    def swapped(x):
        return mb.sub(x=x, y=mb.relu(x=x, name="r"), name="s")

    @mb.program(input_specs=spec())
    def same(x):
        return mb.sub(x=mb.relu(x=x, name="r"), y=x, name="s")

    assert list(find_matches(sub_to_root, swapped)) == []
    assert len(list(find_matches(sub_to_root, same))) == 1


def test_commutativity_can_be_switched_off():
    @mb.program(input_specs=spec())
    def prog(x):
        return mb.add(x=x, y=mb.relu(x=x, name="r"), name="a")

    assert list(find_matches(add_to_root, prog, commutative=False)) == []


def test_edge_must_come_from_the_same_root():
    # add(relu(x), y) with y a different variable is not add(relu(x), x).
    @mb.program(input_specs=spec(S, S))
    def prog(x, y):
        return mb.add(x=mb.relu(x=x, name="r"), y=y, name="a")

    assert list(find_matches(add_to_root, prog)) == []


@pytest.mark.parametrize("extra", ["consumer", "block_output"])
def test_intermediate_used_outside_the_match_blocks_it(extra):
    @mb.program(input_specs=spec())
    def prog(x):
        r = mb.relu(x=x, name="r")
        e = mb.exp(x=r, name="e")
        if extra == "consumer":
            return mb.add(x=e, y=mb.sin(x=r, name="leak"), name="out")
        return e, r

    assert list(find_matches(relu_exp, prog)) == []


def test_final_op_output_may_be_used_anywhere():
    @mb.program(input_specs=spec())
    def prog(x):
        e = mb.exp(x=mb.relu(x=x, name="r"), name="e")
        return mb.add(x=mb.sin(x=e, name="s1"), y=mb.cos(x=e, name="s2"), name="out"), e

    assert len(list(find_matches(relu_exp, prog))) == 1


def test_root_may_have_other_consumers():
    # Pre-norm residual: x feeds the match and a residual add outside it.
    @mb.program(input_specs=spec())
    def prog(x):
        e = mb.exp(x=mb.relu(x=x, name="r"), name="e")
        return mb.add(x=x, y=e, name="residual")

    (m,) = find_matches(relu_exp, prog)
    assert m.root_var.name == "x"


def test_consumer_order_does_not_matter():
    # Pattern: x feeds a relu and a sigmoid, joined by a mul (two paths from one root).
    @mb.program(input_specs=spec())
    def pat(x):
        a = mb.relu(x=x, name="ra")
        b = mb.sigmoid(x=x, name="sg")
        return mb.mul(x=a, y=b, name="m")

    def program(first: str) -> Program:
        @mb.program(input_specs=spec())
        def prog(x):
            decoys = [mb.tanh(x=x) for _ in range(3)] if first == "decoys_first" else []
            if first == "sigmoid":
                b = mb.sigmoid(x=x, name="s")
                a = mb.relu(x=x, name="r")
            else:
                a = mb.relu(x=x, name="r")
                b = mb.sigmoid(x=x, name="s")
            out = mb.mul(x=b, y=a, name="m")
            return [out] + decoys

        return prog

    for first in ("relu", "sigmoid", "decoys_first"):
        (m,) = find_matches(pat, program(first))
        assert (m.ra.name, m.sg.name, m.m.name) == ("r", "s", "m")


def test_many_consumers_of_root_do_not_explode():
    # 12 relus of x, only one of which reaches the exp: the search picks consumers one at a time.
    @mb.program(input_specs=spec())
    def prog(x):
        outs = [mb.relu(x=x, name=f"r{i}") for i in range(12)]
        return outs[:-1] + [mb.exp(x=outs[-1], name="e")]

    matcher = Matcher(compile_pattern(relu_exp))
    block = prog.functions["main"]
    exp_op = next(op for op in block.operations if op.op_type == "exp")
    found = matcher.match_at(exp_op, block, matcher.compiled.by_name["e"])
    assert isinstance(found, Pattern) and found.r.name == "r11"
    assert matcher.stats.bind_attempts == 2


def test_nested_blocks_are_searched():
    @mb.program(input_specs=spec(S, (1,)))
    def prog(x, flag):
        pred = mb.squeeze(x=mb.greater(x=flag, y=0.0))

        def then_branch():
            return mb.exp(x=mb.relu(x=x, name="r_then"), name="e_then")

        def else_branch():
            return mb.exp(x=mb.relu(x=x, name="r_else"), name="e_else")

        return mb.cond(pred=pred, _true_fn=then_branch, _false_fn=else_branch)

    found = list(find_matches(relu_exp, prog))
    assert sorted(m.e.name for m in found) == ["e_else", "e_then"]
    assert all(m.block is not prog.functions["main"] for m in found)


def test_match_never_spans_two_blocks():
    @mb.program(input_specs=spec(S, (1,)))
    def prog(x, flag):
        r = mb.relu(x=x, name="r_outer")

        def then_branch():
            return mb.exp(x=r, name="e_inner")

        def else_branch():
            return mb.sin(x=r)

        return mb.cond(
            pred=mb.squeeze(x=mb.greater(x=flag, y=0.0)), _true_fn=then_branch, _false_fn=else_branch
        )

    assert list(find_matches(relu_exp, prog)) == []


def test_several_roots_and_final_ops():
    @mb.program(input_specs=spec(S, S))
    def pat(q, k):
        s = mb.add(x=q, y=k, name="s")
        d = mb.sub(x=q, y=k, name="d")
        return s, d

    @mb.program(input_specs=spec(S, S))
    def prog(a, b):
        s = mb.add(x=b, y=a, name="plus")
        d = mb.sub(x=a, y=b, name="minus")
        return mb.mul(x=s, y=d, name="out")

    (m,) = find_matches(pat, prog)
    assert [v.name for v in m.root_vars] == ["a", "b"]
    assert [op.name for op in m.final_ops] == ["plus", "minus"]
    assert m.final_op.name == "plus"


def test_root_computed_inside_the_match_is_refused():
    @mb.program(input_specs=spec(S, S))
    def pat(x, y):
        e = mb.exp(x=y, name="e")
        return mb.add(x=e, y=x, name="a")

    @mb.program(input_specs=spec())
    def prog(t):
        e = mb.exp(x=t, name="ex")
        return mb.add(x=e, y=e, name="ad")

    assert list(find_matches(pat, prog)) == []


def test_wildcard_constant_cannot_be_wired_from_inside():
    @mb.program(input_specs=spec())
    def pat(x):
        r = mb.relu(x=x, name="r")
        return mb.mul(x=r, y=2.0, name="m")

    @mb.program(input_specs=spec())
    def inside(x):
        r = mb.relu(x=x, name="r")
        return mb.mul(x=r, y=r, name="m")

    @mb.program(input_specs=spec(S, S))
    def outside(x, w):
        return mb.mul(x=mb.relu(x=x, name="r"), y=w, name="m")

    assert list(find_matches(pat, inside)) == []
    (m,) = find_matches(pat, outside)
    assert m.consts["m.y"].name == "w"


@pytest.mark.parametrize("value,expected", [(2.0, 1), (2.000001, 1), (2.5, 0)])
def test_constant_value_rule(value, expected):
    @mb.program(input_specs=spec())
    def pat(x):
        return mb.mul(x=mb.relu(x=x, name="r"), y=2.0, name="m")

    @mb.program(input_specs=spec())
    def prog(x):
        return mb.mul(x=value, y=mb.relu(x=x, name="r"), name="m")

    assert len(list(find_matches(pat, prog, constants="value"))) == expected
    assert len(list(find_matches(pat, prog))) == 1  # default: any value


def test_constant_rule_const_requires_compile_time_value():
    @mb.program(input_specs=spec())
    def pat(x):
        return mb.mul(x=mb.relu(x=x, name="r"), y=2.0, name="m")

    @mb.program(input_specs=spec(S, S))
    def prog(x, w):
        return mb.mul(x=mb.relu(x=x, name="r"), y=w, name="m")

    assert list(find_matches(pat, prog, const_rules={"m.y": "const"})) == []


def test_pattern_api():
    @mb.program(input_specs=spec())
    def prog(x):
        e = mb.exp(x=mb.relu(x=x, name="r"), name="e")
        return mb.sin(x=e, name="s")

    (m,) = find_matches(relu_exp, prog)
    assert [op.name for op in m.op_list()] == ["r", "e"]
    assert m.op_set == {m.r, m.e}
    assert m.final_op is m.e and m.block is prog.functions["main"]
    m.add_attribute("note", 3)
    assert m.note == 3
    for bad in ("r", "root_var", "op_list", "final_op"):
        with pytest.raises(NameError, match=bad):
            m.add_attribute(bad, 1)


@pytest.mark.parametrize(
    "build,rule",
    [
        ("duplicate", "two ops are named"),
        ("two_last", "more than one last op"),
        ("no_op", "no op other than constants"),
        ("reserved", "reserved"),
        ("unused_input", "used by no op"),
        ("apart", "falls apart"),
    ],
)
def test_bad_patterns_are_refused_with_the_rule(build, rule):
    if build == "duplicate":

        @mb.program(input_specs=spec())
        def pat(x):
            return mb.relu(x=mb.relu(x=x, name="r"), name="r")

    elif build == "two_last":

        @mb.program(input_specs=spec())
        def pat(x):
            r = mb.relu(x=x, name="r")
            mb.exp(x=r, name="dangling")
            return mb.sin(x=r, name="s")

    elif build == "no_op":

        @mb.program(input_specs=spec())
        def pat(x):
            return mb.const(val=np.zeros(S, np.float32), name="c")

    elif build == "reserved":

        @mb.program(input_specs=spec())
        def pat(x):
            return mb.relu(x=x, name="root_var")

    elif build == "unused_input":

        @mb.program(input_specs=spec(S, S))
        def pat(x, y):
            return mb.relu(x=x, name="r")

    else:

        @mb.program(input_specs=spec(S, S))
        def pat(x, y):
            return mb.relu(x=x, name="a"), mb.relu(x=y, name="b")

    with pytest.raises(PatternDefinitionError, match=rule) as info:
        compile_pattern(pat, name="my_pattern")
    assert "my_pattern" in str(info.value)


@pytest.mark.parametrize("name", ["root_var", "op_list", "output_vars", "replacements", "ops"])
def test_an_op_named_like_any_public_attribute_of_pattern_is_refused(name):
    """``pattern.<op name>`` would hide a method, property or field of Pattern: every one is reserved,
    those added after the list was written (``output_vars``, ``replacements``) too."""

    @mb.program(input_specs=spec())
    def pat(x):
        return mb.relu(x=x, name=name)

    with pytest.raises(PatternDefinitionError, match=f"op name '{name}' is reserved"):
        compile_pattern(pat, name="my_pattern")


def test_design_document_helpers():
    @mb.program(input_specs=spec())
    def prog(x):
        return mb.add(x=x, y=mb.relu(x=x, name="r"), name="a")

    block = prog.functions["main"]
    relu_op = next(op for op in block.operations if op.op_type == "relu")
    pattern_block = add_to_root.functions["main"]
    pattern_root = pattern_block.inputs["x"]
    ok, found = detect_pattern(relu_op, pattern_root, block)
    assert ok and found.a.name == "a"

    filled = Pattern()
    pattern_relu = next(op for op in pattern_block.operations if op.op_type == "relu")
    assert pattern_detected(filled, relu_op, pattern_relu, block.inputs["x"], pattern_root, block)
    assert filled.r is relu_op and filled.root_var is block.inputs["x"] and filled.final_op.name == "a"

    wrong_root = Pattern()
    other = mb.program(input_specs=spec())(lambda x: mb.relu(x=x))
    assert not pattern_detected(
        wrong_root, relu_op, pattern_relu, other.functions["main"].inputs["x"], pattern_root, block
    )
    ops = list(block.operations)
    assert lists_op_equality(ops, ops) and not lists_op_equality(ops, ops[::-1])
    assert not lists_op_equality(ops, ops[:-1])


def test_types_of_roots_are_free():
    # A pattern written for fp32 matches an int32 program: patterns describe structure, not dtypes.
    @mb.program(input_specs=[mb.TensorSpec(shape=S, dtype=types.int32)])
    def prog(x):
        return mb.exp(x=mb.relu(x=mb.cast(x=x, dtype="fp32"), name="r"), name="e")

    assert len(list(find_matches(relu_exp, prog))) == 1


def test_list_operands_such_as_concat_values_match_by_position():
    # coremltools stores concat's `values` as a list: each position is a pattern edge of its own.

    @mb.program(input_specs=spec(S, S))
    def cat_relu(a, b):
        return mb.relu(x=mb.concat(values=[a, mb.exp(x=b, name="e")], axis=0, name="c"), name="r")

    @mb.program(input_specs=spec(S, S))
    def prog(a, b):
        e = mb.exp(x=b)
        fits = mb.relu(x=mb.concat(values=[a, e], axis=0), name="fits")
        swapped = mb.relu(x=mb.concat(values=[mb.exp(x=a), b], axis=0), name="swapped")
        three = mb.relu(x=mb.concat(values=[a, mb.exp(x=b), a], axis=0), name="three")
        return fits, swapped, three

    assert [m.final_op.name for m in find_matches(cat_relu, prog)] == ["fits"]
