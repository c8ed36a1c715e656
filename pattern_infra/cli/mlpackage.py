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
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..inspecting.tracing import Trace, trace
from ..language.errors import PassRegistrationError, PatternInfraError
from ..passes.container import PassContainer, override
from ..passes.registry import generic_passes
from ..rewriting.subpass import SubPass, constraint_verdict
from .quiet import no_progress_bars

__all__ = [
    "SavedModel",
    "OptimizeResult",
    "check_destination",
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
    written: Path | None = None
    """The package :func:`optimize_mlpackage` wrote (None for :func:`run_passes` alone)."""
    near_misses: dict[str, Counter[str]] = field(default_factory=dict)
    """Per pass id, the reasons its own checks (``var_constraints``) gave for refusing a match, each with
    the number of places refused for it: overlapping refused matches count once, and a place the pass
    rewrote after all (another operand order, another spelling) not at all."""


def load_mlpackage(path: str | os.PathLike[str]) -> SavedModel:
    """Reads a saved ML program (``.mlpackage``) as a MIL program, without the Core ML runtime.

    Args:
        path: The package.

    Returns:
        The model, with its program and specification.

    Raises:
        PatternInfraError: The path is not a saved ML program (a neural network model, a folder that is
            not a package, an empty or damaged specification, a missing, truncated or garbled weight
            file); the one-line message names the file and what is wrong with it.
    """
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto

    path = Path(path)
    if not path.exists():
        raise PatternInfraError(f"{path}: no such file or directory; give the path of a saved .mlpackage.")
    if path.is_dir() and not (path / "Manifest.json").is_file():
        raise PatternInfraError(
            f"{path}: a folder without Manifest.json, not a model package; give a .mlpackage saved by "
            f"coremltools (mlmodel.save('model.mlpackage'))."
        )
    try:
        model = ct.models.MLModel(str(path), skip_model_load=True)
    except Exception as exc:
        raise PatternInfraError(
            f"{path}: coremltools cannot read it as a Core ML model ({_one_line(exc)}); give "
            f"a .mlpackage saved by coremltools (mlmodel.save('model.mlpackage'))."
        ) from exc
    spec = model.get_spec()
    kind = spec.WhichOneof("Type")
    if kind is None:
        raise PatternInfraError(
            f"{_spec_file(path)}: an empty model specification (no model in it); save the model again."
        )
    if kind != "mlProgram":
        raise PatternInfraError(
            f"{path}: a {kind} model, not an ML program; the passes work on ML programs "
            f"(convert with coremltools.convert(..., convert_to='mlprogram'))."
        )
    try:
        program = milproto.load(spec, spec.specificationVersion, model.weights_dir)
    except Exception as exc:
        raise PatternInfraError(
            f"{_weights_problem(path, model.weights_dir)} ({_one_line(exc)}); save the model again."
        ) from exc
    return SavedModel(path, program, spec, model.compute_unit)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, its whitespace runs (newlines included) made single spaces."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _spec_file(path: Path) -> Path:
    """The specification file of a package (the path itself for an ``.mlmodel`` file)."""
    if not path.is_dir():
        return path
    found = sorted(path.rglob("*.mlmodel"))
    return found[0] if found else path


def _weights_problem(path: Path, weights_dir: str | None) -> str:
    """What is wrong with a package whose weights coremltools cannot read, naming the weight file."""
    if not weights_dir:
        return f"{path}: its weights cannot be read"
    files = sorted(Path(weights_dir).glob("*.bin"))
    if not files:
        return f"{Path(weights_dir) / 'weight.bin'}: the weight file is missing"
    return f"{', '.join(map(str, files))}: the weight file is truncated or damaged"


def check_destination(
    destination: str | os.PathLike[str],
    *,
    source: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Checks, before any work, that ``destination`` can receive a saved model.

    Args:
        destination: The package to write; its name must end in ``.mlpackage``.
        source: The package it is made from, if any: never written over, nor into.
        overwrite: Whether an existing ``destination`` may be replaced; only a model package (a folder
            holding ``Manifest.json``) is.

    Returns:
        ``destination`` as a path.

    Raises:
        PatternInfraError: The name lacks the suffix, it is (or is inside) the source, it exists and may
            not be replaced, its folder is missing or not writable.
    """
    destination = Path(destination)
    if destination.suffix != ".mlpackage":
        raise PatternInfraError(
            f"{destination}: an ML program is saved as a folder whose name ends in .mlpackage; name the "
            f"output {destination.with_suffix('.mlpackage')}."
        )
    target = destination.resolve()
    if source is not None:
        origin = Path(source).resolve()
        if target == origin:
            raise PatternInfraError(
                f"{destination}: refusing to write over the model being read; choose another path."
            )
        if origin in target.parents:
            raise PatternInfraError(
                f"{destination}: inside the model being read ({source}); choose a path outside it."
            )
    if destination.exists() or destination.is_symlink():
        if not overwrite:
            raise PatternInfraError(f"{destination} exists; remove it or ask to overwrite it (--overwrite).")
        if not _is_package(destination):
            raise PatternInfraError(
                f"{destination} exists and is not a model package (no Manifest.json in it); --overwrite "
                f"only replaces a model package: remove it yourself or choose another path."
            )
    folder = target.parent
    if not folder.is_dir():
        raise PatternInfraError(f"{destination}: the folder {folder} does not exist; create it first.")
    try:
        tempfile.TemporaryDirectory(dir=folder, prefix=".mil-patterns-check-").cleanup()
    except OSError as exc:
        raise PatternInfraError(
            f"{destination}: cannot write in the folder {folder} ({_one_line(exc)}); choose a writable "
            "folder."
        ) from exc
    return destination


def _is_package(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / "Manifest.json").is_file()


def save_mlpackage(
    model: SavedModel, destination: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Writes ``model.program`` as an ``.mlpackage``, with the model's description and metadata.

    Only coremltools' backend passes run (the same as when the model was first saved). The package is
    written to a temporary folder beside ``destination`` and moved into place only once complete: if
    anything fails, ``destination`` is as it was (the old package, or nothing) and no partial output
    is left.

    Args:
        model: The loaded model (its program possibly rewritten).
        destination: The package to write (its name ends in ``.mlpackage``).
        overwrite: Replace ``destination`` if it is a model package.

    Returns:
        The path written.

    Raises:
        PatternInfraError: See :func:`check_destination`.
    """
    from coremltools.converters.mil.converter import mil_convert

    destination = check_destination(destination, source=model.path, overwrite=overwrite)
    with tempfile.TemporaryDirectory(
        dir=destination.resolve().parent, prefix=f".{destination.name}."
    ) as scratch:
        fresh = Path(scratch) / destination.name
        with override(), no_progress_bars():
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
        mlmodel.save(str(fresh))
        _move_into_place(fresh, destination, Path(scratch) / "replaced")
    return destination


def _move_into_place(fresh: Path, destination: Path, aside: Path) -> None:
    """Renames ``fresh`` to ``destination`` (same folder: no copy); an existing package there is moved
    ``aside`` first and put back if the rename fails."""
    if destination.exists():
        os.rename(destination, aside)
        try:
            os.rename(fresh, destination)
        except BaseException:
            os.rename(aside, destination)
            raise
    else:
        os.rename(fresh, destination)


def optimize_mlpackage(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    passes: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    progress: bool = False,
    overwrite: bool = False,
    check: Callable[[SavedModel, Program], None] | None = None,
) -> OptimizeResult:
    """Loads a saved model, runs the generic passes and the cleanup on it, and saves the result.

    Args:
        source: The ``.mlpackage`` to read.
        destination: The ``.mlpackage`` to write.
        passes: Only these generic pass ids (default: every registered generic pass).
        exclude: Generic pass ids not to run.
        progress: Show a progress bar (tqdm, on stderr).
        overwrite: Replace ``destination`` if it is a model package.
        check: Called with a copy of the model as read and the program after the passes, before
            anything is written (``mil-patterns optimize --verify``); if it raises, nothing is written.

    Returns:
        The passes run, every rewrite, the op counts before and after, and the path written.

    Raises:
        PatternInfraError: ``destination`` cannot be written (:func:`check_destination`, checked before
            the model is read), ``source`` cannot be read (:func:`load_mlpackage`), or a pass failed;
            ``destination`` is then as it was.
    """
    check_destination(destination, source=source, overwrite=overwrite)
    pass_plan(passes, exclude)  # an unknown pass id is refused before the model is read
    model = load_mlpackage(source)
    functions = sorted(model.program.functions)
    if len(functions) > 1:
        raise PatternInfraError(
            f"{source}: a model with {len(functions)} functions ({', '.join(functions)}); optimize saves "
            f"single-function models only (report and explain read any)."
        )
    original = None
    if check is not None:
        from ..authoring.clone import clone_program

        original = SavedModel(model.path, clone_program(model.program), model.spec, model.compute_unit)
    result = run_passes(model.program, passes=passes, exclude=exclude, progress=progress)
    if check is not None and original is not None:
        check(original, model.program)
    with coremltools_own(result.excluded):
        result.written = save_mlpackage(model, destination, overwrite=overwrite)
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
    refused: dict[str, dict[str, list[set[str]]]] = {}
    with trace() as rewrites, override(), coremltools_own(excluded), _recording_refusals(plan, refused):
        bar = tqdm(steps, desc="passes", unit="pass", disable=not progress, file=sys.stderr, leave=False)
        for pass_id, generic in bar:
            bar.set_postfix_str(pass_id, refresh=False)
            graph_pass = PASS_REGISTRY[pass_id]
            graph_pass.set_options(None)
            if generic:
                graph_pass.apply(prog)  # without its followers: they have their own place in the plan
            else:
                graph_pass(prog)
            prog.validate()
        bar.close()
    result.rewrites = rewrites
    result.after = op_histogram(prog)
    result.near_misses = _near_misses(refused, rewrites)
    return result


_REFUSED = "constraint returned False: "
"""How :func:`~pattern_infra.rewriting.subpass.constraint_verdict` prefixes a constraint's own reason."""


@contextlib.contextmanager
def _recording_refusals(
    pass_ids: Sequence[str], refused: dict[str, dict[str, list[set[str]]]]
) -> Iterator[None]:
    """Inside the block, every refusal by the ``var_constraints`` of the passes ``pass_ids`` is recorded
    in ``refused`` (pass id -> reason -> the op names of each refused match); the constraints are the
    registered ones again on exit."""
    wrapped: list[tuple[SubPass, Any]] = []

    def recording(pass_id: str, constraints: Any) -> Any:
        def record(match: Any) -> Any:
            answer = constraints(match)
            reason = constraint_verdict(answer)
            if reason is not None:
                reason = reason.removeprefix(_REFUSED)
                ops = {op.name for op in match.op_list()}
                refused.setdefault(pass_id, {}).setdefault(reason, []).append(ops)
            return answer

        return record

    registered = generic_passes()
    try:
        for pass_id in dict.fromkeys(pass_ids):
            for sub in registered[pass_id].passes:
                if isinstance(sub, SubPass) and sub.var_constraints is not None:
                    wrapped.append((sub, sub.var_constraints))
                    sub.var_constraints = recording(pass_id, sub.var_constraints)
        yield
    finally:
        for sub, constraints in wrapped:
            sub.var_constraints = constraints


def _near_misses(refused: dict[str, dict[str, list[set[str]]]], rewrites: Trace) -> dict[str, Counter[str]]:
    """Places refused per pass and reason: overlapping matches merged, places the pass rewrote dropped."""
    rewritten: dict[str, set[str]] = {}
    for rewrite in rewrites:
        rewritten.setdefault(rewrite.pass_id, set()).update(rewrite.matched)
    out: dict[str, Counter[str]] = {}
    for pass_id, reasons in refused.items():
        counts: Counter[str] = Counter()
        for reason, matches in reasons.items():
            places: list[set[str]] = []
            for ops in matches:
                joined = [p for p in places if p & ops]
                for p in joined:
                    places.remove(p)
                places.append(set(ops).union(*joined))
            counts[reason] = sum(1 for p in places if not p & rewritten.get(pass_id, set()))
        counts = +counts  # drop reasons left with no place
        if counts:
            out[pass_id] = counts
    return out


def op_histogram(prog: Program) -> Counter[str]:
    """Op types and their counts over every block of ``prog`` (const ops included)."""
    from ..rewriting.blocks import walk_blocks

    return Counter(op.op_type for _, ops in walk_blocks(prog) for op in ops)


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
