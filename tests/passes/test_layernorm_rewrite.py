"""``common::fuse_layernorm_or_instancenorm`` written with ``one_of``/``optional`` (8 patterns) gives the
very programs the 112-sub-pass version gave (``layernorm_reference.py``, kept as it was), on every program
the layer-norm tests build: the printed programs (ops, order, names, constants) are compared.

Whole conversions (coremltools' own tests of the pass, the real-model tables) are compared by running them
with ``PATTERN_INFRA_SHADOW_LAYERNORM=<log>`` (``tests/conftest.py``): every run of the pass is shadowed by
the reference. ``make layernorm-shadow`` does it.
"""

from __future__ import annotations

from pathlib import Path

import layernorm_reference
import pytest
import test_fuse_layernorm_or_instancenorm as ln_tests
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from harvest import harvest

from pattern_infra.testing.passes import run_pass, same_name_counters

PASS = "common::fuse_layernorm_or_instancenorm"


@pytest.fixture(scope="module")
def reference():
    pass_id = layernorm_reference.register()
    yield pass_id
    del PASS_REGISTRY.passes[pass_id]


def _programs() -> list[Program]:
    """Every program the layer-norm tests build (``harvest``), and the 108 spellings four ways each."""
    built = harvest(ln_tests, limit=400)
    for key in ln_tests.KEYS:
        for residual in (False, True):
            for swap in (False, True):
                built.append(ln_tests.written(key, residual=residual, swap=swap))
    return built


def test_the_pass_is_eight_patterns_in_two_sub_passes_in_under_200_lines():
    import generic_passes.fuse_layernorm_or_instancenorm as module

    subs = PASS_REGISTRY[PASS].passes
    assert [sub.name for sub in subs] == ["instancenorm_pattern_4", "layer_norm"]
    programs = [part.name for sub in subs for part in sub.compiled.parts or [sub.compiled]]
    assert programs == list(module.PATTERNS) and len(programs) == 8
    assert len(Path(module.__file__).read_text().splitlines()) < 200


def test_same_programs_as_before_on_every_layer_norm_test_program(reference):
    compared = changed = 0
    for prog in _programs():
        ours, theirs = same_name_counters(
            lambda prog=prog: run_pass(PASS, prog), lambda prog=prog: run_pass(reference, prog)
        )
        assert str(ours) == str(theirs), str(prog)
        compared += 1
        changed += str(ours) != str(prog)
    assert compared > 450 and changed > 400, (compared, changed)
