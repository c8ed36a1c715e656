"""``bench.instructions``: what runs under valgrind, and the error when valgrind is missing.

The valgrind run itself (minutes) is not part of the suite; these check the part that decides what is
counted: one uncounted warm-up run, then exactly ``_REPEATS`` calls through ``operator.call`` (the
function callgrind counts inside), each on a fresh copy that the runner rewrites.
"""

from __future__ import annotations

import operator
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the benchmark package sits next to tests/, outside the installed code
    sys.path.insert(0, str(REPO))

from bench import instructions  # noqa: E402


@pytest.mark.parametrize("runner", ["c", "d"])
def test_only_the_repeated_runs_go_through_the_counted_call(monkeypatch, runner):
    counted = []
    real_call = operator.call

    def call(fn, *args, **kwargs):
        counted.append(fn)
        return real_call(fn, *args, **kwargs)

    monkeypatch.setattr(operator, "call", call)
    fused = []
    from bench import runners

    prepare = runners.workload_runners("gelu").runners[runner].prepare
    monkeypatch.setattr(
        runners,
        "workload_runners",
        lambda name: runners.WorkloadRunners({runner: runners.Runner(runner, _recording(prepare, fused))}),
    )
    instructions._counted_runs("gelu", 3, runner)
    assert len(counted) == instructions._REPEATS
    assert fused == [True] * (instructions._REPEATS + 1)  # every run, warm-up included, fused its copy


def _recording(prepare, fused):
    def wrapped(prog):
        call = prepare(prog)

        def run():
            call()
            types = [op.op_type for op in prog.functions["main"].operations]
            fused.append("gelu" in types and "tanh" not in types)

        return run

    return wrapped


def test_a_missing_valgrind_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="valgrind is not on the PATH; install it"):
        instructions.count("gelu", 10, "c")
    assert instructions.main(["gelu", "10", "--runner", "c"]) == 2
