"""The four ways of applying a fusion that the benchmark puts side by side, and how each is timed.

For one workload (a chain of N copies of a pattern) the runners are:

(a) ``coremltools``: coremltools' hand-written pass class, an instance called on the program (override
    off), e.g. ``fuse_gelu_tanh_approximation()(prog)``;
(b) ``ct-generic``: coremltools' own generic infrastructure,
    ``experimental.passes.generic_pass_infrastructure.fuse_all_blocks``, with coremltools' own patterns
    and callbacks, where it still runs;
(c) ``ours``: the project's ``PassContainer`` registered under the same id, with the override on;
(d) ``floor``: the rewrite alone. The matches are found before the clock starts; timed is only what any
    rewriter must do per match: build the replacement op(s), redirect the uses of the old output
    (``replace_uses_of_var_after_op`` anchored at the old output's op) and remove the old ops (one
    ``remove_ops`` per match), inside one ``with block`` per block.

Each timed run gets a fresh ``copy.deepcopy`` of the same program (copied before the clock starts), and
``gc.collect()`` runs before the clock starts so no run pays for garbage left by another. A runner's
time is the best of its repeats (wall time, ``time.perf_counter``); the CPU time of the benchmark thread
(``time.thread_time``) is recorded beside it, because on a shared machine wall time also measures
the other processes.

The builder names unnamed ops from a process-wide counter (``mb.name_count``: ``const_0``,
``const_1``...). It is put back to the same state before every run, so that runners that build the same
ops print the same program.
"""

from __future__ import annotations

import copy
import gc
import importlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Operation, Program
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from coremltools.converters.mil.mil.scope import ScopeInfo, ScopeSource

from pattern_infra import ConstRule, PassContainer, SubPass, find_matches, override, remove_dead_ops
from pattern_infra.authoring.find import find_in_program
from pattern_infra.rewriting.blocks import walk_blocks

__all__ = [
    "RUNNER_KEYS",
    "RUNNER_LABELS",
    "Runner",
    "Timing",
    "coremltools_generic_module",
    "name_counter_state",
    "op_type_counts",
    "override",
    "time_runner",
    "workload_runners",
]

logger = logging.getLogger(__name__)

RUNNER_KEYS = ("a", "b", "c", "d")
"""Runner keys, in table order."""

RUNNER_LABELS = {
    "a": "coremltools pass",
    "b": "coremltools generic",
    "c": "ours",
    "d": "rewrite floor",
}
"""What each runner key stands for."""

Prepare = Callable[[Program], Callable[[], Any]]
"""Given the program copy to rewrite, does the untimed set-up and returns the timed call."""


@dataclass
class Runner:
    """One way of applying a fusion to a program."""

    key: str
    """``a``, ``b``, ``c`` or ``d``."""
    prepare: Prepare | None
    """Untimed set-up on the copy; returns the timed call. None: the runner cannot run here."""
    unavailable: str = ""
    """Why ``prepare`` is None."""
    container: PassContainer | None = None
    """For (c): the pass, whose sub-passes' counters the benchmark reads."""


@dataclass
class Timing:
    """The outcome of one runner on one program."""

    seconds: float | None = None
    """Best time over the repeats; None when it did not run."""
    repeats: int = 0
    """Timed runs done."""
    all_seconds: list[float] = field(default_factory=list)
    """Every timed run."""
    cpu_seconds: float | None = None
    """Best CPU time of the benchmark thread over the repeats."""
    note: str = ""
    """Why it did not run (skipped, unavailable, failed)."""
    program: Program | None = None
    """The program after the last run (for the equality checks)."""


def _pass_scope(name: str) -> Any:
    """The scope coremltools' passes run under, so every runner builds ops with the same scope info."""
    return mb.scope(ScopeInfo(source=ScopeSource.COREMLTOOLS_GRAPH_PASS, data=[name]))


def op_type_counts(prog: Program) -> Counter[str]:
    """Op types over every block, nested ones included, ``const`` ops excluded."""
    return Counter(op.op_type for _, ops in walk_blocks(prog) for op in ops if op.op_type != "const")


def name_counter_state() -> dict[str, int]:
    """A copy of the builder's counter of generated op names."""
    return dict(mb.name_count)


def _restore_name_counter(state: dict[str, int]) -> None:
    mb.name_count.clear()
    mb.name_count.update(state)


