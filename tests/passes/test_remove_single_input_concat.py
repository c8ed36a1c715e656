"""``generic::remove_single_input_concat``: ``concat`` of one tensor removed."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::remove_single_input_concat"


def single_concat(axis: int = 0):
    """``relu(concat(values=(exp(x),), axis))``."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3, 4))])
    def prog(x):
        return mb.relu(x=mb.concat(values=[mb.exp(x=x)], axis=axis))

    return prog


@pytest.mark.parametrize("axis", [0, -2, 2])
def test_removed(axis):
    prog = single_concat(axis)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["exp", "relu"]
    assert_programs_equivalent(prog, ours, rtol=0.0, atol=0.0)


def test_two_inputs_and_block_outputs_left_alone():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        e = mb.exp(x=x)
        return mb.concat(values=[e, e], axis=0), mb.concat(values=[e], axis=1)

    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)
