"""Every example script runs and its own checks pass (each exits non-zero when a check fails).

Each script runs as ``python examples/NN_name.py`` would, in its own process forked from an interpreter
that has imported coremltools and torch once (``tests/forked.py``).
"""

from __future__ import annotations

from pathlib import Path

import forked
import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("[0-9]*.py"))


def test_the_examples_are_found():
    assert len(EXAMPLES) >= 15


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script):
    done = forked.run([str(script)], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip(), "an example must print what it shows"


def test_the_demo_times_both_conversions_warm(monkeypatch):
    """``make demo`` converts once, untimed, before timing a conversion without and one with the
    override: otherwise the first one timed pays for the process's cold start and the two compare unlike."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location(
        "demo", Path(__file__).parent.parent / "examples" / "demo.py"
    )
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    events = []

    class Done(Exception):
        pass

    def convert(model, args, *, override):
        events.append(("convert", override))
        return object()

    def counts(prog):
        raise Done

    monkeypatch.setattr(demo, "convert_torch", convert)
    monkeypatch.setattr(demo, "op_counts", counts)
    monkeypatch.setattr(
        demo, "time", types.SimpleNamespace(perf_counter=lambda: events.append(("clock",)) or 0.0)
    )
    with pytest.raises(Done):
        demo.main()
    assert events[0][0] == "convert"  # a warm-up conversion before the first clock reading
    timed = events[events.index(("clock",)) :]
    assert timed == [("clock",), ("convert", False), ("clock",), ("clock",), ("convert", True), ("clock",)]
