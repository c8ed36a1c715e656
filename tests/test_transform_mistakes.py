"""Mistakes a transform can make: each one either works or stops the pass with an error naming the fix.

Every case registers the README's quick-GELU pattern (``x * sigmoid(1.702 x)``) with a transform that
makes one mistake, runs the pass on a small program holding one instance, and then checks one of two
outcomes:

* the rewrite works: the program is valid and computes what it computed before (reference evaluator);
* the pass raises :class:`PassExecutionError` whose message names the fix, and the program is as it was
  (same text, same op list, every constant the same).
"""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol

from pattern_infra import PassExecutionError, register_generic_pass
from pattern_infra.authoring.clone import clone_program
from pattern_infra.rewriting.blocks import walk_blocks
from pattern_infra.verification.verify import assert_programs_equivalent

N = 4


def _spec() -> list:
    """A fresh input spec per program (coremltools keeps the input variable in the spec it is given)."""
    return [mb.TensorSpec(shape=(N,))]


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),))])
def quick_gelu(x):
    s = mb.mul(x=x, y=1.702, name="scale")
    g = mb.sigmoid(x=s, name="gate")
    return mb.mul(x=x, y=g, name="out")


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),))])
def quick_gelu_shared_scale(x):  # the scale is a tensor: a shared one can be written into
    s = mb.mul(x=x, y=np.full((N,), 1.702, np.float32), name="scale")
    g = mb.sigmoid(x=s, name="gate")
    return mb.mul(x=x, y=g, name="out")


def _gelu(pattern, **kwargs):
    return mb.gelu(x=pattern.root_var, mode="SIGMOID_APPROXIMATION", **kwargs)


# -- programs ------------------------------------------------------------------------------------------


def _then_relu() -> Program:
    """``relu(exp(x)) -> quick GELU -> relu``: the match has a user after it and a root computed before."""

    @mb.program(input_specs=_spec())
    def prog(x):
        r = mb.exp(x=x, name="root")
        y = mb.mul(x=r, y=mb.sigmoid(x=mb.mul(x=r, y=1.702)))
        return mb.relu(x=y, name="after")

    return prog


def _at_output() -> Program:
    """The quick GELU's result is the function's output."""

    @mb.program(input_specs=_spec())
    def prog(x):
        return mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=1.702)), name="result")

    return prog


def _with_bystander() -> Program:
    """An op before the match (``early``) that reads the match's root, and one after it."""

    @mb.program(input_specs=_spec())
    def prog(x):
        early = mb.exp(x=x, name="early")
        y = mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=1.702)))
        return mb.add(x=y, y=early, name="after")

    return prog


def _in_a_branch() -> Program:
    """The quick GELU inside the true branch of a ``cond``, read by an op of that branch."""

    @mb.program(input_specs=_spec())
    def prog(x):
        def true_fn():
            y = mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=1.702)))
            return mb.relu(x=y, name="inner_after")

        def false_fn():
            return mb.relu(x=x)

        flag = mb.greater(x=mb.reduce_sum(x=x, axes=[0]), y=0.0)
        out = mb.cond(pred=flag, _true_fn=true_fn, _false_fn=false_fn)
        return mb.exp(x=out, name="outer_after")

    return prog


def _shared_constant() -> Program:
    """The scale constant is also read by an op outside the match."""

    @mb.program(input_specs=_spec())
    def prog(x):
        c = mb.const(val=np.full((N,), 1.702, np.float32), name="shared_scale")
        y = mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=c)))
        return mb.add(x=y, y=c, name="after")

    return prog


# -- the mistakes --------------------------------------------------------------------------------------


def forgets_replace_output(pattern):
    _gelu(pattern, before_op=pattern.out)


def forgets_before_op(pattern):
    pattern.replace_output(_gelu(pattern, name=pattern.out.outputs[0].name))


def builds_in_the_outer_block(pattern):
    outer = pattern.block.outer_op.enclosing_block
    with outer:  # appended at the end of the function, after the cond that reads it
        new = _gelu(pattern)
    pattern.replace_output(new)


def replaces_with_another_dtype(pattern):
    pattern.replace_output(mb.cast(x=pattern.root_var, dtype="fp16", before_op=pattern.out))


