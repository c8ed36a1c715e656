"""Mistakes named: a pattern that is not a program, a constraint without ``return``, a check that rewrote
nothing, and a registration that raises and leaves no trace in the registries."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra import (
    PassExecutionError,
    PatternDefinitionError,
    VerificationError,
    compile_pattern,
    explain,
    find_matches,
    generic_passes,
    register_generic_pass,
    verify_pass,
)
from pattern_infra.rewriting.subpass import constraint_verdict
from pattern_infra.testing.passes import op_types, override, relu_exp
from pattern_infra.verification.verify import assert_programs_equivalent

S = (2, 3)


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def relu_then_exp(x):
    return mb.sin(x=mb.exp(x=mb.relu(x=x)))


@mb.program(input_specs=[mb.TensorSpec(shape=S)])
def nothing_to_fuse(x):
    return mb.sin(x=mb.tanh(x=x))


def to_maximum(pattern):
    """exp(relu(x)) == maximum(exp(x), 1): a correct rewrite of ``relu_exp`` (ops ``r``, ``e``)."""
    e = pattern.e
    exp = mb.exp(x=pattern.root_var, before_op=e)
    pattern.replace_output(mb.maximum(x=exp, y=np.float32(1.0), name=e.outputs[0].name, before_op=e))


def undecorated(x):
    return mb.exp(x=mb.relu(x=x, name="relu"), name="exp")


# ---- a pattern that is not a program ------------------------------------------------------------


ENTRY_POINTS = {
    "register_generic_pass": lambda p, ns: register_generic_pass(p, None, to_maximum, "n", ns),
    "register_generic_pass, in a list": lambda p, ns: register_generic_pass([p], None, to_maximum, "n", ns),
    "compile_pattern": lambda p, ns: compile_pattern(p),
    "find_matches": lambda p, ns: list(find_matches(p, relu_then_exp)),
    "explain": lambda p, ns: explain(p, relu_then_exp),
    "assert_programs_equivalent": lambda p, ns: assert_programs_equivalent(relu_then_exp, p),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("not_a_program", [lambda x: x, undecorated], ids=["lambda", "function"])
def test_every_entry_point_says_to_decorate_a_function(entry, not_a_program, namespace):
    with pytest.raises(PatternDefinitionError, match=r"@mb\.program\(input_specs=\[\.\.\.\]\)") as caught:
        ENTRY_POINTS[entry](not_a_program, namespace)
    assert "function" in str(caught.value) and "not a MIL program" in str(caught.value)
    assert f"{namespace}::" not in " ".join(PASS_REGISTRY.passes)


def test_the_message_names_the_entry_point_and_the_pass(namespace):
    with pytest.raises(PatternDefinitionError, match=rf"register_generic_pass\({namespace}::n\)"):
        register_generic_pass(lambda x: x, None, to_maximum, "n", namespace)
    with pytest.raises(PatternDefinitionError, match=r"pattern \[1\] is a NoneType"):
        register_generic_pass([relu_exp, None], None, to_maximum, "n", namespace)


# ---- what a constraint's answer means ---------------------------------------------------------


def forgets_return(pattern):
    pattern.r.outputs[0].rank == 2  # noqa: B015  (the mistake under test: no return)


def test_a_constraint_without_return_is_an_error_naming_it(namespace):
    sin_pass = register_generic_pass(relu_exp, forgets_return, to_maximum, "n", namespace)
    prog = relu_then_exp
    before = op_types(prog)
    with pytest.raises(PassExecutionError, match=r"returned None.*no `return`.*return True"):
        sin_pass(prog)
    assert op_types(prog) == before  # the program as it was
    for search in (
        lambda: list(find_matches(relu_exp, prog, forgets_return)),
        lambda: explain(relu_exp, prog, forgets_return),
    ):
        with pytest.raises(PassExecutionError, match=r"returned None.*no `return`"):
            search()


@pytest.mark.parametrize(
    ("answer", "verdict"),
    [
        (True, None),
        (np.True_, None),
        (1, None),
        (np.array([True]), None),
        ((True, "unused reason"), None),
        ((np.True_, "unused reason"), None),
        (False, "constraint returned False"),
        (np.False_, "constraint returned False"),
        (0, "constraint returned False"),
        ((np.False_, "rank 3"), "constraint returned False: rank 3"),
        ("rank 3", "constraint returned False: rank 3"),
        ("", "constraint returned False"),
        ((False, ""), "constraint returned False"),
    ],
    ids=repr,
)
def test_constraint_answers(answer, verdict):
    assert constraint_verdict(answer) == verdict


def test_numpy_booleans_decide_a_pass_like_python_ones(namespace):
    accept = register_generic_pass(relu_exp, lambda p: np.True_, to_maximum, "yes", namespace)
    refuse = register_generic_pass(relu_exp, lambda p: np.False_, to_maximum, "no", namespace)
    empty = register_generic_pass(relu_exp, lambda p: "", to_maximum, "empty", namespace)
    assert verify_pass(accept, relu_then_exp).rewrites == 1
    for refusing in (refuse, empty):
        assert verify_pass(refusing, relu_then_exp).rewrites == 0
        assert refusing.stats.rejections == {"constraint returned False": 1}


def test_an_array_of_several_truths_is_an_error():
    with pytest.raises(PassExecutionError, match=r"array of shape \(2,\).*bool\(\(\.\.\.\)\.all\(\)\)"):
        constraint_verdict(np.array([True, False]))


# ---- verify_pass says how many rewrites it saw ----------------------------------------------------


def test_verify_pass_counts_the_rewrites(namespace):
    fuse = register_generic_pass(relu_exp, None, to_maximum, "n", namespace)
    report = verify_pass(fuse, relu_then_exp)
    assert report.passed and report.rewrites == 1
    assert "rewrites=1" in repr(report) and "1 rewrite" in str(report)
    idle = verify_pass(fuse, nothing_to_fuse)
    assert idle.passed and idle.rewrites == 0
    assert "rewrites=0" in repr(idle) and "0 rewrites: nothing matched" in str(idle)


def test_require_rewrite_fails_when_nothing_was_rewritten(namespace):
    fuse = register_generic_pass(relu_exp, None, to_maximum, "n", namespace)
    assert verify_pass(fuse, relu_then_exp, require_rewrite=True).rewrites == 1
    with pytest.raises(VerificationError, match=r"pass 'n' rewrote nothing.*explain") as caught:
        verify_pass(fuse, nothing_to_fuse, require_rewrite=True)
    assert caught.value.report.rewrites == 0


def test_a_pass_that_is_not_generic_is_judged_by_the_program_it_leaves():
    """coremltools' own pass counts no rewrites: the report says None, and require_rewrite compares the
    programs (the same op types, names and order: nothing done)."""
    report = verify_pass("common::fuse_gelu_exact", nothing_to_fuse)
    assert report.rewrites is None and "rewrites unknown" in str(report)
    with pytest.raises(VerificationError, match="rewrote nothing"):
        verify_pass("common::fuse_gelu_exact", nothing_to_fuse, require_rewrite=True)


# ---- a registration that raises leaves the registries as they were -------------------------------


def _registries():
    return dict(PASS_REGISTRY.passes), {
        pass_id: (list(c.passes), list(c.followers), dict(c.options))
        for pass_id, c in generic_passes().items()
    }


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 6))])
def duplicate_names(x):
    a = mb.reshape(x=x, shape=[3, 4], name="reshape")
    return mb.reshape(x=a, shape=[12], name="reshape")


@pytest.mark.parametrize(
    "mistake",
    [
        lambda: register_generic_pass(
            duplicate_names, None, to_maximum, "merge_consecutive_reshapes", "common"
        ),
        lambda: register_generic_pass(
            [relu_exp, duplicate_names], None, to_maximum, "merge_consecutive_reshapes", "common"
        ),
        lambda: register_generic_pass(relu_exp, None, 42, "merge_consecutive_reshapes", "common"),
        lambda: register_generic_pass(relu_exp, 42, to_maximum, "merge_consecutive_reshapes", "common"),
        lambda: register_generic_pass(lambda x: x, None, to_maximum, "merge_consecutive_reshapes", "common"),
        lambda: register_generic_pass(
            relu_exp, None, to_maximum, "merge_consecutive_reshapes", "common", run_after="common::nope"
        ),
        lambda: register_generic_pass(
            relu_exp, None, to_maximum, "merge_consecutive_reshapes", "common", options=[("a", 1)]
        ),
    ],
    ids=["duplicate name", "second of a list", "transform", "constraint", "function", "run_after", "options"],
)
def test_a_failed_registration_leaves_no_trace(mistake):
    coremltools_pass = PASS_REGISTRY.passes["common::merge_consecutive_reshapes"]
    assert isinstance(coremltools_pass, type)  # coremltools' own: no generic pass replaces it
    before = _registries()
    with pytest.raises((PatternDefinitionError, ValueError)):
        mistake()
    assert PASS_REGISTRY.passes["common::merge_consecutive_reshapes"] is coremltools_pass
    assert _registries() == before


def test_coremltools_pass_still_runs_after_a_failed_registration():
    with pytest.raises(PatternDefinitionError, match="two ops are named 'reshape'"):
        register_generic_pass(duplicate_names, None, to_maximum, "merge_consecutive_reshapes", "common")

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 6))])
    def two_reshapes(x):
        return mb.relu(x=mb.reshape(x=mb.reshape(x=x, shape=[3, 4]), shape=[12]))

    with override(True):
        PASS_REGISTRY["common::merge_consecutive_reshapes"](two_reshapes)
    assert op_types(two_reshapes) == ["reshape", "relu"]


def test_a_failed_addition_to_an_existing_pass_keeps_its_sub_passes(namespace):
    container = register_generic_pass(relu_exp, None, to_maximum, "n", namespace, options={"k": 1})
    before = _registries()
    with pytest.raises(PatternDefinitionError):
        register_generic_pass([relu_exp, duplicate_names], None, to_maximum, "n", namespace)
    assert _registries() == before and len(container.passes) == 1


def test_a_coremltools_pass_that_only_leads_followers_still_runs(namespace):
    """``run_after`` a coremltools pass no generic pass replaces puts an empty container under its id:
    under the override, coremltools' pass runs there, then the follower."""
    register_generic_pass(
        relu_exp, None, to_maximum, "n", namespace, run_after="common::merge_consecutive_reshapes"
    )
    leader = PASS_REGISTRY.passes["common::merge_consecutive_reshapes"]
    try:

        @mb.program(input_specs=[mb.TensorSpec(shape=(2, 6))])
        def prog(x):
            return mb.exp(x=mb.relu(x=mb.reshape(x=mb.reshape(x=x, shape=[3, 4]), shape=[12])))

        with override(True):
            leader(prog)
        assert op_types(prog) == ["reshape", "exp", "maximum"]
    finally:
        PASS_REGISTRY.passes["common::merge_consecutive_reshapes"] = leader.replaces
