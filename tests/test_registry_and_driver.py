"""Registration, the run-time override, coremltools' pipeline, and the driver's guarantees."""

from __future__ import annotations

import copy
import os

import coremltools as ct
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.defs.optimize_activation import (
    fuse_gelu_tanh_approximation as CoremltoolsGelu,
)
from coremltools.converters.mil.mil.passes.graph_pass import PassOption
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from coremltools.converters.mil.mil.scope import ScopeSource

from pattern_infra import (
    ENV_VAR,
    FixpointError,
    PassContainer,
    PassExecutionError,
    PassRegistrationError,
    fuse_all_blocks,
    fuse_one_block,
    register_generic_pass,
    run_log,
)
from pattern_infra.testing.passes import op_types, override, relu_exp, run_both, to_softplus

S = (2, 3)


def chain(n, *, residual=False):
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        for _ in range(n):
            y = mb.exp(x=mb.relu(x=x))
            x = mb.add(x=x, y=y) if residual else mb.sin(x=y)
        return x

    return prog


def gelu_chain(n):
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        for i in range(n):
            a = mb.add(x=mb.mul(x=mb.pow(x=x, y=3.0), y=0.044715), y=x)
            t = mb.tanh(x=mb.mul(x=a, y=0.7978845834732056))
            half = mb.mul(x=0.5, y=mb.add(x=1.0, y=t)) if i % 2 else mb.mul(x=mb.add(x=t, y=1.0), y=0.5)
            x = mb.relu(x=mb.mul(x=x, y=half))
        return x

    return prog


def test_same_id_groups_into_one_container(namespace):
    first = register_generic_pass(relu_exp, None, to_softplus, "p", namespace)
    second = register_generic_pass(relu_exp, lambda p: True, to_softplus, "p", namespace, name="again")
    assert first is second and PASS_REGISTRY[f"{namespace}::p"] is first
    assert isinstance(first, PassContainer) and first.order == ["e", "again"]
    assert str(first) == "p" and first.pass_id == f"{namespace}::p"


def test_priority_orders_sub_passes(namespace):
    register_generic_pass(relu_exp, None, to_softplus, "p", namespace, name="low")
    c = register_generic_pass(relu_exp, None, to_softplus, "p", namespace, name="high", priority=5)
    register_generic_pass(relu_exp, None, to_softplus, "p", namespace, name="low2")
    assert c.order == ["high", "low", "low2"]


@pytest.mark.parametrize("pass_name,ns", [("", "x"), ("a::b", "x"), ("p", ""), ("p", 3)])
def test_bad_pass_ids_are_refused(pass_name, ns):
    with pytest.raises(PassRegistrationError, match="::"):
        register_generic_pass(relu_exp, None, to_softplus, pass_name, ns)


def test_non_callable_transform_is_refused(namespace):
    with pytest.raises(PassRegistrationError, match="transform_pattern must be callable"):
        register_generic_pass(relu_exp, None, "nope", "p", namespace)


def test_non_callable_constraints_are_refused(namespace):
    with pytest.raises(PassRegistrationError, match="var_constraints must be callable or None, got str"):
        register_generic_pass(relu_exp, "nope", to_softplus, "p", namespace)


def test_new_id_runs_whatever_the_variable_says(namespace):
    register_generic_pass(relu_exp, None, to_softplus, "p", namespace)
    for flag in (None, "0", "1"):
        prog = chain(2)
        if flag is not None:
            os.environ[ENV_VAR] = flag
        PASS_REGISTRY[f"{namespace}::p"](prog)
        assert op_types(prog) == ["softplus", "sin"] * 2


def test_override_is_decided_when_the_pass_runs():
    prog = gelu_chain(2)
    with override(False):
        container = PASS_REGISTRY["common::fuse_gelu_tanh_approximation"]
        assert container.replaces is CoremltoolsGelu
        before = container.stats.rewrites
        container(copy.deepcopy(prog))
        assert container.stats.rewrites == before  # coremltools' pass ran, not ours
    with override(True):
        container(copy.deepcopy(prog))
        assert container.stats.rewrites == before + 2


