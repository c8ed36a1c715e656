"""Registering generic passes with coremltools, and the ``ENABLE_EXPERIMENTAL_PASSES`` override.

A generic pass is a :class:`PassContainer`: a real coremltools graph pass (an ``AbstractGraphPass``)
holding one or more sub-passes, stored in coremltools' ``PASS_REGISTRY`` under ``namespace::pass_name``.

When the id already names one of coremltools' own passes, the container remembers that pass and decides
*each time it runs*: with ``ENABLE_EXPERIMENTAL_PASSES=1`` in the environment at that moment, the generic
sub-passes run; otherwise coremltools' own pass runs, with the same options. Nothing is decided at import,
so setting or unsetting the variable takes effect on the next conversion. A generic pass under a new id
always runs when a pipeline names it.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Program
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass, PassOption
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from coremltools.converters.mil.mil.scope import ScopeInfo, ScopeSource

from .compiler import CompiledPattern, ConstMode, ConstRule, compile_pattern
from .equivalences import Equivalences
from .driver import (
    DEFAULT_MAX_ITERATIONS,
    PassStats,
    SubPass,
    find_in_program,
    remove_dead_ops,
    run_subpasses,
)
from .errors import PassRegistrationError
from .matcher import Matcher
from .pattern import Pattern

__all__ = [
    "ENV_VAR",
    "PassContainer",
    "register_generic_pass",
    "fuse_all_blocks",
    "fuse_one_block",
    "find_matches",
    "generic_passes",
    "override",
    "override_enabled",
    "resolve_patterns",
    "run_log",
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
    """Whether generic passes replace coremltools' passes right now (``ENABLE_EXPERIMENTAL_PASSES=1``).

    ``1`` (also ``true``, ``yes``, ``on``, any case) turns the override on; unset, empty, ``0`` (also
    ``false``, ``no``, ``off``) leaves it off. Any other value leaves it off with a ``RuntimeWarning``
    naming the accepted values (once per value), so a typo is never silently "off".
    """
    value = os.environ.get(ENV_VAR)
    if value is None:
        return False
    if value == "1":
        return True
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
    """Sets ``ENABLE_EXPERIMENTAL_PASSES`` for the duration of the ``with`` block.

    The variable is ``"1"`` when ``enabled`` and absent otherwise; its previous value (or absence) is
    restored on exit, also when the block raises.
    """
    previous = os.environ.get(ENV_VAR)
    if enabled:
        os.environ[ENV_VAR] = "1"
    else:
        os.environ.pop(ENV_VAR, None)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


def run_log(clear: bool = False) -> list[tuple[str, bool, PassStats]]:
    """Runs of generic passes since the log was last cleared: (pass id, generic?, stats of the run).

    After a ``coremltools.convert`` this tells which passes changed the program: those with
    ``stats.rewrites > 0``.

    Args:
        clear: Empty the log after reading it.
    """
    entries = list(_RUN_LOG)
    if clear:
        _RUN_LOG.clear()
    return entries


class PassContainer(AbstractGraphPass):
    """A coremltools graph pass made of generic sub-passes (the design document's ``PassContainer``).

    Sub-passes run in order of priority (higher first), then registration order; ``order`` shows it.
    Each sub-pass is applied to every block, nested blocks included. After each rewrite, the ops it
    created or rewired are validated (coremltools' ``Block.validate`` invariants, linear in what
    changed; ``container.validate = "full"`` validates the whole program after each sub-pass that
    rewrote); an inconsistency restores the program and raises ``PassExecutionError``.
    """

    def __init__(self, pass_name: str, namespace: str = "", replaces: type | None = None) -> None:
        """Creates an empty pass.

        Args:
            pass_name: The pass's name (the part after ``::``).
            namespace: Its namespace, e.g. ``"common"``.
            replaces: The coremltools pass class this one stands in for under the override.
        """
        if not isinstance(pass_name, str) or not pass_name:
            raise PassRegistrationError(f"A pass needs a non-empty name, got {pass_name!r}.")
        self.pass_name = pass_name
        self.namespace = namespace
        self.replaces = replaces
        self.passes: list[SubPass | Callable[[Program], Any]] = []
        self.stats = PassStats()
        self.validate: bool | str = True
        """``True`` validates what each rewrite changed, right after it; ``"full"`` the whole program
        after each sub-pass that rewrote; ``False`` neither."""
        self.followers: list[PassContainer] = []
        """Generic passes registered with ``run_after`` this pass id: run right after it, override on."""
        self._options: list[PassOption] | None = None
        self._declared_options: dict[str, Any] = {}
        self.options: dict[str, Any] = {}
        """Option values in effect: the declared defaults, overridden by the pipeline's options."""

    # -- design-document API ------------------------------------------------------------------------

    def add(self, pass_function: SubPass | Callable[[Program], Any]) -> None:
        """Adds a sub-pass: a :class:`SubPass`, or any callable taking a program (seed style)."""
        if not isinstance(pass_function, SubPass) and not callable(pass_function):
            raise PassRegistrationError(
                f"Pass {self.pass_id!r}: add() takes a SubPass or a callable taking a Program, got "
                f"{type(pass_function).__name__}."
            )
        self.passes.append(pass_function)
        self._sort()

    def __call__(self, prog: Program) -> None:
        """Runs the pass on ``prog``: the generic sub-passes, or coremltools' pass it replaces."""
        if getattr(prog, "skip_all_passes", False):
            return
        if self.replaces is not None and not override_enabled():
            original = self.replaces()
            original.set_options(self._options)
            original(prog)
            return
        self.run_alone(prog)
        if override_enabled():
            # Each follower's rewrites are validated as they happen (``validate``); the pipeline that
            # runs this pass validates the whole program once it returns, followers included, so a
            # whole-program validation per follower would only repeat that (about 0.9 s at 43k ops).
            for follower in self.followers:
                follower.set_options(None)
                follower(prog)

    def run_alone(self, prog: Program) -> None:
        """Runs the generic sub-passes under coremltools' graph-pass scope (as the pipeline runs a pass),
        whatever the override says, and without the passes that follow this one (``run_after``)."""
        with mb.scope(ScopeInfo(source=ScopeSource.COREMLTOOLS_GRAPH_PASS, data=[str(self)])):
            self.apply(prog)

    def apply(self, prog: Program) -> None:
        """Runs every sub-pass, in order, on ``prog``."""
        stats = PassStats()
        structured = [p for p in self.passes if isinstance(p, SubPass)]
        if len(structured) == len(self.passes):
            stats = run_subpasses(prog, structured, self.pass_id, validate=self.validate)
        else:
            for sub in self.passes:
                if isinstance(sub, SubPass):
                    stats.add(run_subpasses(prog, [sub], self.pass_id, validate=self.validate))
                else:
                    self.apply_callable(prog, sub)
        self.record(stats)

    def apply_callable(self, prog: Program, sub: Callable[[Program], Any]) -> None:
        """Runs a seed-style sub-pass (a callable taking the program), then validates the program:
        the driver's per-rewrite checks do not see what such a callable changes. With ``validate``
        False (a plain graph pass, :func:`register_graph_pass`) the program is left to the pipeline's
        own validation after the entry, as for coremltools' passes."""
        sub(prog)
        if self.validate:
            prog.validate()

    def record(self, stats: PassStats) -> None:
        """Adds one run's counters to :attr:`stats` and to :func:`run_log`."""
        self.stats.add(stats)
        _RUN_LOG.append((self.pass_id, True, stats))
        del _RUN_LOG[:-_RUN_LOG_LIMIT]
        logger.debug("%s: %s", self.pass_id, stats)

    def set_options(self, pass_options: list[PassOption] | None = None) -> None:
        """Receives a pipeline's options for this pass (``None`` clears them).

        Options go to coremltools' pass when it runs instead; for the generic pass, an option must be
        declared at registration (``options=``), otherwise ``NotImplementedError`` as in coremltools.
        """
        self._options = list(pass_options) if pass_options else None
        self.options = dict(self._declared_options)
        for option in self._options or []:
            known = option.option_name in self._declared_options
            if not known and (self.replaces is None or override_enabled()):
                raise NotImplementedError(
                    f"The graph pass `{self.pass_id}` doesn't support option "
                    f"`{option.option_name}`; declare it with register_generic_pass(..., "
                    f"options={{'{option.option_name}': default}})."
                )
            if known:
                self.options[option.option_name] = option.option_val

    @property
    def pass_options(self) -> list[PassOption] | None:
        """The options the pipeline set for this pass, as it gave them (None: none set)."""
        return self._options

    def declare_options(self, options: Mapping[str, Any]) -> None:
        """Declares options the generic pass accepts, with their defaults."""
        self._declared_options.update(options)
        self.options = dict(self._declared_options)

    def __str__(self) -> str:
        return self.pass_name

    def __repr__(self) -> str:
        return f"PassContainer({self.pass_id!r}, {len(self.passes)} sub-passes)"

    # -- extensions ---------------------------------------------------------------------------------

    @property
    def pass_id(self) -> str:
        """``namespace::pass_name``."""
        return f"{self.namespace}::{self.pass_name}" if self.namespace else self.pass_name

    @property
    def order(self) -> list[str]:
        """Names of the sub-passes in the order they run."""
        return [p.name if isinstance(p, SubPass) else getattr(p, "__name__", repr(p)) for p in self.passes]

    def _sort(self) -> None:
        keyed = list(enumerate(self.passes))
        keyed.sort(key=lambda item: (-(item[1].priority if isinstance(item[1], SubPass) else 0), item[0]))
        self.passes = [p for _, p in keyed]


def _split_pass_id(pass_name: str, namespace: str) -> None:
    for label, value in (("pass_name", pass_name), ("namespace", namespace)):
        if not isinstance(value, str) or not value or "::" in value:
            raise PassRegistrationError(
                f"register_generic_pass: {label} must be a non-empty string without '::', got "
                f"{value!r}. The pass id is '<namespace>::<pass_name>', e.g. 'common::fuse_gelu_exact'."
            )


def container_for(pass_name: str, namespace: str) -> PassContainer:
    """The PassContainer registered under ``namespace::pass_name``, created if needed."""
    _split_pass_id(pass_name, namespace)
    pass_id = f"{namespace}::{pass_name}"
    current = PASS_REGISTRY.passes.get(pass_id)
    if isinstance(current, PassContainer):
        return current
    replaces = current if isinstance(current, type) and issubclass(current, AbstractGraphPass) else None
    if current is not None and replaces is None:
        raise PassRegistrationError(
            f"Pass id {pass_id!r} is taken by {current!r}, which is neither a coremltools pass class "
            f"nor a PassContainer; choose another pass_name or namespace."
        )
    if current is None and namespace in coremltools_namespaces():
        near = difflib.get_close_matches(pass_id, _coremltools_ids(namespace), n=3, cutoff=0.6)
        hint = f"Did you mean {', '.join(repr(n) for n in near)}? " if near else ""
        raise PassRegistrationError(
            f"Pass id {pass_id!r} is in coremltools' namespace {namespace!r}, but coremltools has no pass "
            f"of that name, so it would be a new pass that no pipeline runs. {hint}To replace a "
            f"coremltools pass, use its exact id; for a new fusion, use a namespace of your own (e.g. "
            f"'generic') and run_after= to join the conversion pipeline."
        )
    container = PassContainer(pass_name, namespace, replaces=replaces)
    PASS_REGISTRY.passes[pass_id] = container
    return container


def coremltools_namespaces() -> list[str]:
    """The namespaces of coremltools' own passes (``common``, ``mil_backend``, ...), sorted."""
    return sorted({pass_id.split("::", 1)[0] for pass_id in _coremltools_ids()})


def _coremltools_ids(namespace: str | None = None) -> list[str]:
    """Ids of coremltools' own passes (the classes in its registry, also those a generic pass replaces)."""
    ids = []
    for pass_id, value in PASS_REGISTRY.passes.items():
        own = value.replaces is not None if isinstance(value, PassContainer) else isinstance(value, type)
        if own and "::" in pass_id and (namespace is None or pass_id.split("::", 1)[0] == namespace):
            ids.append(pass_id)
    return sorted(ids)


def register_generic_pass(
    ops_arrangement: Program | Sequence[Program],
    var_constraints: Callable[[Pattern], Any] | None,
    transform_pattern: Callable[[Pattern], Any],
    pass_name: str,
    namespace: str,
    *,
    commutative: bool | Sequence[str] = True,
    alternatives: Mapping[str, Sequence[str]] | None = None,
    constants: ConstMode | ConstRule = "any",
    const_rules: Mapping[str, ConstMode | ConstRule] | None = None,
    fanout: Sequence[str] = (),
    equivalences: Equivalences = False,
    priority: int = 0,
    max_iterations: int = DEFAULT_MAX_ITERATIONS,
    options: Mapping[str, Any] | None = None,
    name: str | None = None,
    run_after: str | None = None,
) -> PassContainer:
    """Registers a pattern with its callbacks as a sub-pass of ``namespace::pass_name``.

    Calls with the same ``namespace`` and ``pass_name`` group into one :class:`PassContainer`. If that id
    names a coremltools pass, the container replaces it when ``ENABLE_EXPERIMENTAL_PASSES=1`` at run time.

    Args:
        ops_arrangement: The pattern, an ``mb.program`` with uniquely named ops; or a sequence of them,
            alternatives that share the callbacks (each becomes a sub-pass, in the given order).
        var_constraints: ``f(pattern) -> bool``; None accepts every structural match.
        transform_pattern: ``f(pattern)`` rewriting the match; returning False declines it.
        pass_name: Pass name, e.g. ``"fuse_gelu_exact"``.
        namespace: Namespace, e.g. ``"common"``.
        commutative: See :func:`~pattern_infra.compiler.compile_pattern`.
        alternatives: Op types accepted per pattern op, e.g. ``{"add_or_sub": ["add", "sub"]}``.
        constants: Default rule for pattern constants (``"any"``, ``"const"``, ``"value"``).
        const_rules: Rules per constant, keyed ``"<op>.<slot>"`` or by const op name.
        fanout: Pattern ops standing for every consumer of their input, captured as a list.
        equivalences: Identities the matcher also matches (``pow(x, 2)`` = ``mul(x, x)``, ...), per pass:
            see :mod:`pattern_infra.equivalences` (default off).
        priority: Sub-passes with higher priority run first within the pass.
        max_iterations: Re-visit rounds before :class:`~pattern_infra.errors.FixpointError`.
        options: Pipeline options the pass accepts, with defaults (read as ``container.options``).
        name: Name for messages and ``container.order`` (default: the pattern's last op name).
        run_after: A pass id of coremltools' pipeline (e.g. ``"common::fuse_linear_bias"``): while
            ``ENABLE_EXPERIMENTAL_PASSES=1``, this (new) pass also runs right after that one, so a new
            fusion takes part in ``coremltools.convert`` without taking over an unrelated pass id.

    Returns:
        The container the sub-pass was added to.

    Raises:
        PatternDefinitionError: The pattern breaks a rule.
        PassRegistrationError: The pass id or a callback is unusable.
    """
    container = container_for(pass_name, namespace)
    if not callable(transform_pattern):
        raise PassRegistrationError(
            f"register_generic_pass({namespace}::{pass_name}): transform_pattern must be callable, got "
            f"{type(transform_pattern).__name__}."
        )
    if var_constraints is not None and not callable(var_constraints):
        raise PassRegistrationError(
            f"register_generic_pass({namespace}::{pass_name}): var_constraints must be callable or "
            f"None, got {type(var_constraints).__name__}."
        )
    programs = [ops_arrangement] if isinstance(ops_arrangement, Program) else list(ops_arrangement)
    subs = []
    for i, program in enumerate(programs):
        compiled = compile_pattern(
            program,
            name=(f"{name}[{i}]" if name and len(programs) > 1 else name),
            commutative=commutative,
            alternatives=alternatives,
            constants=constants,
            const_rules=const_rules,
            fanout=fanout,
            equivalences=equivalences,
        )
        subs.append(SubPass(compiled, var_constraints, transform_pattern, priority, max_iterations))
    for sub in subs:
        container.add(sub)
    if options:
        container.declare_options(options)
    if run_after is not None:
        _follow(container, run_after)
    return container


def register_graph_pass(
    apply: Callable[[Program], Any], pass_name: str, namespace: str, *, options: Mapping[str, Any] | None = None
) -> PassContainer:
    """Registers a plain graph pass (a function rewriting a whole program) under ``namespace::pass_name``.

    For passes that are not patterns (a reorder of a whole block, a walk over every op); the container
    behaves as for a pattern pass: under a coremltools id it replaces coremltools' pass only while
    ``ENABLE_EXPERIMENTAL_PASSES=1``, and :func:`~pattern_infra.pipeline` puts it in its sweeps. The
    function runs inside the pass's graph-pass scope, like coremltools' passes; the program is not
    validated after it by the container (``validate = False``): the pipeline validates after the
    entry, as it does after coremltools' own pass.

    Args:
        apply: ``f(prog)``, changing ``prog`` in place.
        pass_name: Pass name, e.g. ``"topological_reorder"``.
        namespace: Namespace, e.g. ``"common"``.
        options: Pipeline options the pass accepts, with defaults (``apply`` reads
            ``container.options``, or the options as given, ``container.pass_options``).

    Returns:
        The container holding ``apply`` as its only sub-pass.

    Raises:
        PassRegistrationError: ``apply`` is not callable, or the id already holds sub-passes.
    """
    if not callable(apply):
        raise PassRegistrationError(
            f"register_graph_pass({namespace}::{pass_name}): apply must be a callable taking a Program, got "
            f"{type(apply).__name__}."
        )
    container = container_for(pass_name, namespace)
    if container.passes and container.passes != [apply]:
        raise PassRegistrationError(
            f"register_graph_pass({namespace}::{pass_name}): the id already holds {container.order}; a plain "
            f"graph pass stands alone (choose another pass_name)."
        )
    container.passes = [apply]
    container.validate = False
    if options:
        container.declare_options(options)
    return container


def _follow(container: PassContainer, run_after: str) -> None:
    if run_after == container.pass_id or "::" not in run_after:
        raise PassRegistrationError(
            f"Pass {container.pass_id!r}: run_after must be another pass id '<namespace>::<name>', got "
            f"{run_after!r}."
        )
    namespace, name = run_after.split("::", 1)
    if run_after not in PASS_REGISTRY:
        raise PassRegistrationError(
            f"Pass {container.pass_id!r}: run_after names {run_after!r}, which is not a registered pass."
        )
    leader = container_for(name, namespace)
    if container not in leader.followers:
        leader.followers.append(container)


def generic_passes() -> dict[str, PassContainer]:
    """Every registered generic pass, by pass id, in id order."""
    return {
        pass_id: value
        for pass_id, value in sorted(PASS_REGISTRY.passes.items())
        if isinstance(value, PassContainer)
    }


def _sub_pass(ops_arrangement: Program, var_constraints: Any, transform_pattern: Any) -> SubPass:
    return SubPass(compile_pattern(ops_arrangement), var_constraints, transform_pattern)


def fuse_all_blocks(
    ops_arrangement: Program,
    var_constraints: Callable[[Pattern], Any] | None,
    transform_pattern: Callable[[Pattern], Any],
    prog: Program,
) -> PassStats:
    """Replaces every instance of the pattern in every block of ``prog`` (design-document API).

    Returns:
        Counters of the run.
    """
    sub = _sub_pass(ops_arrangement, var_constraints, transform_pattern)
    return run_subpasses(prog, [sub], f"fuse_all_blocks({sub.name})")


def fuse_one_block(
    block: Block,
    ops_arrangement: Program,
    var_constraints: Callable[[Pattern], Any] | None,
    transform_pattern: Callable[[Pattern], Any],
) -> bool:
    """Replaces the first instance of the pattern in ``block`` (design-document API).

    Returns:
        Whether a match was rewritten.
    """
    sub = _sub_pass(ops_arrangement, var_constraints, transform_pattern)
    for match in find_in_program(_BlockProgram(block), sub.matcher, var_constraints):
        if match.block is not block:
            continue
        with block:
            result = transform_pattern(match)
        if result is False:
            continue
        remove_dead_ops(match)
        return True
    return False


class _BlockProgram:
    """Lets find_in_program walk a single block (and its nested blocks)."""

    def __init__(self, block: Block) -> None:
        self.functions = {"main": block}


PatternSource = Any
"""What ``find_matches`` and ``explain`` search for: a pattern program, a list of them, a registered
pass (a :class:`PassContainer` or its id ``"namespace::name"``) or a compiled pattern."""


def resolve_patterns(
    ops_arrangement: PatternSource,
    var_constraints: Callable[[Pattern], Any] | None,
    pattern_options: Mapping[str, Any],
) -> list[tuple[CompiledPattern, Callable[[Pattern], Any] | None]]:
    """The compiled patterns to search for, each with the constraints to apply.

    A registered pass gives its sub-passes' patterns, compiled with the options of their registration,
    each with its own ``var_constraints`` unless ``var_constraints`` is given.

    Raises:
        PassRegistrationError: A pass id that is not registered, a pass without pattern sub-passes, or
            pattern options given with a registered pass (its options are those of the registration).
        PatternDefinitionError: A pattern program breaks a rule.
    """
    if isinstance(ops_arrangement, str):
        found = PASS_REGISTRY.passes.get(ops_arrangement)
        if not isinstance(found, PassContainer):
            near = difflib.get_close_matches(ops_arrangement, list(generic_passes()), n=3)
            hint = f" Did you mean {', '.join(near)}?" if near else ""
            raise PassRegistrationError(
                f"{ops_arrangement!r} is not a registered generic pass.{hint} Give a pattern program, a "
                f"list of them, or the PassContainer register_generic_pass returned."
            )
        ops_arrangement = found
    if isinstance(ops_arrangement, (PassContainer, SubPass)):
        if pattern_options:
            raise PassRegistrationError(
                f"{ops_arrangement!r}: pattern options {sorted(pattern_options)} cannot be given with a "
                f"registered pass, whose patterns keep the options they were registered with; drop them, "
                f"or pass the pattern program instead."
            )
        subs = ops_arrangement.passes if isinstance(ops_arrangement, PassContainer) else [ops_arrangement]
        subs = [sub for sub in subs if isinstance(sub, SubPass)]
        if not subs:
            raise PassRegistrationError(
                f"{ops_arrangement!r} has no pattern sub-pass (only plain callables), so there is no "
                f"pattern to search for."
            )
        return [(sub.compiled, sub.var_constraints if var_constraints is None else var_constraints) for sub in subs]
    if isinstance(ops_arrangement, CompiledPattern):
        return [(ops_arrangement, var_constraints)]
    if isinstance(ops_arrangement, (list, tuple)):
        if not ops_arrangement:
            raise PassRegistrationError("An empty list of patterns: give at least one pattern program.")
        return [
            pair for item in ops_arrangement for pair in resolve_patterns(item, var_constraints, pattern_options)
        ]
    return [(compile_pattern(ops_arrangement, **pattern_options), var_constraints)]


def find_matches(
    ops_arrangement: PatternSource,
    prog: Program,
    var_constraints: Callable[[Pattern], Any] | None = None,
    **pattern_options: Any,
) -> Iterator[Pattern]:
    """Yields the matches of a pattern in ``prog`` lazily, never changing the program.

    Args:
        ops_arrangement: The pattern program; or a list of them; or a registered pass (its
            ``PassContainer`` or pass id), whose patterns are searched with the options and the
            ``var_constraints`` of their registration.
        prog: The program to search.
        var_constraints: Only matches it accepts are yielded (for a registered pass: instead of its own).
        **pattern_options: As for :func:`register_generic_pass` (``commutative``, ``alternatives``,
            ``constants``, ``const_rules``, ``fanout``, ``equivalences``); not with a registered pass.

    Yields:
        One :class:`Pattern` per distinct set of matched ops, outer blocks first, in program order; with
        several patterns, the matches of each pattern in turn.
    """
    for compiled, constraints in resolve_patterns(ops_arrangement, var_constraints, pattern_options):
        yield from find_in_program(prog, Matcher(compiled), constraints)
