"""The undo journal: a pass that fails leaves every block, op and variable exactly as it was.

Each test runs a pass whose transform changes the program through coremltools' MIL API, far from the
match as well as in it, and then raises; the program must come back identical, down to every op's
fields, every variable's users and the blocks' outputs (``fingerprint``), not only its printed form.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Operation, Program, Var
from coremltools.converters.mil.mil.scope import ScopeSource

from pattern_infra import PassExecutionError, register_generic_pass
from pattern_infra.rewriting.blocks import walk_blocks
from pattern_infra.rewriting.journal import Journal
from pattern_infra.testing.passes import relu_exp, to_softplus

S = (2, 3)


def program() -> Program:
    """Three relu -> exp copies, a residual add, a cond with a relu -> exp inside, two outputs."""

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        first = mb.sin(x=x, name="first")
        y = first
        for i in range(3):
            y = mb.add(x=mb.exp(x=mb.relu(x=y, name=f"r{i}"), name=f"e{i}"), y=first, name=f"a{i}")
        flag = mb.greater(x=mb.reduce_sum(x=y), y=0.0)
        branch = mb.cond(
            pred=flag,
            _true_fn=lambda: mb.exp(x=mb.relu(x=y, name="inner_r"), name="inner_e"),
            _false_fn=lambda: mb.sin(x=y, name="inner_s"),
            name="branch",
        )
        return branch, mb.cos(x=y, name="last")

    return prog


def _ids(values: Any) -> Any:
    if isinstance(values, dict):
        return {k: _ids(v) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return [_ids(v) for v in values]
    if isinstance(values, set):
        return sorted(id(v) for v in values)
    return id(values) if isinstance(values, (Var, Operation, Block)) else repr(values)


def fingerprint(prog: Program) -> list[Any]:
    """Every block's op list and outputs, every op's fields, every variable's slots, by identity."""
    state: list[Any] = []
    for block, _ in walk_blocks(prog):
        state.append(("block", id(block), [id(op) for op in block.operations], _ids(list(block.outputs))))
        inputs = list(block.inputs.values()) if isinstance(block.inputs, dict) else list(block.inputs)
        for op in [None, *block.operations]:
            if op is not None:
                fields = {k: v for k, v in vars(op).items() if k not in ("_input_types", "_type_domains")}
                state.append(("op", id(op), _ids(fields)))
            for var in op.outputs if op is not None else inputs:
                state.append(
                    (
                        "var",
                        id(var),
                        var.name,
                        repr(var.sym_type),
                        [id(o) for o in var.child_ops],
                        [id(b) for b in var.consuming_blocks],
                        sorted(id(v) for v in var.nonreplaceable_vars_upstream),
                    )
                )
    return state


def op_named(prog: Program, name: str) -> Operation:
    for block, _ in walk_blocks(prog):
        for op in block.operations:
            if op.name == name:
                return op
    raise KeyError(name)


def fails_after(change: Callable[[Any, Program], None], *, on_call: int = 2) -> Callable[[Any], None]:
    """A transform that fuses normally, and on its ``on_call``-th call makes ``change`` then raises."""
    calls = []
    holder: dict[str, Program] = {}

    def transform(pattern):
        calls.append(1)
        to_softplus(pattern)
        if len(calls) == on_call:
            change(pattern, holder["prog"])
            raise RuntimeError("boom")

    transform.holder = holder  # type: ignore[attr-defined]
    return transform


def rename_far_var(pattern, prog):
    op_named(prog, "last").outputs[0].set_name("renamed")


def rewire_far_op(pattern, prog):
    op_named(prog, "last").set_inputs(x=op_named(prog, "first").outputs[0])


def replace_uses_far(pattern, prog):
    block = prog.functions["main"]
    first = op_named(prog, "first").outputs[0]
    other = mb.cos(x=block.inputs["x"], before_op=op_named(prog, "first"))
    block.replace_uses_of_var_after_op(anchor_op=first.op, old_var=first, new_var=other)


def remove_far_op(pattern, prog):
    last = op_named(prog, "last")
    block = prog.functions["main"]
    block.set_outputs([block.outputs[0], last.x])
    block.remove_ops([last])


def insert_ops_everywhere(pattern, prog):
    block = prog.functions["main"]
    for op in list(block.operations)[::3]:
        if op.op_type != "const":
            mb.relu(x=block.inputs["x"], before_op=op)


def change_nested_block(pattern, prog):
    inner = op_named(prog, "inner_s")
    with inner.enclosing_block:
        new = mb.cos(x=inner.x, before_op=inner)
    inner.enclosing_block.set_outputs([new])
    inner.enclosing_block.remove_ops([inner])


def rescope_far_op(pattern, prog):
    op_named(prog, "a1").type_value_inference(overwrite_output=True)
    op_named(prog, "last").outputs[0].scopes = {ScopeSource.COREMLTOOLS_GRAPH_PASS: ["elsewhere"]}


def rename_the_match_by_hand(pattern, prog):
    pattern.r.name = "hand_renamed"  # as coremltools' own passes do: plain attribute writes
    pattern.e.outputs[0].name = "hand_renamed_var"