def replaces_with_another_shape(pattern):
    pattern.replace_output(
        mb.reduce_mean(x=pattern.root_var, axes=[0], keep_dims=True, before_op=pattern.out)
    )


def returns_none_when_refusing(pattern):
    if pattern.root_var.rank != 2:
        return None  # meant False
    pattern.replace_output(_gelu(pattern, before_op=pattern.out))


def removes_ops_by_hand(pattern):
    pattern.replace_output(_gelu(pattern, before_op=pattern.out, name=pattern.out.outputs[0].name))
    pattern.block.remove_ops([pattern.out, pattern.gate, pattern.scale])


def renames_the_block_output(pattern):
    new = _gelu(pattern, before_op=pattern.out, name="renamed")
    pattern.block.set_outputs([new])


def drops_the_block_output(pattern):
    pattern.replace_output(_gelu(pattern, before_op=pattern.out))
    pattern.block.set_outputs([])


def raises_midway(pattern):
    pattern.replace_output(_gelu(pattern, before_op=pattern.out))
    raise RuntimeError("the transform's own bug")


def writes_into_a_shared_constant(pattern):
    pattern.consts["scale.y"].val[...] = 2.0
    pattern.replace_output(_gelu(pattern, before_op=pattern.out))


def rewires_an_op_before_the_match(pattern):
    new = _gelu(pattern, before_op=pattern.out)
    pattern.replace_output(new)
    early = pattern.root_var.child_ops[0]  # `early` reads x; make it read the GELU, built after it
    early.enclosing_block.replace_uses_of_var_after_op(
        anchor_op=None, end_op=early, old_var=pattern.root_var, new_var=new, no_check_var_types=True
    )


def creates_a_cycle(pattern):
    new = _gelu(pattern, before_op=pattern.out)
    pattern.replace_output(new)
    root = pattern.root_var.op  # exp(x): make it read the GELU that reads it
    root.enclosing_block.replace_uses_of_var_after_op(
        anchor_op=None, end_op=root, old_var=root.x, new_var=new, no_check_var_types=True
    )


def leaves_an_op_dangling(pattern):
    _gelu(pattern, before_op=pattern.out, name="spare")
    pattern.replace_output(_gelu(pattern, before_op=pattern.out))


def inserts_before_the_root(pattern):
    pattern.replace_output(_gelu(pattern, before_op=pattern.root_var.op))


def returns_false_after_changing(pattern):
    _gelu(pattern, before_op=pattern.out)
    return False


def forgets_before_op_at_the_output(pattern):  # appended last, but nothing after it reads it: fine
    pattern.replace_output(_gelu(pattern))


WORKS = "works"

CASES = [
    # (transform, program, pattern, what to expect: WORKS or a regex of the message naming the fix)
    (
        forgets_replace_output,
        _then_relu,
        quick_gelu,
        r"built \[gelu_\d+\] but nothing uses them.*replace_output",
    ),
    (forgets_before_op, _then_relu, quick_gelu, r"left after reading .* computed after it.*before_op="),
    (builds_in_the_outer_block, _in_a_branch, quick_gelu, r"left inner_after reading .*before_op="),
    (replaces_with_another_dtype, _then_relu, quick_gelu, r"fp16.*fp32.*same shape and dtype.*mb\.cast"),
    (replaces_with_another_shape, _then_relu, quick_gelu, r"\(1,\).*\(4,\).*same shape and dtype"),
    (returns_none_when_refusing, _then_relu, quick_gelu, r"returned None without changing.*return False"),
    (removes_ops_by_hand, _then_relu, quick_gelu, WORKS),
    (
        renames_the_block_output,
        _at_output,
        quick_gelu,
        r"outputs of .* \[result\] to \[renamed\].*replace_output",
    ),
    (drops_the_block_output, _at_output, quick_gelu, r"outputs of .* \[result\] to \[\].*replace_output"),
    (raises_midway, _then_relu, quick_gelu, r"raised RuntimeError: the transform's own bug"),
    (
        writes_into_a_shared_constant,
        _shared_constant,
        quick_gelu_shared_scale,
        r"wrote into a constant.*mb\.const",
    ),
    (
        rewires_an_op_before_the_match,
        _with_bystander,
        quick_gelu,
        r"left early reading .* computed after it.*before_op=",
    ),
    (creates_a_cycle, _then_relu, quick_gelu, r"left root reading .* computed after it"),
    (leaves_an_op_dangling, _then_relu, quick_gelu, r"built \[spare\] but nothing uses them.*replace_output"),
    (
        inserts_before_the_root,
        _then_relu,
        quick_gelu,
        r"reading root, which is computed after it.*before_op=",
    ),
    (returns_false_after_changing, _then_relu, quick_gelu, r"returned False \(declined\) after changing"),
    (forgets_before_op_at_the_output, _at_output, quick_gelu, WORKS),
]


