"""A registration's programs are one pattern, one sub-pass, one merged plan tree per anchor: the generic
passes stay few sub-passes, and the passes written as lists of programs rewrite every program their tests
build exactly as one sub-pass per program did (the structure before: each program's pattern, compiled
with the same options, run as a sub-pass of its own, in the written order)."""

from __future__ import annotations

import re

import pytest
import test_fuse_gelu_exact
import test_fuse_grouped_kv_attention
import test_fuse_rms_norm
import test_fuse_sdpa
import test_fuse_transpose_matmul
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from harvest import harvest

from pattern_infra import generic_passes
from pattern_infra.passes.container import PassContainer
from pattern_infra.rewriting.subpass import SubPass
from pattern_infra.testing.passes import run_pass, same_name_counters


def test_every_generic_pass_is_at_most_four_sub_passes_and_sixty_in_all():
    counts = {pass_id: len(container.passes) for pass_id, container in generic_passes().items()}
    assert max(counts.values()) <= 4, {k: n for k, n in counts.items() if n > 4}
    assert sum(counts.values()) <= 60, counts
    assert counts["generic::fuse_sdpa"] == counts["generic::fuse_rms_norm"] == 1
    assert counts["common::fuse_gelu_exact"] == counts["common::fuse_layernorm_or_instancenorm"] == 2
    sdpa = PASS_REGISTRY["generic::fuse_sdpa"].passes[0]
    assert len(sdpa.compiled.parts) == len(sdpa.matcher.variants) == 32
    # the 32 programs' plans share steps: far fewer distinct pattern ops than 32 programs hold
    assert len(sdpa.matcher.ops) < sum(len(v.compiled.nodes) for v in sdpa.matcher.variants) / 4


@pytest.fixture
def one_sub_pass_per_program(request):
    """The pass ``request.param`` as it was: a container of one sub-pass per program, registered under a
    throwaway id (removed after the test)."""
    pass_id = request.param
    ours = PASS_REGISTRY[pass_id]
    reference = PassContainer(f"{ours.pass_name}_per_program", "test_reference")
    for sub in ours.passes:
        for part in sub.compiled.parts or [sub.compiled]:
            reference.add(
                SubPass(part, sub.var_constraints, sub.transform_pattern, sub.priority, sub.max_iterations)
            )
    PASS_REGISTRY.passes[reference.pass_id] = reference
    yield pass_id, reference.pass_id, len(reference.passes)
    del PASS_REGISTRY.passes[reference.pass_id]


def _symbols_in_order(prog) -> str:
    """The printed program, its symbolic dimensions renamed in order of appearance (a run that infers a
    type again takes new symbols from coremltools' global counter)."""
    names: dict[str, str] = {}
    return re.sub(r"\bis\d+\b", lambda m: names.setdefault(m[0], f"s{len(names)}"), str(prog))


_PROGRAMS = {
    "generic::fuse_sdpa": test_fuse_sdpa,
    "generic::fuse_rms_norm": test_fuse_rms_norm,
    "common::fuse_gelu_exact": test_fuse_gelu_exact,
    "common::fuse_transpose_matmul": test_fuse_transpose_matmul,
    "generic::fuse_grouped_kv_attention": test_fuse_grouped_kv_attention,
}


@pytest.mark.parametrize("one_sub_pass_per_program", sorted(_PROGRAMS), indirect=True)
def test_same_programs_as_one_sub_pass_per_program(one_sub_pass_per_program):
    pass_id, reference, n_programs = one_sub_pass_per_program
    assert n_programs > len(PASS_REGISTRY[pass_id].passes)
    compared = changed = 0
    for prog in harvest(_PROGRAMS[pass_id], limit=200):
        ours, theirs = same_name_counters(
            lambda prog=prog: run_pass(pass_id, prog), lambda prog=prog: run_pass(reference, prog)
        )
        assert _symbols_in_order(ours) == _symbols_in_order(theirs), str(prog)
        compared += 1
        changed += str(ours) != str(prog)
    assert compared >= 15 and changed >= 13, (compared, changed)