CHANGES = [
    rename_far_var,
    rewire_far_op,
    replace_uses_far,
    remove_far_op,
    insert_ops_everywhere,
    change_nested_block,
    rescope_far_op,
    rename_the_match_by_hand,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_a_failing_pass_restores_every_object(namespace, change):
    transform = fails_after(change)
    c = register_generic_pass(relu_exp, None, transform, "p", namespace)
    c.validate = False  # the raise, not the validation, triggers the restore here
    prog = program()
    transform.holder["prog"] = prog
    before, text = fingerprint(prog), str(prog)
    with pytest.raises(PassExecutionError, match="restored"):
        c(prog)
    assert str(prog) == text
    assert fingerprint(prog) == before
    # the restored program is usable: a correct pass fuses it
    register_generic_pass(relu_exp, None, to_softplus, "q", namespace)(prog)
    assert [op.op_type for op in prog.functions["main"].operations].count("softplus") == 3


@pytest.mark.parametrize("fail", [False, True], ids=["rewrites", "fails and restores"])
def test_the_hooks_are_gone_once_the_pass_ends(namespace, fail):
    """Every hooked attribute of coremltools' classes is, after the pass, the very object it was before;
    and during the transform it was not (so this check would see a hook left installed)."""
    from pattern_infra.rewriting.journal import _HOOKS

    def attributes() -> dict[tuple[type, str], Any]:
        return {(cls, name): cls.__dict__.get(name) for cls, name, _ in _HOOKS}

    before = attributes()
    during: list[dict[tuple[type, str], Any]] = []

    def transform(pattern):
        during.append(attributes())
        to_softplus(pattern)
        if fail:
            raise RuntimeError("boom")

    c = register_generic_pass(relu_exp, None, transform, "p", namespace)
    if fail:
        with pytest.raises(PassExecutionError):
            c(program())
    else:
        c(program())
    assert during, "the transform never ran: nothing was hooked"
    hooked = [key for key, value in during[0].items() if value is not before[key]]
    assert sorted(f"{cls.__name__}.{name}" for cls, name in hooked) == sorted(
        f"{cls.__name__}.{name}" for cls, name, _ in _HOOKS
    )
    after = attributes()
    left = [
        f"{cls.__name__}.{name}"
        for key, value in after.items()
        if value is not before[key]
        for cls, name in [key]
    ]
    assert left == [], f"hooks left installed: {left}"


def test_other_threads_are_not_journaled():
    mine, theirs = program(), program()
    before_theirs = fingerprint(theirs)
    journal = Journal(dict(walk_blocks(mine)))
    try:

        def edit_theirs():
            op_named(theirs, "first").outputs[0].set_name("theirs_renamed")

        worker = threading.Thread(target=edit_theirs)
        worker.start()
        worker.join()
        op_named(mine, "first").outputs[0].set_name("mine_renamed")
        journal.restore()
    finally:
        journal.close()
    assert op_named(mine, "first").outputs[0].name == "first"
    assert op_named(theirs, "first").outputs[0].name == "theirs_renamed"
    assert fingerprint(theirs) != before_theirs


def test_objects_created_during_the_pass_are_left_alone():
    prog = program()
    block = prog.functions["main"]
    journal = Journal(dict(walk_blocks(prog)))
    try:
        with block:
            new = mb.relu(x=block.inputs["x"], before_op=op_named(prog, "first"), name="new_relu")
        new.set_name("renamed_new")
        journal.restore()
    finally:
        journal.close()
    assert new.name == "renamed_new" and new.op.name == "new_relu"  # untouched, just unreachable
    assert "new_relu" not in [op.name for op in block.operations]
    assert block.inputs["x"].child_ops == [op_named(prog, "first")]


def test_nested_journals_restore_independently():
    prog = program()
    var = op_named(prog, "first").outputs[0]
    outer = Journal(dict(walk_blocks(prog)))
    try:
        var.set_name("a")
        inner = Journal(dict(walk_blocks(prog)))
        try:
            var.set_name("b")
            inner.restore()
            assert var.name == "a"
        finally:
            inner.close()
        outer.restore()
        assert var.name == "first"
    finally:
        outer.close()


def _with_dead_ops() -> Program:
    """``program()`` plus dead ops: a ``sin -> cos`` chain and a ``cond`` (nested blocks), both unused."""

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        mb.cos(x=mb.sin(x=x, name="dead_sin"), name="dead_cos")
        mb.cond(
            pred=mb.greater(x=mb.reduce_sum(x=x), y=0.0, name="dead_pred"),
            _true_fn=lambda: mb.exp(x=x, name="dead_inner_e"),
            _false_fn=lambda: mb.sin(x=x, name="dead_inner_s"),
            name="dead_cond",
        )
        return mb.relu(x=x, name="live")

    return prog


def _structure(prog: Program) -> list[Any]:
    """Every block's op names and outputs, every variable's users by name: by value, not identity."""
    state: list[Any] = []
    for block, _ in walk_blocks(prog):
        state.append(([op.name for op in block.operations], [v.name for v in block.outputs]))
        for op in block.operations:
            for var in op.outputs:
                state.append((var.name, [user.name for user in var.child_ops], len(var.consuming_blocks)))
    state.append(("x", [user.name for user in prog.functions["main"].inputs["x"].child_ops]))
    return state


@pytest.mark.parametrize(
    "names", [["dead_cos", "dead_sin"], ["dead_cond"]], ids=["plain ops", "nested blocks"]
)
def test_dead_ops_are_unlinked_as_block_remove_ops_would(names):
    from pattern_infra.rewriting.removal import unlink

    names_before = dict(mb.name_count)
    by_coremltools = _with_dead_ops()
    mb.name_count.clear()
    mb.name_count.update(names_before)  # the same generated names in both copies
    ours = _with_dead_ops()
    by_coremltools.functions["main"].remove_ops([op_named(by_coremltools, n) for n in names])
    removed = [op_named(ours, n) for n in names]
    block = ours.functions["main"]
    before = fingerprint(ours)
    journal = Journal(dict(walk_blocks(ours)))
    try:
        unlink(block, removed)
        assert _structure(ours) == _structure(by_coremltools)
        assert all(op.enclosing_block is None for op in removed)
        ours.validate()
        journal.restore()
    finally:
        journal.close()
    assert fingerprint(ours) == before