def _state(prog: Program) -> tuple[str, list[tuple[str, str]], list[np.ndarray]]:
    """The program's text, its op list and the values of its constants (copied)."""
    ops = [op for _, ops in walk_blocks(prog) for op in ops]
    consts = [np.array(op.outputs[0].val, copy=True) for op in ops if op.op_type == "const"]
    return str(prog), [(op.name, op.op_type) for op in ops], consts


@pytest.mark.parametrize(
    ("transform", "build", "pattern", "expected"), CASES, ids=[c[0].__name__ for c in CASES]
)
def test_a_transform_mistake_works_or_names_the_fix(namespace, transform, build, pattern, expected):
    container = register_generic_pass(pattern, None, transform, "mistake", namespace, constants="value")
    prog = build()
    reference = clone_program(prog)
    text, ops, consts = _state(prog)
    if expected == WORKS:
        container(prog)
        assert container.stats.rewrites == 1
        prog.validate()
        assert "gelu" in [op for _, op in _state(prog)[1]]
        assert_programs_equivalent(reference, prog, rtol=1e-5, atol=1e-6)
        return
    with pytest.raises(PassExecutionError, match=expected) as info:
        container(prog)
    assert "\n" not in str(info.value)
    after_text, after_ops, after_consts = _state(prog)
    assert after_text == text and after_ops == ops
    assert all(np.array_equal(a, b) for a, b in zip(consts, after_consts, strict=True))
    prog.validate()


def test_the_readme_quick_gelu_without_replace_output_is_an_error_naming_it(namespace):
    """README section 3: a transform that builds the ``gelu`` but never calls ``replace_output``."""

    def transform(pattern):
        mb.gelu(
            x=pattern.root_var,
            mode="SIGMOID_APPROXIMATION",
            name=pattern.out.outputs[0].name,
            before_op=pattern.out,
        )

    container = register_generic_pass(
        quick_gelu, None, transform, "fuse_quick_gelu", namespace, constants="value"
    )
    prog = _then_relu()
    before = str(prog)
    with pytest.raises(PassExecutionError, match="replace_output"):
        container(prog)
    assert str(prog) == before


def test_a_forgotten_replace_output_whose_op_the_pattern_has_is_not_a_fixpoint_error(namespace):
    """A transform building ops of the pattern's types without using them (the new ``mul`` reads a new
    constant, which counted as a use) was retried until the fixpoint cap, whose advice (the replacement
    re-creates the pattern) was wrong."""

    def transform(pattern):
        mb.sigmoid(x=mb.mul(x=pattern.root_var, y=1.702, before_op=pattern.out), before_op=pattern.out)

    container = register_generic_pass(quick_gelu, None, transform, "p", namespace, constants="value")
    prog = _then_relu()
    with pytest.raises(PassExecutionError, match="nothing uses them.*replace_output"):
        container(prog)


def test_a_shared_constant_stays_writable_after_the_pass(namespace):
    """Constants are read-only only while a transform runs."""

    def fuses(pattern):
        pattern.replace_output(_gelu(pattern, before_op=pattern.out))

    container = register_generic_pass(quick_gelu_shared_scale, None, fuses, "p", namespace)
    prog = _shared_constant()
    container(prog)
    (const,) = [op for op in prog.functions["main"].operations if op.name == "shared_scale"]
    assert const.outputs[0].val.flags.writeable
