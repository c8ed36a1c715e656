"""Mistakes that used to pass silently or fail far from their cause now fail loudly, saying the fix."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra import (
    ENV_VAR,
    Explanations,
    PassRegistrationError,
    PatternDefinitionError,
    explain,
    find_matches,
    override_enabled,
    pattern_program,
    register_generic_pass,
)
from pattern_infra.testing.passes import relu_exp, to_softplus

# -- a pass id in coremltools' namespaces that coremltools does not have ------------------------------------


@pytest.mark.parametrize(
    ("namespace", "name", "suggested"),
    [
        ("common", "fuse_gelu_exactt", "common::fuse_gelu_exact"),
        ("common", "fuse_layernorm_or_instance_norm", "common::fuse_layernorm_or_instancenorm"),
        ("mil_backend", "fuse_activation_slu", "mil_backend::fuse_activation_silu"),
    ],
)
def test_misspelled_coremltools_pass_id_is_refused_with_the_nearest_ids(namespace, name, suggested):
    with pytest.raises(PassRegistrationError, match="Did you mean") as info:
        register_generic_pass(relu_exp, None, to_softplus, name, namespace)
    assert repr(suggested) in str(info.value)
    assert "namespace of your own" in str(info.value)
    assert f"{namespace}::{name}" not in PASS_REGISTRY.passes


def test_exact_coremltools_ids_and_own_namespaces_still_register(namespace):
    container = register_generic_pass(relu_exp, None, to_softplus, "fuse_gelu_exact_typo_free", namespace)
    assert container.replaces is None
    existing = PASS_REGISTRY.passes["common::fuse_gelu_exact"]
    assert register_generic_pass(relu_exp, None, to_softplus, "fuse_gelu_exact", "common") is existing
    existing.passes.pop()  # leave the project's pass as it was
    assert all(p.name != "e" for p in existing.passes)


# -- ENABLE_EXPERIMENTAL_PASSES values ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " True "])
def test_override_values_meaning_on(value):
    os.environ[ENV_VAR] = value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert override_enabled()


@pytest.mark.parametrize("value", ["0", "", "false", "No", "off"])
def test_override_values_meaning_off_are_silent(value):
    os.environ[ENV_VAR] = value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not override_enabled()


@pytest.mark.parametrize("value", ["2", "enable", "ture"])
def test_unknown_override_value_warns_naming_the_accepted_values(value):
    os.environ[ENV_VAR] = value
    importlib.import_module("pattern_infra.passes.container")._warned_values.discard(value)
    with pytest.warns(RuntimeWarning, match=rf"{ENV_VAR}={value!r} is not understood") as caught:
        assert not override_enabled()
    message = str(caught[0].message)
    assert "Set ENABLE_EXPERIMENTAL_PASSES=1" in message and "true, yes, on" in message


# -- pattern functions that return nothing, or an input ---------------------------------------------------


def test_pattern_function_without_return_is_a_pattern_definition_error():
    with pytest.raises(PatternDefinitionError, match="returns nothing. End it with `return`"):

        @pattern_program(input_specs=[mb.TensorSpec(shape=(2, 3))])
        def forgot(x):
            mb.exp(x=mb.relu(x=x, name="r"), name="e")


def test_pattern_function_returning_its_input_is_a_pattern_definition_error():
    with pytest.raises(PatternDefinitionError, match="returns its input 'x'"):

        @pattern_program(input_specs=[mb.TensorSpec(shape=(2, 3))])
        def identity(x):
            mb.exp(x=mb.relu(x=x, name="r"), name="e")
            return x


def test_pattern_function_returning_an_input_among_outputs_is_refused():
    with pytest.raises(PatternDefinitionError, match="returns its input 'y'"):

        @pattern_program(input_specs=[mb.TensorSpec(shape=(2, 3)), mb.TensorSpec(shape=(2, 3))])
        def pair(x, y):
            return mb.relu(x=x, name="r"), y


def test_pattern_program_builds_what_mb_program_builds(namespace):
    @pattern_program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def same(x):
        return mb.exp(x=mb.relu(x=x, name="r"), name="e")

    assert str(same).replace(same.functions["main"].name, "B") == str(relu_exp).replace(
        relu_exp.functions["main"].name, "B"
    )
    container = register_generic_pass(same, None, to_softplus, "p", namespace)
    assert [sub.name for sub in container.passes] == ["e"]


# -- find_matches / explain with several patterns or a registered pass -----------------------------------


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
def relu_sin(x):
    return mb.sin(x=mb.relu(x=x, name="r"), name="s")


def program():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        a = mb.exp(x=mb.relu(x=x, name="r1"), name="e1")
        b = mb.sin(x=mb.relu(x=a, name="r2"), name="s2")
        return mb.exp(x=mb.relu(x=b, name="r3"), name="e3")

    return prog


def test_find_matches_takes_a_list_of_patterns():
    found = [sorted(op.name for op in m.op_set) for m in find_matches([relu_exp, relu_sin], program())]
    assert found == [["e1", "r1"], ["e3", "r3"], ["r2", "s2"]]


def test_find_matches_takes_a_registered_pass_with_its_constraints_and_options(namespace):
    def not_first(pattern):
        return pattern.r.name != "r1"

    container = register_generic_pass(
        relu_exp, not_first, to_softplus, "p", namespace, alternatives={"e": ["exp", "sin"]}
    )
    found = [sorted(op.name for op in m.op_set) for m in find_matches(container, program())]
    assert found == [["r2", "s2"], ["e3", "r3"]]  # sin accepted (alternatives), r1 refused (constraint)
    by_id = [sorted(op.name for op in m.op_set) for m in find_matches(f"{namespace}::p", program())]
    assert by_id == found
    everything = list(find_matches(container, program(), var_constraints=lambda p: True))
    assert len(everything) == 3


def test_explain_takes_a_registered_pass_and_reports_its_constraint(namespace):
    container = register_generic_pass(relu_exp, lambda p: p.r.name == "r3", to_softplus, "p", namespace)
    result = explain(container, program())
    assert isinstance(result, Explanations) and len(result) == 1
    assert [sorted(op.name for op in m.op_set) for m in result.matches] == [["e3", "r3"]]
    assert "constraint returned False" in str(result)


def test_explain_takes_a_list_of_patterns():
    result = explain([relu_exp, relu_sin], program())
    assert [len(e.matches) for e in result] == [2, 1]
    assert str(result).count("pattern ") == 2


def test_pattern_options_with_a_registered_pass_are_refused(namespace):
    container = register_generic_pass(relu_exp, None, to_softplus, "p", namespace)
    with pytest.raises(PassRegistrationError, match="keep the options they were registered with"):
        explain(container, program(), commutative=False)


def test_unknown_pass_id_is_refused_with_the_nearest_ids():
    with pytest.raises(PassRegistrationError, match="Did you mean common::fuse_gelu_exact"):
        list(find_matches("common::fuse_gelu_exakt", program()))
