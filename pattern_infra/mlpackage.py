"""Saved models: load an ``.mlpackage`` as a MIL program, run the generic passes on it, save it again.

This is what ``mil-patterns optimize`` and ``mil-patterns report`` do, as functions. It needs no Core ML
runtime (Linux works): the model is read with ``coremltools.models.MLModel(path, skip_model_load=True)``
and its ML program turned back into MIL by coremltools' own loader
(``coremltools.converters.mil.frontend.milproto.load``, as ``coremltools.optimize`` does); the weights
are read from the package's weight file. Saving goes through coremltools' converter from MIL
(``convert_from="milinternal"``) with an empty main pipeline, so only its backend passes run, with the
model's description (inputs, outputs, metadata) and specification version kept.

The passes run in the order of coremltools' default pipeline (a pass listed there twice runs twice),
each followed by the passes registered to run after it (``run_after``), then the generic passes the
pipeline does not name (``mil_backend::`` passes, then the others by id); then coremltools' cleanup
pipeline (dead code, constants, names). The override is on throughout: a generic pass registered under a
coremltools id replaces coremltools' pass; an excluded one is coremltools' own again for the run.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from .language.errors import PassRegistrationError, PatternInfraError
from .passes.container import PassContainer, override
from .passes.registry import generic_passes
from .tracing import Trace, trace

__all__ = [
    "SavedModel",
    "OptimizeResult",
    "load_mlpackage",
    "op_histogram",
    "optimize_mlpackage",
    "pass_plan",
    "run_passes",
    "save_mlpackage",
]


@dataclass
class SavedModel:
    """A saved ML program, loaded as MIL."""

    path: Path
    """Where it was read from."""
    program: Program
    """Its MIL program (changed in place by :func:`run_passes`)."""
    spec: Any
    """Its protobuf specification (description and metadata are kept from it when saving)."""
    compute_unit: Any
    """The compute units it was saved with."""


@dataclass
class OptimizeResult:
    """What :func:`run_passes` (and so :func:`optimize_mlpackage`) did."""

    plan: list[str]
    """The generic pass ids run, in order (then coremltools' cleanup pipeline)."""
    excluded: list[str] = field(default_factory=list)
    """The registered generic passes not run (coremltools' own pass stands in for those that replace one)."""
    rewrites: Trace = field(default_factory=Trace)
    """Every rewrite made."""
    before: Counter[str] = field(default_factory=Counter)
    """Op types and counts before the passes (const ops included)."""
    after: Counter[str] = field(default_factory=Counter)
    """The same after the passes and the cleanup."""


def load_mlpackage(path: str | os.PathLike[str]) -> SavedModel:
    """Reads a saved ML program (``.mlpackage``) as a MIL program, without the Core ML runtime.

    Args:
        path: The package.

    Returns:
        The model, with its program and specification.

    Raises:
        PatternInfraError: The path is not a saved ML program (e.g. a neural network model).
    """
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto

    path = Path(path)
    if not path.exists():
        raise PatternInfraError(f"{path}: no such file or directory; give the path of a saved .mlpackage.")
    try:
        model = ct.models.MLModel(str(path), skip_model_load=True)
    except Exception as exc:
        raise PatternInfraError(
            f"{path}: coremltools cannot read it as a Core ML model ({type(exc).__name__}: {exc}); give "
            f"a .mlpackage saved by coremltools (mlmodel.save('model.mlpackage'))."
        ) from exc
    spec = model.get_spec()
    if spec.WhichOneof("Type") != "mlProgram":
        raise PatternInfraError(
            f"{path}: a {spec.WhichOneof('Type')} model, not an ML program; the passes work on ML programs "
            f"(convert with coremltools.convert(..., convert_to='mlprogram'))."
        )
    program = milproto.load(spec, spec.specificationVersion, model.weights_dir)
    return SavedModel(path, program, spec, model.compute_unit)


def save_mlpackage(
    model: SavedModel, destination: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Writes ``model.program`` as an ``.mlpackage``, with the model's description and metadata.

    Only coremltools' backend passes run (the same as when the model was first saved).

    Args:
        model: The loaded model (its program possibly rewritten).
        destination: The package to write.
        overwrite: Replace ``destination`` if it exists.

    Returns:
        The path written.

    Raises:
        PatternInfraError: ``destination`` exists and ``overwrite`` is false, or is the source itself.
    """
    from coremltools.converters.mil.converter import mil_convert

    destination = Path(destination)
    if destination.resolve() == model.path.resolve():
        raise PatternInfraError(f"{destination}: refusing to write over the model being read; choose another path.")
    if destination.exists() and not overwrite:
        raise PatternInfraError(f"{destination} exists; remove it or ask to overwrite it (--overwrite).")
    with override():
        mlmodel = mil_convert(
            model.program,
            convert_from="milinternal",
            convert_to="mlprogram",
            compute_units=model.compute_unit,
            pass_pipeline=PassPipeline.EMPTY,
            specification_version=model.spec.specificationVersion,
            model_description=model.spec.description,
            skip_model_load=True,
        )
    if destination.exists():
        shutil.rmtree(destination) if destination.is_dir() else destination.unlink()
    mlmodel.save(str(destination))
    return destination


def optimize_mlpackage(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    passes: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    progress: bool = False,
    overwrite: bool = False,
) -> OptimizeResult:
    """Loads a saved model, runs the generic passes and the cleanup on it, and saves the result.

    Args:
        source: The ``.mlpackage`` to read.
        destination: The ``.mlpackage`` to write.
        passes: Only these generic pass ids (default: every registered generic pass).
        exclude: Generic pass ids not to run.
        progress: Show a progress bar (tqdm, on stderr).
        overwrite: Replace ``destination`` if it exists.

    Returns:
        The passes run, every rewrite, and the op counts before and after.
    """
    model = load_mlpackage(source)
    result = run_passes(model.program, passes=passes, exclude=exclude, progress=progress)
    with coremltools_own(result.excluded):
        save_mlpackage(model, destination, overwrite=overwrite)
    return result


def pass_plan(passes: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """The generic pass ids :func:`run_passes` runs, in order (an id may appear more than once).

    Args:
        passes: Keep only these ids (default: every registered generic pass).
        exclude: Drop these ids.

    Raises:
        PassRegistrationError: An id is not a registered generic pass (the message lists the nearest).
    """
    registered = generic_passes()
    for pass_id in [*(passes or ()), *exclude]:
        if pass_id not in registered:
            near = difflib.get_close_matches(pass_id, list(registered), n=3)
            hint = f" Did you mean {', '.join(near)}?" if near else ""
            raise PassRegistrationError(
                f"{pass_id!r} is not a registered generic pass.{hint} `mil-patterns passes` lists them "
                f"(passes of your own: --import your_module)."
            )
    order: list[str] = []

    def place(container: PassContainer) -> None:
        order.append(container.pass_id)
        for follower in container.followers:
            place(follower)

    pipelines = PassPipeline.DEFAULT.passes + PassPipeline.get_pipeline("backend_mlprogram").passes
    for pass_id in pipelines:
        if pass_id in registered:
            place(registered[pass_id])
    followers = {f.pass_id for c in registered.values() for f in c.followers}
    for pass_id in registered:  # id order
        if pass_id not in order and pass_id not in followers:
            place(registered[pass_id])
    wanted = set(passes) if passes else set(registered)
    return [p for p in order if p in wanted and p not in set(exclude)]


def run_passes(
    prog: Program,
    *,
    passes: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    progress: bool = False,
) -> OptimizeResult:
    """Runs the generic passes (override on), then coremltools' cleanup pipeline, on ``prog`` in place.

    Args:
        prog: The program, e.g. ``load_mlpackage(path).program``.
        passes: Only these generic pass ids (default: every registered generic pass).
        exclude: Generic pass ids not to run (coremltools' own pass stands in for them in the cleanup).
        progress: Show a progress bar (tqdm, on stderr).

    Returns:
        The passes run, every rewrite, and the op counts before and after.
    """
    from tqdm import tqdm

    plan = pass_plan(passes, exclude)
    excluded = [p for p in generic_passes() if p not in set(plan)]
    result = OptimizeResult(plan=plan, excluded=excluded, before=op_histogram(prog))
    steps = [(pass_id, True) for pass_id in plan] + [(p, False) for p in PassPipeline.CLEANUP.passes]
    with trace() as rewrites, override(), coremltools_own(excluded):
        bar = tqdm(steps, desc="passes", unit="pass", disable=not progress, file=sys.stderr, leave=False)
        for pass_id, generic in bar:
            bar.set_postfix_str(pass_id, refresh=False)
            graph_pass = PASS_REGISTRY[pass_id]
            graph_pass.set_options(None)
            if generic:
                graph_pass.run_alone(prog)  # without its followers: they have their own place in the plan
            else:
                graph_pass(prog)
            prog.validate()
        bar.close()
    result.rewrites = rewrites
    result.after = op_histogram(prog)
    return result


def op_histogram(prog: Program) -> Counter[str]:
    """Op types and their counts over every block of ``prog`` (const ops included)."""
    from .rewriting.blocks import iter_blocks

    return Counter(op.op_type for block in iter_blocks(prog) for op in block.operations)


@contextlib.contextmanager
def coremltools_own(pass_ids: Sequence[str]) -> Iterator[None]:
    """Inside the block, the generic passes ``pass_ids`` that replace a coremltools pass are that pass
    again in coremltools' registry (so an excluded pass is not run by a pipeline under the override)."""
    swapped: dict[str, PassContainer] = {}
    for pass_id in pass_ids:
        container = PASS_REGISTRY.passes.get(pass_id)
        if isinstance(container, PassContainer) and container.replaces is not None:
            swapped[pass_id] = container
            PASS_REGISTRY.passes[pass_id] = container.replaces
    try:
        yield
    finally:
        PASS_REGISTRY.passes.update(swapped)
