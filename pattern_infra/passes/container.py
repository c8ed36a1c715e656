"""A generic pass as coremltools sees it: :class:`PassContainer`, a graph pass of sub-passes stored in
``PASS_REGISTRY`` under ``namespace::pass_name``; the override (:func:`override_enabled`), read each time
a pass runs; and the log of runs."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from itertools import groupby
from typing import Any, cast

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass, PassOption
from coremltools.converters.mil.mil.scope import ScopeInfo, ScopeSource

from ..language.errors import PassRegistrationError
from ..rewriting.driver import run_subpasses
from ..rewriting.subpass import PassStats, SubPass

__all__ = [
    "ENV_VAR",
    "PassContainer",
    "override",
    "override_enabled",
    "run_log",
    "run_together",
    "with_followers",
]

logger = logging.getLogger(__name__)

ENV_VAR = "ENABLE_EXPERIMENTAL_PASSES"
"""Environment variable that lets generic passes replace coremltools' passes of the same id."""

_RUN_LOG: list[tuple[str, bool, PassStats]] = []
_RUN_LOG_LIMIT = 10_000

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
_warned_values: set[str] = set()


def override_enabled() -> bool:
    """Whether generic passes replace coremltools' passes right now: ``ENABLE_EXPERIMENTAL_PASSES`` is
    ``1``, ``true``, ``yes`` or ``on`` (any case); a value that is none of those nor unset, ``0``, ``false``,
    ``no``, ``off`` warns, once per value."""
    value = os.environ.get(ENV_VAR, "")
    folded = value.strip().lower()
    if folded in _ON:
        return True
    if folded not in _OFF and value not in _warned_values:
        _warned_values.add(value)
        warnings.warn(
            f"{ENV_VAR}={value!r} is not understood, so the generic passes do NOT replace coremltools' "
            f"passes. Set {ENV_VAR}=1 to turn the override on (also accepted: true, yes, on), or 0 / "
            f"unset it to leave it off (also: false, no, off).",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


@contextlib.contextmanager
def override(enabled: bool = True) -> Iterator[None]:
    """Sets ``ENABLE_EXPERIMENTAL_PASSES`` to ``"1"`` (``enabled``) or unsets it for the ``with`` block;
    its previous value (or absence) is restored on exit, also when the block raises."""
    previous = os.environ.pop(ENV_VAR, None)
    if enabled:
        os.environ[ENV_VAR] = "1"
    try:
        yield
    finally:
        os.environ.pop(ENV_VAR, None)
        if previous is not None:
            os.environ[ENV_VAR] = previous


def run_log(clear: bool = False) -> list[tuple[str, bool, PassStats]]:
    """Runs of generic passes since the log was last cleared (``clear``: empty it after reading), as (pass
    id, generic?, stats of the run): after a ``coremltools.convert``, the passes that changed the program
    have ``stats.rewrites > 0``."""
    entries = list(_RUN_LOG)
    if clear:
        _RUN_LOG.clear()
    return entries


class PassContainer(AbstractGraphPass):
    """A coremltools graph pass made of generic sub-passes (``register_generic_pass`` adds them), which run
    in order of priority (higher first), then registration order (``order``), on every block."""

    def __init__(self, pass_name: str, namespace: str = "", replaces: type | None = None) -> None:
        """An empty pass ``namespace::pass_name``, standing in for the coremltools pass class ``replaces``
        under the override."""
        if not isinstance(pass_name, str) or not pass_name:
            raise PassRegistrationError(f"A pass needs a non-empty name, got {pass_name!r}.")
        self.pass_name = pass_name
        self.namespace = namespace
        self.replaces = replaces
        self.passes: list[SubPass] = []
        """The sub-passes, in the order they run."""
        self.function: Callable[[Program], Any] | None = None
        """A plain graph pass, a function taking the program: then the container's only entry."""
        self.stats = PassStats()
        """Counters summed over its runs: ``stats.rewrites``, ``stats.rejections`` (constraints' reasons)."""
        self.validate: bool | str = True
        """``True`` validates what each rewrite changed, right after it; ``"full"`` the whole program
        after each sub-pass that rewrote; ``False`` neither. A failed validation restores the program
        and raises ``PassExecutionError``."""
        self.followers: list[PassContainer] = []
        """Generic passes registered with ``run_after`` this pass: run right after it, override on."""
        self.pass_options: list[PassOption] | None = None
        """The options the pipeline set for this pass, as it gave them (None: none set)."""
        self._declared_options: dict[str, Any] = {}
        self.options: dict[str, Any] = {}
        """Option values in effect: the declared defaults, overridden by the pipeline's options."""

    def add(self, pass_function: SubPass | Callable[[Program], Any]) -> None:
        """Adds a sub-pass: a :class:`SubPass`, or a callable taking a program (seed style), which stands
        alone (:attr:`function`)."""
        if not isinstance(pass_function, SubPass) and not callable(pass_function):
            raise PassRegistrationError(
                f"Pass {self.pass_id!r}: add() takes a SubPass or a callable taking a Program, got "
                f"{type(pass_function).__name__}."
            )
        if self.function not in (None, pass_function) or (
            self.passes and not isinstance(pass_function, SubPass)
        ):
            raise PassRegistrationError(
                f"Pass {self.pass_id!r} already holds {self.order}; a plain graph pass (a callable taking "
                f"the program) stands alone: register it under another pass_name."
            )
        if not isinstance(pass_function, SubPass):
            self.function = pass_function
            return
        self.passes.append(pass_function)
        self.passes.sort(key=lambda p: -p.priority)  # a stable sort: equal priorities keep registration order

    def __call__(self, prog: Program) -> None:
        """Runs the pass on ``prog``: under coremltools' id, the generic sub-passes with the override on,
        else coremltools' pass with the same options; under a new id, always the generic sub-passes."""
        if getattr(prog, "skip_all_passes", False):
            return
        enabled = override_enabled()
        # A container with nothing of its own only leads run_after followers: coremltools' pass runs.
        empty = not self.passes and self.function is None
        if self.replaces is not None and (not enabled or empty):
            original = self.replaces()
            original.set_options(self.pass_options)
            original(prog)
            if not enabled:
                return
        followers = with_followers(self)[1:] if self.followers and enabled else []
        for follower in followers:  # in one driver run with this pass; options reset as the pipeline does
            follower.set_options(None)
        run_together(prog, [self, *followers], self.pass_id)

    def apply(self, prog: Program) -> None:
        """Runs the generic sub-passes on ``prog`` in the pass's graph-pass scope, whatever the override
        says, and without its ``run_after`` followers."""
        run_together(prog, [self], self.pass_id)

    def record(self, stats: PassStats) -> None:
        """Adds one run's counters to :attr:`stats` and to :func:`run_log`."""
        self.stats.add(stats)
        _RUN_LOG.append((self.pass_id, True, stats))
        del _RUN_LOG[:-_RUN_LOG_LIMIT]
        logger.debug("%s: %s", self.pass_id, stats)

    def set_options(self, pass_options: list[PassOption] | None = None) -> None:
        """Receives a pipeline's options for this pass (``None`` clears them); they go to coremltools' pass
        when it runs instead. The generic pass raises ``NotImplementedError`` for an undeclared option."""
        self.pass_options = list(pass_options) if pass_options else None
        self.options = dict(self._declared_options)
        for option in self.pass_options or []:
            if option.option_name in self._declared_options:
                self.options[option.option_name] = option.option_val
            elif self.replaces is None or override_enabled():
                raise NotImplementedError(
                    f"The graph pass `{self.pass_id}` doesn't support option "
                    f"`{option.option_name}`; declare it with register_generic_pass(..., "
                    f"options={{'{option.option_name}': default}})."
                )

    def declare_options(self, options: Mapping[str, Any]) -> None:
        """Declares options the generic pass accepts, with their defaults."""
        self._declared_options.update(options)
        self.options = dict(self._declared_options)

    def __str__(self) -> str:
        return self.pass_name

    def __repr__(self) -> str:
        return f"PassContainer({self.pass_id!r}, {len(self.order)} sub-passes)"

    @property
    def pass_id(self) -> str:
        """``namespace::pass_name``."""
        return f"{self.namespace}::{self.pass_name}" if self.namespace else self.pass_name

    @property
    def order(self) -> list[str]:
        """Names of the sub-passes in the order they run."""
        if self.function is not None:
            return [getattr(self.function, "__name__", repr(self.function))]
        return [sub.name for sub in self.passes]


def with_followers(container: PassContainer) -> list[PassContainer]:
    """``container`` then its ``run_after`` followers (and theirs), in registration order."""
    order = [container]
    for follower in container.followers:
        order += with_followers(follower)
    return order


def run_together(prog: Program, containers: list[PassContainer], pass_name: str) -> None:
    """Applies ``containers`` to ``prog`` in order, as if one by one (each to its fixpoint, in its own scope,
    the counters of its run filled in one object, which :meth:`PassContainer.record` keeps), in as few
    driver runs as possible: a callable sub-pass or a change of ``validate`` splits a run. ``pass_name``
    names the whole run in messages."""
    plan = [(c, sub) for c in containers for sub in (c.passes if c.function is None else [c.function])]
    for _, run in groupby(plan, key=lambda p: (p[0].validate, p[0].function is None or id(p))):
        segment = list(run)
        container = segment[0][0]
        if container.function is not None:  # a plain graph pass, in its pass's scope
            with mb.scope(_scope_of(container)):
                container.function(prog)
            if container.validate:  # False for a plain graph pass: the pipeline validates after the entry
                prog.validate()
            container.record(PassStats())
            continue
        runs = {owner: PassStats() for owner, _ in segment}  # one run_log entry each, even if twice
        run_subpasses(
            prog,
            cast(list[SubPass], [sub for _, sub in segment]),  # no function in this segment: sub-passes
            pass_name,
            validate=container.validate,
            passes=[owner.pass_id for owner, _ in segment],
            scopes={owner.pass_id: _scope_of(owner) for owner in runs},
            stats=[runs[owner] for owner, _ in segment],
        )
        for owner, run_stats in runs.items():
            owner.record(run_stats)


def _scope_of(container: PassContainer) -> ScopeInfo:
    """The scope coremltools' pipeline gives what a graph pass creates (``AbstractGraphPass.__call__``)."""
    return ScopeInfo(source=ScopeSource.COREMLTOOLS_GRAPH_PASS, data=[str(container)])
