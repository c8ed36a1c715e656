"""Registering generic passes: ``register_generic_pass``, pass ids and ``run_after`` followers. An id in
coremltools' namespaces that names no pass of coremltools is refused (no pipeline would run it)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..language.compiler import ConstMode, ConstRule, compile_pattern
from ..language.equivalences import Equivalences
from ..language.errors import PassRegistrationError
from ..language.pattern import Pattern
from ..rewriting.subpass import DEFAULT_MAX_ITERATIONS, SubPass
from .container import PassContainer

__all__ = ["container_for", "generic_passes", "register_generic_pass", "register_graph_pass"]


def container_for(pass_name: str, namespace: str) -> PassContainer:
    """The PassContainer registered under ``namespace::pass_name``, created if needed."""
    current, replaces = _checked_id(pass_name, namespace)
    if isinstance(current, PassContainer):
        return current
    container = PassContainer(pass_name, namespace, replaces=replaces)
    PASS_REGISTRY.passes[container.pass_id] = container
    return container


def _checked_id(pass_name: str, namespace: str) -> tuple[Any, type | None]:
    """What ``namespace::pass_name`` holds in the registry now, and the coremltools pass a new container
    there would replace; raises when the id is unusable. Changes nothing."""
    for label, value in (("pass_name", pass_name), ("namespace", namespace)):
        if not isinstance(value, str) or not value or "::" in value:
            raise PassRegistrationError(
                f"register_generic_pass: {label} must be a non-empty string without '::', got "
                f"{value!r}. The pass id is '<namespace>::<pass_name>', e.g. 'common::fuse_gelu_exact'."
            )
    pass_id = f"{namespace}::{pass_name}"
    current = PASS_REGISTRY.passes.get(pass_id)
    if isinstance(current, PassContainer):
        return current, current.replaces
    replaces = current if isinstance(current, type) and issubclass(current, AbstractGraphPass) else None
    if current is not None and replaces is None:
        raise PassRegistrationError(
            f"Pass id {pass_id!r} is taken by {current!r}, which is neither a coremltools pass class "
            f"nor a PassContainer; choose another pass_name or namespace."
        )
    theirs = _coremltools_ids(namespace)
    if current is None and theirs:
        near = difflib.get_close_matches(pass_id, theirs, n=3, cutoff=0.6)
        hint = f"Did you mean {', '.join(repr(n) for n in near)}? " if near else ""
        raise PassRegistrationError(
            f"Pass id {pass_id!r} is in coremltools' namespace {namespace!r}, but coremltools has no pass "
            f"of that name, so it would be a new pass that no pipeline runs. {hint}To replace a "
            f"coremltools pass, use its exact id; for a new fusion, use a namespace of your own (e.g. "
            f"'generic') and run_after= to join the conversion pipeline."
        )
    return current, replaces


def _coremltools_ids(namespace: str) -> list[str]:
    """Ids of coremltools' own passes in ``namespace`` (also those a generic pass replaces)."""
    return sorted(
        pass_id
        for pass_id, value in PASS_REGISTRY.passes.items()
        if pass_id.startswith(f"{namespace}::")
        and (value.replaces is not None if isinstance(value, PassContainer) else isinstance(value, type))
    )