def test_seed_pass_gives_coremltools_program():
    outcome = run_both("common::fuse_gelu_tanh_approximation", gelu_chain(4))
    assert outcome.same()
    assert op_types(outcome.ours) == ["gelu", "relu"] * 4


def test_options_reach_the_pass_that_runs(namespace):
    c = register_generic_pass(relu_exp, None, to_softplus, "p", namespace, options={"level": 1})
    c.set_options([PassOption("level", 3)])
    assert c.options == {"level": 3}
    c.set_options(None)
    assert c.options == {"level": 1}
    with pytest.raises(NotImplementedError, match="doesn't support option `bogus`"):
        c.set_options([PassOption("bogus", 1)])


def test_convert_with_pipeline_and_scope(namespace):
    register_generic_pass(relu_exp, None, to_softplus, "p", namespace)
    pipeline = PassPipeline.EMPTY
    pipeline.append_pass(f"{namespace}::p")
    run_log(clear=True)
    model = ct.convert(
        chain(3),
        convert_to="mlprogram",
        skip_model_load=True,
        pass_pipeline=pipeline,
        compute_precision=ct.precision.FLOAT32,
    )
    prog = model._mil_program
    assert op_types(prog) == ["softplus", "sin"] * 3
    fired = [(pid, s.rewrites) for pid, generic, s in run_log() if generic]
    assert fired == [(f"{namespace}::p", 3)]
    softplus = next(op for op in prog.functions["main"].operations if op.op_type == "softplus")
    assert softplus.scopes[ScopeSource.COREMLTOOLS_GRAPH_PASS] == ["p"]


@pytest.mark.parametrize("flag", [False, True])
def test_full_convert_of_a_mil_program(flag):
    with override(flag):
        run_log(clear=True)
        model = ct.convert(
            gelu_chain(3),
            convert_to="mlprogram",
            skip_model_load=True,
            compute_precision=ct.precision.FLOAT32,
        )
    assert op_types(model._mil_program) == ["gelu", "relu"] * 3
    fired = {pid for pid, _, s in run_log() if s.rewrites}
    assert ("common::fuse_gelu_tanh_approximation" in fired) is flag


def test_root_with_other_consumers_is_fused(namespace):
    register_generic_pass(relu_exp, None, to_softplus, "p", namespace)
    prog = chain(3, residual=True)
    PASS_REGISTRY[f"{namespace}::p"](prog)
    assert op_types(prog) == ["softplus", "add"] * 3


def test_nested_blocks_are_fused(namespace):
    register_generic_pass(relu_exp, None, to_softplus, "p", namespace)

    @mb.program(input_specs=[mb.TensorSpec(shape=S), mb.TensorSpec(shape=(1,))])
    def prog(x, flag):
        def then_branch():
            return mb.exp(x=mb.relu(x=x))

        def else_branch():
            return mb.exp(x=mb.relu(x=mb.sin(x=x)))

        pred = mb.squeeze(x=mb.greater(x=flag, y=0.0))
        return mb.cond(pred=pred, _true_fn=then_branch, _false_fn=else_branch)

    PASS_REGISTRY[f"{namespace}::p"](prog)
    cond = next(op for op in prog.functions["main"].operations if op.op_type == "cond")
    inner = [[op.op_type for op in b.operations] for b in cond.blocks]
    assert inner == [["softplus"], ["sin", "softplus"]]


def test_a_raising_transform_restores_the_program(namespace):
    calls = []

    def explode_on_second(pattern):
        calls.append(pattern.e.name)
        if len(calls) == 2:
            raise ZeroDivisionError("boom")
        to_softplus(pattern)

    register_generic_pass(relu_exp, None, explode_on_second, "p", namespace)
    prog = chain(3)
    before = str(prog)
    with pytest.raises(PassExecutionError) as info:
        PASS_REGISTRY[f"{namespace}::p"](prog)
    message = str(info.value)
    assert f"{namespace}::p" in message and "'e'" in message and "ZeroDivisionError: boom" in message
    assert calls[1] in message and "restored" in message
    assert str(prog) == before
    prog.validate()
    PASS_REGISTRY[f"{namespace}::p"]  # the registry is intact
    register_generic_pass(relu_exp, None, to_softplus, "q", namespace)
    PASS_REGISTRY[f"{namespace}::q"](prog)  # and the restored program is usable
    assert op_types(prog) == ["softplus", "sin"] * 3


