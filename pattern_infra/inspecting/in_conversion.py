"""Explain a pattern on the program a pass sees inside ``coremltools.convert``, not on the converted model.

The program a pass works on in the middle of the pipeline is not the one ``ct.convert`` returns: the
passes after it fuse, fold and rename. :func:`program_before` converts the model with a stand-in at the
pass's place in the registry, which copies the program it is handed and then runs the real pass, so the
conversion completes unchanged; :func:`explain_in_conversion` runs :func:`~pattern_infra.explain`
on that copy::

    print(explain_in_conversion(exported_program, at="common::fuse_gelu_exact"))
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any

from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..language.errors import PassRegistrationError, PatternInfraError
from ..passes.container import PassContainer, override

__all__ = ["explain_in_conversion", "program_before"]


class _Capture(AbstractGraphPass):
    """Stands in for the pass ``at``: copies the program the first time, then runs the real pass."""

    def __init__(self, pass_id: str, real: Any) -> None:
        super().__init__()
        self.pass_id = pass_id
        self.real = real
        self.program: Program | None = None
        self._real_options: Any = None

    def set_options(self, pass_options: Any = None) -> None:
        self._real_options = pass_options

    def __call__(self, prog: Program) -> None:
        from ..authoring.clone import clone_program

        if self.program is None:
            self.program = clone_program(prog)
        real = self.real() if isinstance(self.real, type) else self.real
        real.set_options(self._real_options)
        real(prog)

    def apply(self, prog: Program) -> None:  # required by AbstractGraphPass; __call__ does the work
        self(prog)


def _check_pass_id(at: str) -> None:
    if at not in PASS_REGISTRY.passes:
        near = difflib.get_close_matches(at, list(PASS_REGISTRY.passes), n=3)
        hint = f" Did you mean {', '.join(near)}?" if near else ""
        raise PassRegistrationError(f"explain_in_conversion: {at!r} is not a registered pass id.{hint}")


def program_before(
    model: Any, at: str, *, override_passes: bool | None = None, **convert_kwargs: Any
) -> Program:
    """Converts ``model`` and returns a copy of the program as the pass ``at`` received it.

    Args:
        model: Anything ``coremltools.convert`` accepts (an ``ExportedProgram``, an ``mb.program``, ...).
        at: The pass id, e.g. ``"common::fuse_gelu_exact"``; its first run in the pipeline is captured.
        override_passes: Set ``ENABLE_EXPERIMENTAL_PASSES`` to this during the conversion (None: leave it
            as it is), which decides whether the generic passes ran before ``at``.
        **convert_kwargs: For ``coremltools.convert``; defaults ``convert_to="mlprogram"``,
            ``skip_model_load=True``.

    Returns:
        The copy (the conversion's own program goes on through the pipeline).

    Raises:
        PassRegistrationError: ``at`` is not a registered pass id (the message lists the nearest).
        PatternInfraError: The conversion did not run ``at`` (not in its pipeline).
    """
    import coremltools as ct

    _check_pass_id(at)
    real = PASS_REGISTRY.passes[at]
    capture = _Capture(at, real)
    convert_kwargs.setdefault("convert_to", "mlprogram")
    convert_kwargs.setdefault("skip_model_load", True)
    setting = override(override_passes) if override_passes is not None else contextlib.nullcontext()
    PASS_REGISTRY.passes[at] = capture
    try:
        with setting:
            ct.convert(model, **convert_kwargs)
    finally:
        PASS_REGISTRY.passes[at] = real
    if capture.program is None:
        raise PatternInfraError(
            f"explain_in_conversion: the conversion never ran {at!r}; it is not in the pipeline used "
            f"(pass_pipeline=...). Choose a pass of that pipeline."
        )
    return capture.program


def explain_in_conversion(
    model: Any,
    pattern: Any = None,
    at: str = "",
    *,
    override_passes: bool | None = None,
    top: int = 3,
    convert_kwargs: dict[str, Any] | None = None,
    **pattern_options: Any,
) -> Any:
    """Explains ``pattern`` on the program the pass ``at`` sees during ``coremltools.convert(model)``.

    Args:
        model: Anything ``coremltools.convert`` accepts.
        pattern: What :func:`~pattern_infra.explain` accepts (a pattern program, a list, a registered
            pass or its id); None: the generic pass registered under ``at``.
        at: The pass id where the pipeline is observed, e.g. ``"common::fuse_gelu_exact"``.
        override_passes: See :func:`program_before`.
        top: Near misses to report per pattern.
        convert_kwargs: Keyword arguments for ``coremltools.convert``.
        **pattern_options: As for ``explain``.

    Returns:
        What ``explain`` returns, for the program as ``at`` received it.
    """
    from .explain import explain

    if not at:
        raise PassRegistrationError(
            "explain_in_conversion: say where to look with at='namespace::pass', e.g. "
            "at='common::fuse_gelu_exact'."
        )
    _check_pass_id(at)
    if pattern is None:
        if not isinstance(PASS_REGISTRY.passes.get(at), PassContainer):
            raise PassRegistrationError(
                f"explain_in_conversion: no pattern given and {at!r} is not a generic pass; give the "
                f"pattern to explain, or register a generic pass under {at!r}."
            )
        pattern = PASS_REGISTRY.passes[at]
    prog = program_before(model, at, override_passes=override_passes, **(convert_kwargs or {}))
    return explain(pattern, prog, top=top, **pattern_options)