def time_runner(
    runner: Runner,
    prog: Program,
    max_repeats: int,
    budget_seconds: float,
    names: dict[str, int] | None = None,
) -> Timing:
    """Times ``runner`` on fresh deep copies of ``prog``: best of up to ``max_repeats`` runs.

    Repeats stop early once the timed runs together exceed ``budget_seconds`` (at least one run).

    Args:
        runner: The runner.
        prog: The program; never changed.
        max_repeats: Upper bound on timed runs.
        budget_seconds: Stop repeating after this much timed work.
        names: State of the builder's name counter to start every run from (see the module docstring).

    Returns:
        The timing, with the program of the last run. A runner that raises gets a note and no time.
    """
    timing = Timing()
    if runner.prepare is None:
        timing.note = runner.unavailable
        return timing
    spent = 0.0
    cpu: list[float] = []
    while timing.repeats < max_repeats and (timing.repeats == 0 or spent < budget_seconds):
        work = copy.deepcopy(prog)
        try:
            if names is not None:
                _restore_name_counter(names)
            call = runner.prepare(work)
            gc.collect()
            cpu_start = time.thread_time()
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            cpu.append(time.thread_time() - cpu_start)
        except Exception as exc:  # a runner that breaks is reported, not fatal to the benchmark
            logger.debug("runner %s failed", runner.key, exc_info=True)
            timing.note = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            timing.seconds = None
            timing.program = None
            return timing
        timing.repeats += 1
        timing.all_seconds.append(elapsed)
        spent += elapsed
        timing.program = work
    timing.seconds = min(timing.all_seconds)
    timing.cpu_seconds = min(cpu)
    return timing


# ------------------------------------------------------------------------------------------------------
# coremltools' experimental generic passes: imported once, without touching the pass registry.
# ------------------------------------------------------------------------------------------------------

_CT_GENERIC = "coremltools.converters.mil.experimental.passes."
_CT_MODULES: dict[str, ModuleType | str] = {}


def coremltools_generic_module(name: str) -> ModuleType | str:
    """One of coremltools' experimental generic pass modules, or why it cannot be imported.

    Those modules define their patterns only when ``ENABLE_EXPERIMENTAL_PASSES=1`` at import time, and
    then also register them over coremltools' own passes in ``PASS_REGISTRY``. The registry is saved
    before the import and put back after it, so nothing but this benchmark sees them.

    Args:
        name: Module name under ``coremltools.converters.mil.experimental.passes``.

    Returns:
        The module, or a one-line reason when importing it fails.
    """
    if name in _CT_MODULES:
        return _CT_MODULES[name]
    saved = dict(PASS_REGISTRY.passes)
    try:
        with override(True):
            result: ModuleType | str = importlib.import_module(_CT_GENERIC + name)
    except Exception as exc:  # coremltools' own module is broken: report it, as a finding
        first_line = str(exc).split("\n")[0][:200]
        result = f"n/a: coremltools' {name} fails to import ({type(exc).__name__}: {first_line})"
    finally:
        PASS_REGISTRY.passes.clear()
        PASS_REGISTRY.passes.update(saved)
    _CT_MODULES[name] = result
    return result


# ------------------------------------------------------------------------------------------------------
# Runners per workload.
# ------------------------------------------------------------------------------------------------------


def _pass_class_runner(pass_class: type) -> Runner:
    def prepare(prog: Program) -> Callable[[], Any]:
        instance = pass_class()
        return lambda: instance(prog)

    return Runner("a", prepare)


def _ct_generic_runner(module_name: str, patterns: list[tuple[str, str, str]], scope: str) -> Runner:
    """(b): ``fuse_all_blocks`` once per (pattern, constraints, transform) attribute-name triple."""
    module = coremltools_generic_module(module_name)
    if isinstance(module, str):
        return Runner("b", None, module)
    from coremltools.converters.mil.experimental.passes.generic_pass_infrastructure import fuse_all_blocks

    triples = [tuple(getattr(module, attr) for attr in names) for names in patterns]

    def prepare(prog: Program) -> Callable[[], Any]:
        def run() -> None:
            with _pass_scope(scope):
                for pattern, constraints, transform in triples:
                    fuse_all_blocks(pattern, constraints, transform, prog)

        return run

    return Runner("b", prepare)


def generic_container(pass_id: str) -> PassContainer | str:
    """Our pass registered under ``pass_id``, or why it is not benchmarked yet."""
    import generic_passes  # noqa: F401  registers the project's passes

    current = PASS_REGISTRY.passes.get(pass_id)
    if isinstance(current, PassContainer):
        return current
    module = pass_id.split("::")[-1]
    return (
        f"skipped: {pass_id} is not yet a generic PassContainer (generic_passes/{module}.py is not "
        f"there or registers nothing yet); rerun `make bench` once it is"
    )


def _ours_runner(container: PassContainer) -> Runner:
    def prepare(prog: Program) -> Callable[[], Any]:
        def run() -> None:
            with override(True):
                container(prog)

        return run

    return Runner("c", prepare, container=container)


