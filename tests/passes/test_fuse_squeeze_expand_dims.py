"""``common::fuse_squeeze_expand_dims``: ``expand_dims(squeeze(x))`` of ``x``'s shape into ``identity``."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import assert_same_program, op_types, run_both, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_squeeze_expand_dims"


def squeeze_expand(shape=(3, 1, 4, 1), squeeze_axes=(1, 3), expand_axes=(1, 3), *, extra=None) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        kw = {} if squeeze_axes is None else {"axes": list(squeeze_axes)}
        s = mb.squeeze(x=x, name="s", **kw)
        e = mb.expand_dims(x=s, axes=list(expand_axes), name="e")
        if extra == "expand_is_output":
            return e
        y = mb.relu(x=e, name="y")
        if extra == "use_squeeze":
            return y, mb.exp(x=s, name="other")
        if extra == "squeeze_is_output":
            return y, s
        return y

    return prog


@pytest.mark.parametrize(
    "prog",
    [
        lambda: squeeze_expand(),
        lambda: squeeze_expand(squeeze_axes=None),
        lambda: squeeze_expand((1, 5, 1), (0, 2), (-1, 0)),
        lambda: squeeze_expand((get_new_symbol(), 1, 4), (1,), (1,)),
        lambda: squeeze_expand(extra="expand_is_output"),
    ],
    ids=["axes", "no_axes", "negative_axes", "symbolic", "expand_is_block_output"],
)
def test_same_program_as_coremltools(prog):
    p = prog()
    outcome = run_both(PASS, p)
    theirs, ours = outcome.coremltools, outcome.ours
    assert op_types(theirs)[0] == "identity"
    assert_same_program(theirs, ours)
    assert_programs_equivalent(p, ours, rtol=1e-5)


@pytest.mark.parametrize(
    "prog",
    [
        lambda: squeeze_expand((3, 1, 4, 1), (1,), (0,)),  # [3,4,1] -> [1,3,4,1]
        lambda: squeeze_expand((3, 1, 4, 1), (1, 3), (0, 1)),  # [3,4] -> [1,1,3,4]
        lambda: squeeze_expand(extra="use_squeeze"),
        lambda: squeeze_expand(extra="squeeze_is_output"),
    ],
    ids=["moved_axis", "front_axes", "squeeze_used_elsewhere", "squeeze_is_block_output"],
)
def test_not_fused(prog):
    p = prog()
    assert_same_program(p, run_pass(PASS, p, generic=False))
    assert_same_program(p, run_pass(PASS, p))
