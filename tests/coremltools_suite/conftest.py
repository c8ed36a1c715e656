"""Runs coremltools' own tests of the replaced passes with our passes installed over coremltools'.

The tests and the pass id -> tests table (``PASS_TESTS``) live in ``test_coremltools_suite.py``. Here:

1. At import, ``import generic_passes``. If it fails the whole run stops: without it every test would
   pass by testing coremltools' passes against themselves. coremltools' test modules are registered for
   pytest's assertion rewriting, so a failing ``assert`` shows its operands.
2. At collection, each test of the imported classes is looked up in ``PASS_TESTS``: unlisted tests are
   deselected, listed ones remember their pass ids, and a test whose pass id is not (yet) a
   ``PassContainer`` in coremltools' ``PASS_REGISTRY`` is skipped as ``not yet generic``. A table entry
   naming a test the module does not hold, or a pass id unknown to the registry, stops the run.
3. Around each test, an autouse fixture sets ``ENABLE_EXPERIMENTAL_PASSES=1`` (``monkeypatch`` restores
   it), checks that each pass id resolves to a ``PassContainer`` with the override on, and wraps the
   coremltools pass class each container replaces: if coremltools' own pass runs during the test, the
   test fails. The containers' ``run_after`` followers (new passes of ours) are held back: the test
   asserts what its one pass does. Which of its passes ran as generic passes is read from
   ``pattern_infra.run_log``.
4. At the end, per pass id: passed, failed, skipped (by coremltools itself), not yet generic, and
   vacuous: passed without applying the pass, because coremltools' test returns early for that
   parametrization (``TestConvBiasFusion`` does, for combinations it considers invalid).

Every hook acts only on the items of this directory, so ``pytest tests`` runs the rest unchanged.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import unittest.mock
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

try:
    import generic_passes  # noqa: F401  (registers our passes over coremltools')
except ImportError as exc:  # pragma: no cover - the point is to stop loudly
    raise ImportError(
        f"tests/coremltools_suite needs `import generic_passes` to work ({exc}); without it the suite "
        f"would run coremltools' tests against coremltools' own passes. Install the project "
        f"(`make venv`) and fix the import error."
    ) from exc

from pattern_infra import ENV_VAR, PassContainer, override_enabled, run_log

HERE = Path(__file__).resolve().parent

MOCK_SHIMMED = importlib.util.find_spec("mock") is None
"""coremltools' ``test_cleanup_passes.py`` does ``from mock import patch``; the ``mock`` package is the
backport of ``unittest.mock``, which stands in for it when it is missing."""
if MOCK_SHIMMED:
    sys.modules["mock"] = unittest.mock

pytest.register_assert_rewrite(
    "coremltools.converters.mil.mil.passes.tests",
    "coremltools.converters.mil.backend.mil.passes.test_passes",
    "coremltools.converters.mil.testing_utils",
)

NOT_GENERIC = "not yet generic"
"""Start of the skip reason of a test whose pass is not a PassContainer yet."""

_PASS_IDS = pytest.StashKey[tuple[str, ...]]()
"""On an item: the pass ids its coremltools test applies."""
_ITEM_PASS_IDS = pytest.StashKey[dict[str, tuple[str, ...]]]()
"""On the config: node id -> pass ids, for every selected item of this directory."""
_GENERIC_RUNS = "generic_runs"
"""User property of a report: the item's pass ids that ran as generic passes during the test."""


def _is_generic(pass_id: str) -> bool:
    """Whether ``pass_id`` is registered as one of our ``PassContainer`` passes."""
    return isinstance(PASS_REGISTRY.passes.get(pass_id), PassContainer)


def _table_of(item: pytest.Item) -> dict[str, tuple[str, ...]] | None:
    """The ``PASS_TESTS`` table of the item's module, if the item belongs to this directory."""
    if not item.path.resolve().is_relative_to(HERE):
        return None
    module = getattr(item, "module", None)
    return getattr(module, "PASS_TESTS", None)