def _gelu_floor_runner() -> Runner:
    """(d) for GELU: exactly what coremltools' and our transform do, per match, with no search."""
    from generic_passes.fuse_gelu_tanh_approximation import gelu_tanh_pattern_1, gelu_tanh_pattern_2

    rule = ConstRule("value", rtol=0.0, atol=1e-3)

    def prepare(prog: Program) -> Callable[[], Any]:
        plan: dict[int, tuple[Block, list[tuple[Any, Operation, Operation, list[Operation]]]]] = {}
        for pattern in (gelu_tanh_pattern_1, gelu_tanh_pattern_2):
            for match in find_matches(pattern, prog, constants=rule):
                entry = plan.setdefault(id(match.block), (match.block, []))
                entry[1].append((match.root_var, match.mul, match.mul_3, match.op_list()))

        def run() -> None:
            with _pass_scope("fuse_gelu_tanh_approximation"):
                for block, items in plan.values():
                    with block:
                        for root, before, last, ops in items:
                            old = last.outputs[0]
                            gelu = mb.gelu(x=root, mode="TANH_APPROXIMATION", name=old.name, before_op=before)
                            block.replace_uses_of_var_after_op(anchor_op=old.op, old_var=old, new_var=gelu)
                            block.remove_ops(ops)

        return run

    return Runner("d", prepare)


def _generic_floor_runner(container: PassContainer) -> Runner:
    """(d) for a pass whose replacement is not spelled out here: its own transform on known matches.

    The matches of every sub-pass are found (and accepted by ``var_constraints``) before the clock
    starts; timed are the transforms and one ``remove_ops`` of the dead matched ops per match.
    """
    subs = [p for p in container.passes if isinstance(p, SubPass)]

    def prepare(prog: Program) -> Callable[[], Any]:
        plan: dict[int, tuple[Block, list[tuple[SubPass, Any]]]] = {}
        for sub in subs:
            for match in find_in_program(prog, sub.matcher, sub.var_constraints):
                plan.setdefault(id(match.block), (match.block, []))[1].append((sub, match))

        def run() -> None:
            with _pass_scope(container.pass_name):
                for block, items in plan.values():
                    with block:
                        for sub, match in items:
                            if any(op.enclosing_block is not block for op in match.op_set):
                                continue  # an earlier match of another sub-pass took these ops
                            if sub.transform_pattern(match) is not False:
                                remove_dead_ops(match)

        return run

    return Runner("d", prepare)


@dataclass
class WorkloadRunners:
    """The runners of one workload, or why the workload is skipped as a whole."""

    runners: dict[str, Runner]
    """By key."""
    skipped: str = ""
    """Non-empty: the workload is not benchmarked, and this says why."""


def workload_runners(workload: str) -> WorkloadRunners:
    """The four runners for ``workload`` (``gelu``, ``layernorm`` or ``conv_bn``).

    Raises:
        ValueError: Unknown workload name.
    """
    from coremltools.converters.mil.mil.passes.defs import (
        optimize_activation,
        optimize_conv,
        optimize_normalization,
    )

    if workload == "gelu":
        pass_id = "common::fuse_gelu_tanh_approximation"
        cls = optimize_activation.fuse_gelu_tanh_approximation
        a = _pass_class_runner(cls)
        b = _gelu_ct_generic_runner(cls, (cls.get_gelu_pattern1(), cls.get_gelu_pattern2()))
    elif workload == "layernorm":
        pass_id = "common::fuse_layernorm_or_instancenorm"
        a = _pass_class_runner(optimize_normalization.fuse_layernorm_or_instancenorm)
        b = _ct_generic_runner(
            "generic_layernorm_instancenorm_pattern_fusion",
            [("instancenorm_or_layernorm", "layernorm_1_constraints", "transform_pattern")],
            "fuse_layernorm_or_instancenorm",
        )
    elif workload == "conv_bn":
        pass_id = "common::fuse_conv_batchnorm"
        a = _pass_class_runner(optimize_conv.fuse_conv_batchnorm)
        b = _ct_generic_runner(
            "generic_conv_batchnorm_fusion",
            [
                ("conv_batchnorm", "var_constraints", "transform_pattern"),
                ("conv_transpose_batchorm", "var_constraints", "transform_pattern"),
            ],
            "fuse_conv_batchnorm",
        )
    else:
        raise ValueError(f"unknown workload {workload!r}; use 'gelu', 'layernorm' or 'conv_bn'")
    container = generic_container(pass_id)
    if isinstance(container, str):
        return WorkloadRunners({"a": a, "b": b}, skipped=container)
    d = _gelu_floor_runner() if workload == "gelu" else _generic_floor_runner(container)
    return WorkloadRunners({"a": a, "b": b, "c": _ours_runner(container), "d": d})


def _gelu_ct_generic_runner(cls: type, patterns: tuple[Program, Program]) -> Runner:
    """(b) for GELU: coremltools' patterns and callbacks are static methods of its pass class."""
    from coremltools.converters.mil.experimental.passes.generic_pass_infrastructure import fuse_all_blocks

    def prepare(prog: Program) -> Callable[[], Any]:
        def run() -> None:
            with _pass_scope("fuse_gelu_tanh_approximation"):
                for pattern in patterns:
                    fuse_all_blocks(pattern, cls.is_var_constraint_satisifed, cls.transform_pattern, prog)

        return run

    return Runner("b", prepare)