def test_a_raising_constraint_restores_the_program(namespace):
    seen = []

    def constraint(pattern):
        seen.append(1)
        if len(seen) == 3:
            raise KeyError("no such thing")
        return True

    register_generic_pass(relu_exp, constraint, to_softplus, "p", namespace)
    prog = chain(3)
    before = str(prog)
    with pytest.raises(PassExecutionError, match="var_constraints raised KeyError"):
        PASS_REGISTRY[f"{namespace}::p"](prog)
    assert str(prog) == before


def test_declining_changes_nothing_and_is_not_retried(namespace):
    calls = []

    def decline(pattern):
        calls.append(pattern.e.name)
        return False

    c = register_generic_pass(relu_exp, None, decline, "p", namespace)
    prog = chain(3)
    before = str(prog)
    c(prog)
    assert str(prog) == before and len(calls) == 3
    assert c.stats.declined == 3 and c.stats.rewrites == 0


def test_declining_after_a_change_is_an_error(namespace):
    def sneaky(pattern):
        mb.relu(x=pattern.root_var, before_op=pattern.e)
        return False

    register_generic_pass(relu_exp, None, sneaky, "p", namespace)
    prog = chain(2)
    before = str(prog)
    with pytest.raises(PassExecutionError, match="returned False"):
        PASS_REGISTRY[f"{namespace}::p"](prog)
    assert str(prog) == before


def test_a_transform_recreating_its_pattern_hits_the_cap(namespace):
    def recreate(pattern):
        r = mb.relu(x=pattern.root_var, before_op=pattern.e)
        pattern.replace_output(mb.exp(x=r, before_op=pattern.e))

    register_generic_pass(relu_exp, None, recreate, "p", namespace, max_iterations=5)
    prog = chain(2)
    before = str(prog)
    with pytest.raises(FixpointError, match="still rewriting after 5 rounds"):
        PASS_REGISTRY[f"{namespace}::p"](prog)
    assert str(prog) == before


def test_constraints_see_the_match_and_can_reject(namespace):
    def only_first(pattern):
        return pattern.root_var.name == "x"

    register_generic_pass(relu_exp, only_first, to_softplus, "p", namespace)
    prog = chain(3)
    PASS_REGISTRY[f"{namespace}::p"](prog)
    assert op_types(prog) == ["softplus", "sin", "relu", "exp", "sin", "relu", "exp", "sin"]


def test_seed_style_transform_still_works(namespace):
    def seed_style(pattern):
        out = mb.softplus(x=pattern.root_var, name=pattern.e.outputs[0].name, before_op=pattern.r)
        pattern.e.enclosing_block.replace_uses_of_var_after_op(
            anchor_op=pattern.e, old_var=pattern.e.outputs[0], new_var=out
        )
        pattern.block.remove_ops(pattern.op_list())

    register_generic_pass(relu_exp, None, seed_style, "p", namespace)
    prog = chain(4)
    PASS_REGISTRY[f"{namespace}::p"](prog)
    assert op_types(prog) == ["softplus", "sin"] * 4


def test_fuse_all_blocks_and_fuse_one_block():
    prog = chain(3)
    stats = fuse_all_blocks(relu_exp, None, to_softplus, prog)
    assert stats.rewrites == 3 and op_types(prog) == ["softplus", "sin"] * 3
    prog = chain(3)
    block = prog.functions["main"]
    assert fuse_one_block(block, relu_exp, None, to_softplus)
    assert op_types(prog).count("softplus") == 1
    assert not fuse_one_block(block, relu_exp, lambda p: False, to_softplus)


