"""One pipeline entry per run of consecutive generic passes: :func:`pipeline` for ``coremltools.convert``.

coremltools' ``PassPipelineManager.apply_pipeline`` validates the whole program after every entry of a
pipeline (about 2 s per validation at 100k ops). In the default pipeline with the override on, 22 of the
entries are generic passes, in 6 runs of consecutive ones (``fuse_matmul_weight_bias`` to
``fuse_leaky_relu``, ``fuse_squeeze_expand_dims``, ``fuse_pad_conv``, ``fuse_conv_scale`` to
``fuse_conv_batchnorm``, ``fuse_prelu`` to ``merge_consecutive_relus``, ``fuse_transpose_matmul``, and
``fuse_transpose_matmul`` again in the cleanup). :func:`pipeline` returns the default pipeline with each
such run replaced by one :class:`GenericSweep` entry, which applies the sub-passes of all of its passes
(their ``run_after`` followers included, right after their leader) in one
:func:`~pattern_infra.driver.run_subpasses` call: one walk and index of the program, one undo journal,
and one whole-program validation by coremltools after it instead of one per pass. Every rewrite is
still validated as it happens (the driver's own check), and coremltools' passes keep their entries and
their validations.

The result is the same program as the pass-by-pass pipeline with the override on: the sub-passes run
in the same order, and each rewrite's ops carry the scope of the pass they belong to. Each pass's
counters and ``run_log()`` entry are kept per pass, as when it runs alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

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
    """A graph pass applying several generic passes in one sweep, in the order given.

    Unlike a :class:`PassContainer` that replaces a coremltools pass, a sweep runs the generic
    sub-passes whatever ``ENABLE_EXPERIMENTAL_PASSES`` says: choosing :func:`pipeline` is choosing them.
    """

    def __init__(self, pass_ids: Sequence[str]) -> None:
        """Creates the sweep.

        Args:
            pass_ids: Ids of registered generic passes (:class:`PassContainer`), in run order.

        Raises:
            PassRegistrationError: An id names no generic pass.
        """
        for pass_id in pass_ids:
            if not isinstance(PASS_REGISTRY.passes.get(pass_id), PassContainer):
                raise PassRegistrationError(
                    f"GenericSweep: {pass_id!r} is not a registered generic pass; `import generic_passes` "
                    f"(or register it) first, or leave it out of the sweep."
                )
        self.pass_ids = tuple(pass_ids)
        self.stats = PassStats()
        """Counters of every run, summed over the passes."""

    @property
    def pass_id(self) -> str:
        """The id :func:`pipeline` registers this sweep under."""
        return f"{SWEEP_NAMESPACE}::sweep({','.join(i.split('::', 1)[1] for i in self.pass_ids)})"

    def containers(self) -> list[PassContainer]:
        """The passes in run order, each generic pass followed by its ``run_after`` followers."""
        order: list[PassContainer] = []

        def add(container: PassContainer) -> None:
            order.append(container)
            for follower in container.followers:
                add(follower)

        for pass_id in self.pass_ids:
            add(PASS_REGISTRY.passes[pass_id])
        return order

    def set_options(self, pass_options: list[PassOption] | None = None) -> None:
        """A sweep takes no options (coremltools passes None when the pipeline sets none)."""
        if pass_options:
            raise NotImplementedError(
                f"The graph pass `{self.pass_id}` takes no options; set the options of its passes before "
                f"calling pattern_infra.pipeline(), or leave those passes out of the sweep."
            )

    def __call__(self, prog: Program) -> None:
        """Runs :meth:`apply` outside any scope of its own (``AbstractGraphPass.__call__`` would open
        one for the sweep): each rewrite's ops carry their own pass's scope only."""
        if not getattr(prog, "skip_all_passes", False):
            self.apply(prog)

    def apply(self, prog: Program) -> None:
        """Applies every pass of the sweep to ``prog``, each sub-pass in order, in as few runs as
        possible (a seed-style callable sub-pass, or a change of ``validate`` setting, splits a run)."""
        plan = [(container, sub) for container in self.containers() for sub in _fresh(container)]
        for segment in _segments(plan):
            container, first = segment[0]
            if not isinstance(first, SubPass):
                container.apply_callable(prog, first)
                continue
            before = {id(sub): dataclasses.replace(sub.stats) for _, sub in segment}
            with _scoped_transforms(segment):
                stats = run_subpasses(
                    prog, [sub for _, sub in segment], self.pass_id, validate=container.validate
                )
            self.stats.add(stats)
            _record_per_pass(segment, before)

    def __str__(self) -> str:
        return self.pass_id

    def __repr__(self) -> str:
        return f"GenericSweep({list(self.pass_ids)!r})"


def _fresh(container: PassContainer) -> list[SubPass | Callable[[Program], Any]]:
    """The container's sub-passes, its options reset as coremltools' pipeline resets them."""
    container.set_options(None)
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


def _difference(after: PassStats, before: PassStats) -> PassStats:
    return PassStats(**{name: getattr(after, name) - getattr(before, name) for name in PassStats.__dataclass_fields__})


def pipeline(base: PassPipeline | None = None) -> PassPipeline:
    """A copy of a coremltools pipeline in which each run of consecutive generic passes is one entry.

    Pass the result to ``coremltools.convert(..., pass_pipeline=pattern_infra.pipeline())``. It gives
    the same program as ``base`` with ``ENABLE_EXPERIMENTAL_PASSES=1``, with one whole-program
    validation per run of generic passes instead of one per pass. The generic passes of the sweeps run
    whatever the variable says; the variable still decides for passes outside them (the backend's
    ``mil_backend::fuse_activation_silu`` and ``fuse_pow2_sqrt``, which ``convert`` runs after the main
    pipeline). coremltools' passes keep their entries, their options and their order, so ``convert``
    can still remove ``add_fp16_cast`` or set its options. Call it once per conversion: ``convert``
    edits the pipeline it is given.

    Args:
        base: The pipeline to copy (default: ``PassPipeline.DEFAULT``).

    Returns:
        A new ``PassPipeline`` named ``"pattern_infra"``.

    Raises:
        PassRegistrationError: ``base`` sets options for a generic pass (a sweep cannot pass them on).
    """
    base = PassPipeline.DEFAULT if base is None else base
    options = base.get_all_options()
    entries: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            sweep = GenericSweep(run)
            PASS_REGISTRY.passes[sweep.pass_id] = sweep
            entries.append(sweep.pass_id)
            run.clear()

    for pass_id in base.passes:
        if isinstance(PASS_REGISTRY.passes.get(pass_id), PassContainer):
            if options.get(pass_id):
                raise PassRegistrationError(
                    f"pattern_infra.pipeline(): the base pipeline sets options for the generic pass "
                    f"{pass_id!r}, which a sweep cannot pass on; declare them as its defaults "
                    f"(register_generic_pass(..., options=...)) instead."
                )
            run.append(pass_id)
        else:
            flush()
            entries.append(pass_id)
    flush()
    result = PassPipeline(entries, pipeline_name="pattern_infra")
    for pass_id, pass_options in options.items():
        result._pass_options[pass_id] = list(pass_options)
    return result
