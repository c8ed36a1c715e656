"""Runs of passes as single pipeline entries: :func:`pipeline`, for ``coremltools.convert``.

coremltools' ``PassPipelineManager.apply_pipeline`` validates the whole program after every entry of a
pipeline: 112 validations in a ``convert`` to mlprogram, nearly half of its CPU time at 10k-50k ops. In the
default pipeline with the override on, 22 of the entries are generic passes, in 7 runs of consecutive
ones. :func:`pipeline` returns the default pipeline with runs of passes replaced by one
:class:`GenericSweep` entry each: either every run of consecutive generic passes (``group="generic"``:
their sub-passes, ``run_after`` followers included, applied in one
:func:`~pattern_infra.driver.run_subpasses` call, one walk and index of the program, one undo journal,
one validation), or, by default, every run of passes between the entries ``convert`` itself must find
by id (``group="all"``: coremltools' passes inside a sweep run back to back, the program validated once
after the sweep). Every rewrite of ours is still validated as it happens (the driver's own check).

The result is the same program as the pass-by-pass pipeline with the override on: the passes run in
the same order, and each rewrite's ops carry the scope of the pass they belong to. Each generic pass's
counters and ``run_log()`` entry are kept per pass, as when it runs alone.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass, PassOption
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from coremltools.converters.mil.mil.scope import ScopeInfo, ScopeSource

from .driver import PassStats, SubPass, run_subpasses
from .errors import PassRegistrationError
from .registry import PassContainer

__all__ = ["SWEEP_NAMESPACE", "GenericSweep", "pipeline"]

logger = logging.getLogger(__name__)

SWEEP_NAMESPACE = "pattern_infra"
"""Namespace of the :class:`GenericSweep` entries :func:`pipeline` registers."""


class GenericSweep(AbstractGraphPass):
    """A graph pass applying several passes in one pipeline entry, in the order given.

    Consecutive generic passes run as one :func:`~pattern_infra.driver.run_subpasses` call (their
    ``run_after`` followers right after them); any other pass id runs as coremltools' pipeline runs it
    (``PASS_REGISTRY[id]``, its options set), without a whole-program validation after it: the pipeline
    validates once the sweep returns. After ``common::dead_code_elimination`` the sweep checks, as
    coremltools' pipeline does, that no op lost its essential scopes. Unlike a :class:`PassContainer`
    replacing a coremltools pass, a sweep runs the generic sub-passes whatever
    ``ENABLE_EXPERIMENTAL_PASSES`` says: choosing :func:`pipeline` is choosing them.
    """

    def __init__(self, pass_ids: Sequence[str], options: Mapping[str, list[PassOption]] | None = None) -> None:
        """Creates the sweep.

        Args:
            pass_ids: Registered pass ids, in run order.
            options: Options per pass id (a generic pass takes only the options it declares).

        Raises:
            PassRegistrationError: An id is not registered, or a generic pass is given options it does
                not declare.
        """
        options = dict(options or {})
        self.steps: list[PassContainer | str] = []
        """Each pass: the generic pass itself, or the id of a pass to look up when it runs."""
        for pass_id in pass_ids:
            entry = PASS_REGISTRY.passes.get(pass_id)
            if entry is None:
                raise PassRegistrationError(
                    f"GenericSweep: {pass_id!r} is not a registered pass; `import generic_passes` (or "
                    f"register it) first, or leave it out of the sweep."
                )
            undeclared = [
                o.option_name for o in options.get(pass_id) or [] if o.option_name not in entry.options
            ] if isinstance(entry, PassContainer) else []
            if undeclared:
                raise PassRegistrationError(
                    f"GenericSweep: options {undeclared} are set for the generic pass {pass_id!r}, which "
                    f"does not declare them; declare them (register_generic_pass(..., options=...)) or "
                    f"leave them out of the pipeline."
                )
            self.steps.append(entry if isinstance(entry, PassContainer) else pass_id)
        self.pass_ids = tuple(pass_ids)
        self.options = {k: list(v) for k, v in options.items() if v and k in self.pass_ids}
        """Options of the passes, by id (a generic pass's only those it declares)."""
        self.stats = PassStats()
        """Counters of every run of the generic passes, summed."""

    @property
    def pass_id(self) -> str:
        """The id :func:`pipeline` registers this sweep under: its first and last passes and a digest
        of all of them (two sweeps with the same passes share it)."""
        names = [i.split("::", 1)[-1] for i in self.pass_ids]
        digest = hashlib.sha1(repr((self.pass_ids, sorted(self.options.items(), key=str))).encode()).hexdigest()
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        return f"{SWEEP_NAMESPACE}::sweep[{span}]#{digest[:8]}"

    def containers(self) -> list[PassContainer]:
        """The generic passes in run order, each followed by its ``run_after`` followers."""
        return [container for step in self.steps if isinstance(step, PassContainer) for container in _with_followers(step)]

    def set_options(self, pass_options: list[PassOption] | None = None) -> None:
        """A sweep takes no options (coremltools passes None when the pipeline sets none)."""
        if pass_options:
            raise NotImplementedError(
                f"The graph pass `{self.pass_id}` takes no options; set the options of its passes before "
                f"calling pattern_infra.pipeline()."
            )

    def __call__(self, prog: Program) -> None:
        """Runs :meth:`apply` outside any scope of its own (``AbstractGraphPass.__call__`` would open
        one for the sweep): each op created carries its own pass's scope only."""
        if not getattr(prog, "skip_all_passes", False):
            self.apply(prog)

    def apply(self, prog: Program) -> None:
        """Applies every pass of the sweep to ``prog``, in order; consecutive generic sub-passes in as
        few runs as possible (a seed-style callable sub-pass, or a change of ``validate`` setting,
        splits a run)."""
        plan: list[tuple[PassContainer, Any]] = []
        for step in [*self.steps, None]:
            if isinstance(step, PassContainer):
                plan += [
                    (container, sub)
                    for container in _with_followers(step)
                    for sub in _fresh(container, self.options.get(container.pass_id))
                ]
                continue
            self._run_generic(prog, plan)
            plan = []
            if step is not None:
                graph_pass = PASS_REGISTRY[step]
                graph_pass.set_options(self.options.get(step))
                graph_pass(prog)
                if step == _DEAD_CODE_ELIMINATION:
                    for function in prog.functions.values():
                        function._check_has_scope_info()  # what apply_pipeline checks after this pass

    def _run_generic(self, prog: Program, plan: list[tuple[PassContainer, Any]]) -> None:
        for segment in _segments(plan):
            container, first = segment[0]
            if not isinstance(first, SubPass):
                # a plain graph pass: in its own pass's scope, as when it runs alone (run_alone)
                with mb.scope(ScopeInfo(source=ScopeSource.COREMLTOOLS_GRAPH_PASS, data=[str(container)])):
                    container.apply_callable(prog, first)
                container.record(PassStats())
                continue
            before = {id(sub): _snapshot(sub.stats) for _, sub in segment}
            with _scoped_transforms(segment):
                # each pass reaches its own fixpoint before the next starts, as when they run one by one
                owners = {id(owner): k for k, (owner, _) in enumerate(segment)}
                stats = run_subpasses(prog, [sub for _, sub in segment], self.pass_id, validate=container.validate,
                                      passes=[owners[id(owner)] for owner, _ in segment])
            self.stats.add(stats)
            _record_per_pass(segment, before)

    def __str__(self) -> str:
        return self.pass_id

    def __repr__(self) -> str:
        return f"GenericSweep({list(self.pass_ids)!r})"


_DEAD_CODE_ELIMINATION = "common::dead_code_elimination"


def _with_followers(container: PassContainer) -> list[PassContainer]:
    """``container`` then its ``run_after`` followers (and theirs), in registration order."""
    order = [container]
    for follower in container.followers:
        order += _with_followers(follower)
    return order


def _fresh(container: PassContainer, options: list[PassOption] | None) -> list[SubPass | Callable[[Program], Any]]:
    """The container's sub-passes, its options set (or reset) as coremltools' pipeline sets them."""
    container.set_options(options)
    return list(container.passes)


def _segments(
    plan: list[tuple[PassContainer, SubPass | Callable[[Program], Any]]],
) -> Iterator[list[tuple[PassContainer, Any]]]:
    """Runs of consecutive structured sub-passes sharing a ``validate`` setting; a callable alone."""
    segment: list[tuple[PassContainer, Any]] = []
    for container, sub in plan:
        joins = (
            isinstance(sub, SubPass)
            and segment
            and isinstance(segment[0][1], SubPass)
            and segment[0][0].validate == container.validate
        )
        if segment and not joins:
            yield segment
            segment = []
        segment.append((container, sub))
    if segment:
        yield segment


@contextmanager
def _scoped_transforms(segment: list[tuple[PassContainer, SubPass]]) -> Iterator[None]:
    """Runs each sub-pass's transform inside its pass's graph-pass scope, as ``PassContainer.__call__``
    does for the whole pass: the ops a rewrite creates carry the same scope as pass by pass."""
    saved: dict[int, tuple[SubPass, Any]] = {}
    for container, sub in segment:
        if id(sub) in saved:
            continue
        saved[id(sub)] = (sub, sub.transform_pattern)
        sub.transform_pattern = _in_scope(sub.transform_pattern, str(container))
    try:
        yield
    finally:
        for sub, transform in saved.values():
            sub.transform_pattern = transform


def _in_scope(transform: Callable[[Any], Any], pass_name: str) -> Callable[[Any], Any]:
    scope = ScopeInfo(source=ScopeSource.COREMLTOOLS_GRAPH_PASS, data=[pass_name])

    def scoped(match: Any) -> Any:
        with mb.scope(scope):
            return transform(match)

    return scoped


def _record_per_pass(segment: list[tuple[PassContainer, SubPass]], before: dict[int, PassStats]) -> None:
    """Each pass's share of a run, into its counters and ``run_log()``: one entry per pass, even when
    the sweep runs it twice (``fuse_conv_scale`` and two others appear twice in a row of the default
    pipeline)."""
    subs_of: dict[int, tuple[PassContainer, dict[int, SubPass]]] = {}
    for container, sub in segment:
        subs_of.setdefault(id(container), (container, {}))[1][id(sub)] = sub
    for container, subs in subs_of.values():
        stats = PassStats()
        for sub in subs.values():
            stats.add(_difference(sub.stats, before[id(sub)]))
        container.record(stats)


def _snapshot(stats: PassStats) -> PassStats:
    """A copy of ``stats`` sharing no mutable counter with it."""
    copy = PassStats()
    copy.add(stats)
    return copy


def _difference(after: PassStats, before: PassStats) -> PassStats:
    return PassStats(**{name: getattr(after, name) - getattr(before, name) for name in PassStats.__dataclass_fields__})


Grouping = Literal["all", "generic"]


def pipeline(base: PassPipeline | None = None, *, group: Grouping = "all") -> PassPipeline:
    """A copy of a coremltools pipeline in which runs of passes are single entries (sweeps).

    Pass the result to ``coremltools.convert(..., pass_pipeline=pattern_infra.pipeline())``. It gives
    the same program as ``base`` with ``ENABLE_EXPERIMENTAL_PASSES=1``: the same passes in the same
    order (each run of generic passes applied in one sweep), with fewer whole-program validations
    (coremltools validates after every entry: nearly half of a conversion's CPU time). The generic passes
    of the sweeps run whatever the variable says; the variable still decides for generic passes outside
    them (the backend's ``mil_backend::fuse_activation_silu`` and ``fuse_pow2_sqrt``, which ``convert``
    runs after the main pipeline). Call it once per conversion: ``convert`` edits the pipeline it gets.

    Args:
        base: The pipeline to copy (default: ``PassPipeline.DEFAULT``).
        group: ``"all"`` (default): every run of passes between the entries ``convert`` must find by id
            is one entry: ``add_fp16_cast`` and ``add_int16_cast`` (``convert`` removes them or sets
            their options), and one entry of each pass the frontend and backend pipelines share with
            ``base`` (``convert`` drops those from the other pipelines when the main one lacks them;
            generic ones too, ``const_elimination`` and ``dead_code_elimination``, whose own entries
            then follow ``ENABLE_EXPERIMENTAL_PASSES``).
            The program is validated after each entry and each rewrite of ours, not after each of
            coremltools' passes inside a sweep. ``"generic"``: only runs of consecutive generic passes
            are grouped; coremltools' passes keep their entries and their validations.

    Returns:
        A new ``PassPipeline`` named ``"pattern_infra"``.

    Raises:
        PassRegistrationError: ``base`` sets options a generic pass does not declare, or ``group`` is
            unknown.
    """
    if group not in ("all", "generic"):
        raise PassRegistrationError(f"pattern_infra.pipeline(): group must be 'all' or 'generic', got {group!r}.")
    base = PassPipeline.DEFAULT if base is None else base
    options = base.get_all_options()
    kept = _ids_convert_looks_up(base)
    entries: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            sweep = GenericSweep(run, options)
            PASS_REGISTRY.passes[sweep.pass_id] = sweep
            entries.append(sweep.pass_id)
            run.clear()

    for pass_id in base.passes:
        generic = isinstance(PASS_REGISTRY.passes.get(pass_id), PassContainer)
        looked_up = pass_id in kept  # its first entry, a generic one too (const_elimination, ...)
        if not looked_up and (generic or (group == "all" and pass_id not in _EDITED_BY_CONVERT)):
            run.append(pass_id)
        else:
            kept.discard(pass_id)  # one entry is enough for convert to find it
            flush()
            entries.append(pass_id)
    flush()
    result = PassPipeline(entries, pipeline_name="pattern_infra")
    for pass_id, pass_options in options.items():
        if pass_id in entries:
            result._pass_options[pass_id] = list(pass_options)
    return result


_EDITED_BY_CONVERT = ("common::add_fp16_cast", "common::add_int16_cast")


def _ids_convert_looks_up(base: PassPipeline) -> set[str]:
    """Pass ids of ``base`` that ``convert`` looks for in the main pipeline: the two it edits, and those
    of the frontend and backend pipelines (it removes from them what the main pipeline lacks)."""
    ids = set(_EDITED_BY_CONVERT)
    for name in PassPipeline.list_available_pipelines():
        if name.startswith(("frontend_", "backend_")):
            ids.update(PassPipeline.get_pipeline(name).passes)
    return ids & set(base.passes)
