"""Runs of passes as single pipeline entries (:class:`GenericSweep`), which coremltools validates once,
not after each pass: :func:`pipeline`, for ``coremltools.convert``; the program is the same as the
pass-by-pass pipeline's with the override on."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Literal

from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass, PassOption
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..language.errors import PassRegistrationError
from .container import PassContainer, run_together, with_followers

__all__ = ["GenericSweep", "pipeline"]


class GenericSweep(AbstractGraphPass):
    """A graph pass applying several passes in one pipeline entry, in the order given: consecutive generic
    passes (with their ``run_after`` followers) in one driver run, whatever ``ENABLE_EXPERIMENTAL_PASSES``
    says (choosing :func:`pipeline` is choosing them); any other pass as coremltools' pipeline runs it,
    without a whole-program validation after it."""

    def __init__(
        self, pass_ids: Sequence[str], options: Mapping[str, list[PassOption]] | None = None
    ) -> None:
        """A sweep of ``pass_ids``, registered pass ids in run order, with ``options`` per pass id.

        Raises:
            PassRegistrationError: An id is not registered, or a generic pass is given options it does
                not declare.
        """
        options = dict(options or {})
        self.steps: list[PassContainer | str] = []
        """Each pass: the generic pass, or the id of a pass to look up when it runs."""
        for pass_id in pass_ids:
            entry = PASS_REGISTRY.passes.get(pass_id)
            if entry is None:
                raise PassRegistrationError(
                    f"GenericSweep: {pass_id!r} is not a registered pass; `import generic_passes` (or "
                    f"register it) first, or leave it out of the sweep."
                )
            generic = isinstance(entry, PassContainer)
            given = (options.get(pass_id) or []) if generic else []
            undeclared = [o.option_name for o in given if o.option_name not in entry.options]
            if undeclared:
                raise PassRegistrationError(
                    f"GenericSweep: options {undeclared} are set for the generic pass {pass_id!r}, which "
                    f"does not declare them; declare them (register_generic_pass(..., options=...)) or "
                    f"leave them out of the pipeline."
                )
            self.steps.append(entry if generic else pass_id)
        self.pass_ids = tuple(pass_ids)
        self.options = {k: list(v) for k, v in options.items() if v and k in self.pass_ids}
        """Options of the passes, by id (a generic pass's only those it declares)."""

    @property
    def pass_id(self) -> str:
        """The id :func:`pipeline` registers this sweep under: its first and last passes and a digest."""
        names = [i.split("::", 1)[-1] for i in self.pass_ids]
        digest = hashlib.sha1(
            repr((self.pass_ids, sorted(self.options.items(), key=str))).encode()
        ).hexdigest()
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        return f"pattern_infra::sweep[{span}]#{digest[:8]}"

    def set_options(self, pass_options: list[PassOption] | None = None) -> None:
        """A sweep takes no options (coremltools passes None when the pipeline sets none)."""
        if pass_options:
            raise NotImplementedError(
                f"The graph pass `{self.pass_id}` takes no options; set the options of its passes before "
                f"calling pattern_infra.pipeline()."
            )

    def __call__(self, prog: Program) -> None:
        """:meth:`apply`, outside any scope of its own: each op created carries its own pass's scope."""
        if not getattr(prog, "skip_all_passes", False):
            self.apply(prog)

    def apply(self, prog: Program) -> None:
        """Applies every pass of the sweep to ``prog``, in order (generic ones: ``run_together``)."""
        run: list[PassContainer] = []
        for step in [*self.steps, None]:
            if isinstance(step, PassContainer):
                run += with_followers(step)
                continue
            if run:
                for container in run:  # as coremltools' pipeline sets (or resets) a pass's options
                    container.set_options(self.options.get(container.pass_id))
                run_together(prog, run, self.pass_id)
                run = []
            if step is not None:
                graph_pass = PASS_REGISTRY[step]
                graph_pass.set_options(self.options.get(step))
                graph_pass(prog)
                if step == "common::dead_code_elimination":
                    for function in prog.functions.values():
                        function._check_has_scope_info()  # what apply_pipeline checks after this pass

    def __str__(self) -> str:
        return self.pass_id

    def __repr__(self) -> str:
        return f"GenericSweep({list(self.pass_ids)!r})"


def pipeline(base: PassPipeline | None = None, *, group: Literal["all", "generic"] = "all") -> PassPipeline:
    """A copy of a coremltools pipeline in which runs of passes are single entries (sweeps).

    Pass the result to ``coremltools.convert(..., pass_pipeline=pattern_infra.pipeline())``, once per
    conversion (``convert`` edits the pipeline it gets). ``ENABLE_EXPERIMENTAL_PASSES`` still decides for
    the generic passes outside the sweeps (the backend's passes, which ``convert`` runs after it).

    Args:
        base: The pipeline to copy (default: ``PassPipeline.DEFAULT``).
        group: ``"all"``: every run of passes between the entries ``convert`` looks up by id
            (``add_fp16_cast``, ``add_int16_cast``, the first entry of each pass the frontend and backend
            pipelines share with ``base``) is one entry. ``"generic"``: only runs of generic passes are.

    Returns:
        A new ``PassPipeline`` named ``"pattern_infra"``.

    Raises:
        PassRegistrationError: ``base`` sets options a generic pass does not declare, or ``group`` is
            unknown.
    """
    if group not in ("all", "generic"):
        raise PassRegistrationError(
            f"pattern_infra.pipeline(): group must be 'all' or 'generic', got {group!r}."
        )
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
    of the frontend and backend pipelines."""
    ids = set(_EDITED_BY_CONVERT)
    for name in PassPipeline.list_available_pipelines():
        if name.startswith(("frontend_", "backend_")):
            ids.update(PassPipeline.get_pipeline(name).passes)
    return ids & set(base.passes)