def test_a_plain_graph_pass_stands_alone_in_its_container():
    container = PassContainer("plain_alone")
    seen = []
    container.add(seen.append)  # the design document's add(pass_func)
    assert container.passes == [] and container.order == ["append"]
    prog = chain(1)
    container.apply(prog)
    assert seen == [prog]
    with pytest.raises(PassRegistrationError, match="stands alone"):
        container.add(lambda prog: None)


def test_fuse_one_block_leaves_the_block_as_it_was_when_the_transform_raises():
    prog = chain(2)
    block = prog.functions["main"]
    before = str(prog)

    def half_built(pattern):
        mb.softplus(x=pattern.root_var, before_op=pattern.final_op)  # the replacement's first op
        raise RuntimeError("lost halfway")

    with pytest.raises(PassExecutionError, match="lost halfway") as info:
        fuse_one_block(block, relu_exp, None, half_built)
    assert "restored" in str(info.value)
    assert str(prog) == before and op_types(prog) == ["relu", "exp", "sin"] * 2
    prog.validate()
    # the first match only, and only in the block given
    assert fuse_one_block(block, relu_exp, None, to_softplus)
    assert op_types(prog) == ["softplus", "sin", "relu", "exp", "sin"]


@pytest.mark.parametrize("n", [10, 40, 160])
def test_each_op_is_visited_a_bounded_number_of_times(n):
    c = PASS_REGISTRY["common::fuse_gelu_tanh_approximation"]
    before = copy.deepcopy(c.stats)
    with override(True):
        c(gelu_chain(n))
    attempts = c.stats.attempts - before.attempts
    binds = c.stats.bind_attempts - before.bind_attempts
    assert c.stats.rewrites - before.rewrites == n
    # one anchor (the tanh) per block per sub-pass, at most 8 pattern ops bound per attempt
    assert attempts <= 2 * n
    assert binds <= 2 * 8 * n + 8
    # the chain's two spellings are pattern 1 up to commutativity: one sub-pass fuses every copy in a
    # single round, and since a gelu and a redirected relu cannot be part of a GELU pattern, no
    # rewrite triggers a revisit round
    assert c.stats.iterations - before.iterations == 1


def test_absent_op_types_cost_nothing(namespace):
    # Many sub-passes for op types the program lacks: not one bind attempt is spent on them.
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def absent(x):
        return mb.erf(x=mb.atan(x=x, name="a"), name="e")

    c = register_generic_pass([absent] * 20, None, to_softplus, "p", namespace)
    c(gelu_chain(50))
    assert c.stats.bind_attempts == 0 and c.stats.attempts == 0


def test_chain_created_by_rewrites_is_followed(namespace):
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def two_relus(x):
        return mb.relu(x=mb.relu(x=x, name="a"), name="b")

    def merge(pattern):
        pattern.replace_output(mb.relu(x=pattern.root_var, before_op=pattern.b))

    register_generic_pass(two_relus, None, merge, "p", namespace)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        for _ in range(7):
            x = mb.relu(x=x)
        return mb.sin(x=x)

    PASS_REGISTRY[f"{namespace}::p"](prog)
    assert op_types(prog) == ["relu", "sin"]


def test_run_after_joins_coremltools_pipeline_only_under_override(namespace):
    c = register_generic_pass(
        relu_exp, None, to_softplus, "p", namespace, run_after="common::fuse_gelu_tanh_approximation"
    )
    assert c in PASS_REGISTRY["common::fuse_gelu_tanh_approximation"].followers
    for flag in (False, True):
        with override(flag):
            model = ct.convert(
                chain(2), convert_to="mlprogram", skip_model_load=True, compute_precision=ct.precision.FLOAT32
            )
        assert ("softplus" in op_types(model._mil_program)) is flag
    with pytest.raises(PassRegistrationError, match="not a registered pass"):
        register_generic_pass(relu_exp, None, to_softplus, "q", namespace, run_after="nowhere::x")