def _check_table(module: Any, table: dict[str, tuple[str, ...]]) -> None:
    """Stops the run if ``PASS_TESTS`` names an unknown pass id or a test the module does not hold."""
    unknown_ids = [pid for pid in table if pid not in PASS_REGISTRY]
    dangling: list[str] = []
    for key in sorted({k for tests in table.values() for k in tests}):
        cls_name, _, test_name = key.partition("::")
        cls = getattr(module, cls_name, None)
        if cls is None or (test_name and not callable(getattr(cls, test_name, None))):
            dangling.append(key)
    if unknown_ids or dangling:
        raise pytest.UsageError(
            f"{module.__file__}: PASS_TESTS is out of date: pass ids unknown to PASS_REGISTRY: "
            f"{unknown_ids}; entries naming no test of the module: {dangling}. Fix the table, or "
            f"import the missing class into the module."
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keeps the tests of ``PASS_TESTS``, tags them with their pass ids, skips the non-generic ones."""
    selected: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    item_pass_ids: dict[str, tuple[str, ...]] = {}
    checked: set[str] = set()
    for item in items:
        table = _table_of(item)
        if table is None:
            selected.append(item)
            continue
        module = item.module  # type: ignore[attr-defined]  (a Function's module)
        if module.__name__ not in checked:
            _check_table(module, table)
            checked.add(module.__name__)
        cls = item.getparent(pytest.Class)
        cls_name = cls.name if cls is not None else ""
        test_name = getattr(item, "originalname", item.name.split("[")[0])
        keys = (cls_name, f"{cls_name}::{test_name}")
        pass_ids = tuple(pid for pid, tests in table.items() if any(k in tests for k in keys))
        if not pass_ids:
            deselected.append(item)
            continue
        item.stash[_PASS_IDS] = pass_ids
        item_pass_ids[item.nodeid] = pass_ids
        expected = getattr(module, "EXPECTED_DIFFERENCES", {}).get(f"{cls_name}::{item.name}")
        if expected is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=expected))
        missing = [pid for pid in pass_ids if not _is_generic(pid)]
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"{NOT_GENERIC}: {', '.join(missing)}"))
        selected.append(item)
    if not checked:
        return
    config.stash[_ITEM_PASS_IDS] = item_pass_ids
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freezes the objects alive after collection, when this directory's tests are selected.

    ``coremltools.convert`` calls ``gc.collect()`` on every conversion, and most of these tests convert;
    with torch and coremltools' test modules loaded each collection walks millions of objects. Frozen
    objects are skipped by the collector, which cuts the suite's run time about three-fold. Objects made
    by the tests themselves are collected as usual.
    """
    if session.config.stash.get(_ITEM_PASS_IDS, None):
        gc.collect()
        gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Undoes :func:`pytest_collection_finish`."""
    if session.config.stash.get(_ITEM_PASS_IDS, None):
        gc.unfreeze()


@pytest.fixture(autouse=True)
def _our_passes_installed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs the test with our passes replacing coremltools' (``ENABLE_EXPERIMENTAL_PASSES=1``)."""
    pass_ids = request.node.stash.get(_PASS_IDS, ())
    if not pass_ids:
        yield
        return
    monkeypatch.setenv(ENV_VAR, "1")
    wrong = {pid: type(PASS_REGISTRY[pid]).__name__ for pid in pass_ids if not _is_generic(pid)}
    if wrong or not override_enabled():
        pytest.fail(
            f"{request.node.nodeid} would not test our passes: override enabled="
            f"{override_enabled()}, pass ids not resolving to a PassContainer: {wrong}."
        )
    bypassed: list[str] = []
    for pass_id in pass_ids:
        # coremltools' test applies this one pass; our new passes registered run_after it (a follower runs
        # in the leader's call, as the pipeline would run it next) are not what the test asserts on.
        monkeypatch.setattr(PASS_REGISTRY.passes[pass_id], "followers", [])
        original = PASS_REGISTRY.passes[pass_id].replaces
        if original is not None:
            monkeypatch.setattr(original, "__call__", _spy(original, pass_id, bypassed))
    run_log(clear=True)
    yield
    generic_runs = sorted({pid for pid, generic, _ in run_log() if generic and pid in pass_ids})
    request.node.user_properties.append((_GENERIC_RUNS, tuple(generic_runs)))
    if bypassed:
        pytest.fail(
            f"{request.node.nodeid}: coremltools' own pass ran instead of ours for "
            f"{sorted(set(bypassed))}; the PassContainer was bypassed."
        )


def _spy(original: type, pass_id: str, record: list[str]) -> Callable[[Any, Any], Any]:
    """A ``__call__`` for coremltools' pass class that records that it ran, then runs it."""
    call = original.__call__

    def spied_call(self: Any, prog: Any) -> Any:
        record.append(pass_id)
        return call(self, prog)

    return spied_call


VACUOUS = "vacuous"
EXPECTED = "expected difference"
"""Outcome, per pass id, of a test that passed without applying that pass."""
COLUMNS = ("passed", "failed", EXPECTED, "skipped", NOT_GENERIC, VACUOUS, "not run")
"""Columns of the summary, in order."""


def _outcomes(
    reporter: pytest.TerminalReporter, item_pass_ids: dict[str, tuple[str, ...]]
) -> dict[str, dict[str, str]]:
    """Outcome per node id and pass id: failed (any phase) > skipped > vacuous / passed."""
    state: dict[str, str] = {}
    generic_runs: dict[str, tuple[str, ...]] = {}
    rank = {"passed": 0, "skipped": 1, NOT_GENERIC: 1, EXPECTED: 1, "failed": 2}
    for reports in reporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport) or report.nodeid not in item_pass_ids:
                continue
            for key, value in report.user_properties:
                if key == _GENERIC_RUNS:
                    generic_runs[report.nodeid] = value
            if report.failed:
                new = "failed"
            elif report.skipped and hasattr(report, "wasxfail"):
                new = EXPECTED
            elif report.skipped:
                new = NOT_GENERIC if NOT_GENERIC in str(report.longrepr) else "skipped"
            elif report.when == "call":
                new = "passed"
            else:
                continue
            if rank[new] >= rank[state.get(report.nodeid, "passed")]:
                state[report.nodeid] = new
    outcomes: dict[str, dict[str, str]] = {}
    for nodeid, pass_ids in item_pass_ids.items():
        final = state.get(nodeid, "not run")
        ran = generic_runs.get(nodeid, ())
        outcomes[nodeid] = {
            pid: VACUOUS if final == "passed" and pid not in ran else final for pid in pass_ids
        }
    return outcomes


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Prints the outcomes of coremltools' tests per pass id."""
    item_pass_ids = config.stash.get(_ITEM_PASS_IDS, None)
    if not item_pass_ids:
        return
    outcomes = _outcomes(terminalreporter, item_pass_ids)
    pass_ids = sorted({pid for ids in item_pass_ids.values() for pid in ids})
    counts: dict[str, Counter[str]] = {pid: Counter() for pid in pass_ids}
    for per_pass in outcomes.values():
        for pass_id, outcome in per_pass.items():
            counts[pass_id][outcome] += 1
    write = terminalreporter.write_line
    terminalreporter.section("coremltools' tests per pass id (our passes installed)")
    write(f"{'pass id':<40}{'tests':>7}" + "".join(f"{c:>{len(c) + 2}}" for c in COLUMNS))
    for pass_id, row in counts.items():
        cells = "".join(f"{row[c]:>{len(c) + 2}}" for c in COLUMNS)
        write(f"{pass_id:<40}{sum(row.values()):>7}{cells}")
    write(
        f"{len(item_pass_ids)} tests (a test applying two passes counts under both). skipped: by "
        f"coremltools itself (prediction needs macOS, target unsupported); {VACUOUS}: passed without "
        f"applying the pass (coremltools' test returns early for that parametrization); {EXPECTED}: "
        f"a deliberate difference, listed with its reason in EXPECTED_DIFFERENCES."
    )
    if MOCK_SHIMMED:
        write("note: package 'mock' is not installed; unittest.mock stood in for it.")