def register_generic_pass(
    ops_arrangement: Program | Sequence[Program] | Mapping[str, Program],
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
    """Registers a pattern with its callbacks as one sub-pass of ``namespace::pass_name``.

    Calls with the same id group into one :class:`PassContainer`, which replaces coremltools' pass of that id
    while ``ENABLE_EXPERIMENTAL_PASSES=1``. All or nothing: a call that raises leaves the registry as it was.
    :func:`~pattern_infra.find_matches` and :func:`~pattern_infra.explain` take the same pattern options;
    docs/LANGUAGE.md ("Options of register_generic_pass") shows each with an example.

    Args:
        ops_arrangement: The pattern, an ``mb.program`` with uniquely named ops; or several spellings of it
            (a sequence, or a mapping of names to programs), tried in the written order.
        var_constraints: ``f(pattern)``, before the transform (None accepts all). Accepts: ``True``, any
            true value but a string (``numpy.True_``). Refuses: a false value, ``(False, "reason")``,
            or a string, the reason itself (counted in ``stats.rejections``). ``None`` (no ``return``)
            raises :class:`~pattern_infra.PassExecutionError`.
        transform_pattern: ``f(pattern)``: builds the replacement, calls ``pattern.replace_output(new_var)``;
            returning ``False`` before any change declines.
        pass_name: Pass name, e.g. ``"fuse_gelu_exact"``.
        namespace: Namespace, e.g. ``"common"`` (coremltools' namespaces take only its own pass ids).
        commutative: ``True``: the ops of :data:`~pattern_infra.COMMUTATIVE_OPS` in either operand order;
            ``False``: as written; pattern op names: those in both orders, whatever type matched.
        alternatives: Pattern op name to the op types accepted there, its own type among them.
        constants: The rule of every pattern constant: ``"any"``, ``"const"``, ``"value"``, ``"weight"`` or
            a :class:`ConstRule`.
        const_rules: Rules per constant, keyed ``"<op>.<slot>"`` or by const op name.
        fanout: Pattern ops standing for every consumer of their input (the list ``pattern.<name>``).
        equivalences: Identities also matched: ``True`` (all), their names, or ``{"<op>": [names]}``.
        priority: Sub-passes with higher priority run first within the pass.
        max_iterations: Re-visit rounds before :class:`~pattern_infra.language.errors.FixpointError`.
        options: Pipeline options the pass accepts, with defaults (read as ``container.options``).
        name: Name for messages and ``container.order`` (default: the pattern's last op name).
        run_after: A pass id of coremltools' pipeline this new pass runs right after, override on.

    Returns:
        The container the sub-pass was added to.

    Raises:
        PatternDefinitionError: The pattern breaks a rule.
        PassRegistrationError: The pass id, a callback, ``run_after`` or ``options`` is unusable.
    """
    where = f"register_generic_pass({namespace}::{pass_name})"
    _checked_id(pass_name, namespace)  # every check before the registry changes
    if not callable(transform_pattern):
        raise PassRegistrationError(
            f"{where}: transform_pattern must be callable, got {type(transform_pattern).__name__}."
        )
    if var_constraints is not None and not callable(var_constraints):
        raise PassRegistrationError(
            f"{where}: var_constraints must be callable or None, got {type(var_constraints).__name__}."
        )
    compiled = compile_pattern(
        ops_arrangement,
        name=name,
        commutative=commutative,
        alternatives=alternatives,
        constants=constants,
        const_rules=const_rules,
        fanout=fanout,
        equivalences=equivalences,
        where=where,
    )
    sub = SubPass(compiled, var_constraints, transform_pattern, priority, max_iterations)
    if run_after is not None:
        _check_leader(f"{namespace}::{pass_name}", run_after)
    if options is not None and not isinstance(options, Mapping):
        raise PassRegistrationError(
            f"{where}: options must be a mapping of option names to defaults, got {type(options).__name__}."
        )
    container = container_for(pass_name, namespace)
    container.add(sub)  # from here on nothing raises: the registry changes only once everything is checked
    if options:
        container.declare_options(options)
    if run_after is not None:
        leader_namespace, leader_name = run_after.split("::", 1)
        leader = container_for(leader_name, leader_namespace)
        if container not in leader.followers:
            leader.followers.append(container)
    return container


def register_graph_pass(
    apply: Callable[[Program], Any],
    pass_name: str,
    namespace: str,
    *,
    options: Mapping[str, Any] | None = None,
) -> PassContainer:
    """Registers a plain graph pass (a function rewriting a whole program, not a pattern) under
    ``namespace::pass_name``: its container behaves as a pattern pass's (the override, the sweeps), and
    the pipeline validates the program after the entry, as after coremltools' passes.

    Args:
        apply: ``f(prog)``, changing ``prog`` in place; it reads ``container.options``.
        pass_name: Pass name, e.g. ``"topological_reorder"``.
        namespace: Namespace, e.g. ``"common"``.
        options: Pipeline options the pass accepts, with defaults.

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
    container.add(apply)
    container.validate = False
    if options:
        container.declare_options(options)
    return container


def _check_leader(pass_id: str, run_after: str) -> None:
    """Raises unless ``run_after`` names another registered pass that can lead ``pass_id``."""
    if run_after == pass_id or not isinstance(run_after, str) or "::" not in run_after:
        raise PassRegistrationError(
            f"Pass {pass_id!r}: run_after must be another pass id '<namespace>::<name>', got {run_after!r}."
        )
    if run_after not in PASS_REGISTRY:
        raise PassRegistrationError(
            f"Pass {pass_id!r}: run_after names {run_after!r}, which is not a registered pass."
        )
    namespace, name = run_after.split("::", 1)
    _checked_id(name, namespace)


def generic_passes() -> dict[str, PassContainer]:
    """Every registered generic pass, by pass id, in id order."""
    return {
        pass_id: entry
        for pass_id, entry in sorted(PASS_REGISTRY.passes.items())
        if isinstance(entry, PassContainer)
    }