def test_followers_leave_the_whole_program_validation_to_the_pipeline(namespace, monkeypatch):
    """A leader with followers validates each rewrite, not the whole program per follower: the
    pipeline running the leader validates the program once it returns."""
    register_generic_pass(
        relu_exp, None, to_softplus, "p", namespace, run_after="common::fuse_gelu_tanh_approximation"
    )
    register_generic_pass(
        relu_exp, None, to_softplus, "q", namespace, run_after="common::fuse_gelu_tanh_approximation"
    )
    prog = chain(3)
    calls = []
    original = type(prog).validate
    monkeypatch.setattr(
        type(prog), "validate", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    with override(True):
        PASS_REGISTRY["common::fuse_gelu_tanh_approximation"](prog)
    assert op_types(prog) == ["softplus", "sin"] * 3
    assert calls == []


def test_a_pass_and_its_followers_walk_the_program_once(namespace, monkeypatch):
    """The leader and its followers share one driver run: one walk and index of the program (each
    follower used to walk and index it again, even with none of its op types present), each pass's
    counters and run-log entry kept apart, and a follower's error naming the follower."""
    from pattern_infra.rewriting import driver

    leader = "common::fuse_gelu_tanh_approximation"
    walks = []
    original_walk = driver.walk_blocks
    monkeypatch.setattr(driver, "walk_blocks", lambda prog: walks.append(1) or original_walk(prog))
    follower = register_generic_pass(relu_exp, None, to_softplus, "p", namespace, run_after=leader)
    idle = register_generic_pass(two_sins(), None, to_softplus, "q", namespace, run_after=leader)
    prog = chain(3)
    run_log(clear=True)
    with override(True):
        PASS_REGISTRY[leader](prog)
    assert walks == [1]
    assert op_types(prog) == ["softplus", "sin"] * 3
    logged = {pass_id: stats.rewrites for pass_id, _, stats in run_log(clear=True)}
    assert logged == {leader: 0, follower.pass_id: 3, idle.pass_id: 0}

    def broken(pattern):
        raise RuntimeError("boom")

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def one_sin(x):
        return mb.sin(x=x, name="s")

    register_generic_pass(one_sin, None, broken, "r", namespace, run_after=leader)
    prog = chain(2)
    before = str(prog)
    with override(True), pytest.raises(PassExecutionError, match=rf"Pass '{namespace}::r', pattern"):
        PASS_REGISTRY[leader](prog)
    assert str(prog) == before


def two_sins():
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def pattern(x):
        return mb.sin(x=mb.sin(x=x, name="s1"), name="s2")

    return pattern


@pytest.mark.parametrize("validate", [True, "full"])
def test_validation_after_a_sub_pass_catches_a_corrupt_rewrite(namespace, validate):
    def corrupt(pattern):
        out = mb.softplus(x=pattern.root_var, before_op=pattern.e)
        pattern.replace_output(out)
        other = mb.sin(x=pattern.root_var, before_op=pattern.e)
        out.op._input_vars["x"] = other  # bypasses set_inputs: the use is not recorded on `other`

    c = register_generic_pass(relu_exp, None, corrupt, "p", namespace)
    c.validate = validate
    prog = chain(2)
    before = str(prog)
    # "full" validates the whole program after the sub-pass; the rewrite's contract, checked right after
    # each rewrite, sees the unrecorded use first: `sin` looks unused
    expected = (
        "inconsistent after its rewrites" if validate is True else r"built \[sin_\d+\] but nothing uses them"
    )
    with pytest.raises(PassExecutionError, match=expected) as info:
        c(prog)
    assert "restored" in str(info.value)
    assert str(prog) == before


def test_revisit_walk_reaches_siblings_through_a_function_input():
    # Two consumers of a function input are joined by no op; the walk after a rewrite must still
    # reach one from the other (a match can be joined only through such an input).
    from pattern_infra.rewriting.changes import near

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        return mb.relu(x=x, name="a"), mb.sigmoid(x=x, name="b")

    block = prog.functions["main"]
    a = next(op for op in block.operations if op.op_type == "relu")
    found = near([a], block, frozenset({"sigmoid"}), radius=1)
    assert [op.op_type for op in found] == ["sigmoid"]
    assert near([a], block, frozenset({"sigmoid"}), radius=0) == []


def test_a_removed_consumer_unblocks_a_match_in_the_same_sweep(namespace):
    # exp(x) -> log is fused to a constant only if the exp has no other consumer. The first tried
    # anchor (log u) is blocked by the second exp, which the later match (exp2, z) removes: the
    # producer of its input is revisited in the same sub-pass, and u then fuses.
    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def exp_log(x):
        return mb.log(x=mb.exp(x=x, name="e"), name="l")

    def to_zeros(pattern):
        zeros = mb.fill(shape=list(S), value=0.0, before_op=pattern.l)
        pattern.replace_output(zeros)

    c = register_generic_pass(exp_log, None, to_zeros, "p", namespace)

    @mb.program(input_specs=[mb.TensorSpec(shape=S)])
    def prog(x):
        t = mb.exp(x=x, name="t")
        u = mb.log(x=t, name="u")
        z = mb.log(x=mb.exp(x=t, name="exp2"), name="z")
        return mb.add(x=u, y=z)

    c(prog)
    assert op_types(prog).count("log") == 0 and op_types(prog).count("exp") == 0
    assert c.stats.rewrites == 2 and c.stats.iterations == 2


def test_program_order_of_ops_inserted_during_the_pass():
    # Pattern.op_list() sorts with the block's position index; ops inserted after it was built get a
    # position between their neighbours', and the index is rebuilt once positions run out.
    from pattern_infra.rewriting.blocks import BlockIndex

    prog = chain(3)
    block = prog.functions["main"]
    st = BlockIndex(block)
    st.observe()
    try:
        ops = list(block.operations)
        assert st.order(ops[::-1]) == ops
        last = ops[-1]
        with block:
            for _ in range(80):  # each one right before the previous: halves the gap every time
                last = mb.relu(x=block.inputs["x"], before_op=last).op
        program_order = list(block.operations)
        assert st.order(program_order[::-1]) == program_order
        assert st.order([program_order[5], ops[0]]) == [ops[0], program_order[5]]
    finally:
        st.release()


_GC_SCRIPT = """
import gc, sys
from coremltools.converters.mil import Builder as mb
from pattern_infra import register_generic_pass
from pattern_infra.rewriting import driver
from pattern_infra.testing.passes import relu_exp, to_softplus

def chain(n):
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        for _ in range(n):
            x = mb.sin(x=mb.exp(x=mb.relu(x=x)))
        return x
    return prog

driver._PROMOTE_ABOVE = int(sys.argv[1])
c = register_generic_pass(relu_exp, None, to_softplus, "p", "gc_test")
collections = []
gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
prog = chain(200)
gc.collect()
collections.clear()
c(prog)
[[] for _ in range(10)]  # the allocations that would set off a pending collection
after_pass = list(collections)
frozen = [object() for _ in range(1000)]
gc.freeze()
count = gc.get_freeze_count()
c(chain(20))
print(after_pass, gc.get_freeze_count() > count // 2)
"""


@pytest.mark.parametrize(
    "threshold, collected", [(100, False), (10**9, True)], ids=["large pass", "small pass"]
)
def test_a_large_pass_leaves_no_collection_pending_and_respects_a_freeze(threshold, collected):
    # With collection paused during the pass, everything it kept is young, and the next allocation
    # would collect all of it; above a size the driver promotes it instead (gc.freeze + gc.unfreeze),
    # unless the process has frozen objects of its own, which stay frozen. In a fresh interpreter:
    # this test process has objects frozen (tests/coremltools_suite/conftest.py).
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _GC_SCRIPT, str(threshold)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    after_pass, still_frozen = done.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert (after_pass != "[]") == collected
    assert still_frozen == "True"
