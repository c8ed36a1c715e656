"""``mil-patterns``: the generic passes on saved models, from the shell.

Subcommands: ``optimize`` (read a ``.mlpackage``, run the passes, write a new one), ``report`` (what each
pass would fuse and where, optionally as an HTML page, nothing written to the model), ``explain`` (why a
pattern does or does not match in a saved model) and ``passes`` (the registered passes, in run order).

Every argument is checked before any work; ``optimize`` writes beside the output and moves the package
into place only once it is complete, so a failure leaves the output as it was. Exit status: see
:data:`EXIT_CODES` (the ``--help`` epilog and ``docs/CLI.md`` list them). The project's passes are always
registered; ``--import MODULE`` (before the subcommand) imports modules that register passes of your
own, found in the current directory as ``python -m`` finds them.

Run as ``mil-patterns`` (installed with the package) or ``python -m pattern_infra``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import click

from ..language.errors import PatternInfraError

__all__ = ["DEFAULT_TOLERANCE", "EXIT_CODES", "main", "nearest_pass_ids"]

EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "failure: the model cannot be read (not an ML program, damaged specification or weights), the output "
    "cannot be written (exists, not a model package, inside the input, folder missing or not writable), "
    "a pass or pattern named does not exist, a pass failed, or --verify found the model changed beyond "
    "--tolerance; one line on stderr names the file or the "
    "pass and the fix, and no file is written or lost",
    2: "usage error: unknown command or option, missing argument, an input that does not exist, an argument "
    "of the wrong form (an output not ending in .mlpackage, --pattern neither MODULE:NAME nor a pass id, "
    "a module that cannot be imported)",
}
"""The exit status of ``mil-patterns`` and what each means."""

DEFAULT_TOLERANCE = 1e-3
"""``optimize --tolerance``'s default (the measurements behind it: docs/CLI.md, "Checking the result")."""

_EPILOG = "\b\nExit status:\n" + "\n".join(
    textwrap.fill(meaning, width=79, initial_indent=f"  {code}  ", subsequent_indent="     ")
    for code, meaning in EXIT_CODES.items()
)


class _Failure(click.ClickException):
    """A failure the user can fix: exit status 1, the message on stderr."""

    exit_code = 1


def _fail_cleanly(function: Any) -> Any:
    """Turns every error but click's own into one line on stderr and exit status 1 (no traceback);
    with ``--debug`` the error propagates with its traceback."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except PatternInfraError as exc:
            if _debug():
                raise
            raise _Failure(" ".join(str(exc).split())) from exc
        except Exception as exc:
            if _debug():
                raise
            message = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise _Failure(f"{message} (--debug shows the traceback)") from exc

    return wrapper


def _debug() -> bool:
    context = click.get_current_context(silent=True)
    return bool(context is not None and (context.find_root().obj or {}).get("debug"))


def _output_path(context: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``-o``: a name ending in ``.mlpackage`` (checked before any work)."""
    if value is not None and value.suffix != ".mlpackage":
        raise click.BadParameter(
            f"{value}: an ML program is saved as a folder whose name ends in .mlpackage; "
            f"write -o {value.with_suffix('.mlpackage')}.",
            context,
            param,
        )
    return value


def _split_ids(values: tuple[str, ...]) -> list[str]:
    """``--passes a,b --passes c`` -> ``[a, b, c]``."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def nearest_pass_ids(spec: str, ids: list[str], n: int = 3) -> list[str]:
    """The pass ids nearest to ``spec`` by edit distance (difflib's ratio), best first.

    Names are compared without their namespace, so the shared ``common::fuse_`` does not make every id
    look alike; a name is also compared with the start of each id's name (``fuse_layernorm`` finds
    ``fuse_layernorm_or_instancenorm``). Kept: ratio 0.6 or more, and within 0.15 of the best.
    """
    namespace, _, bare = spec.rpartition("::")

    def score(pass_id: str) -> float:
        their_namespace, _, name = pass_id.rpartition("::")
        ratio = difflib.SequenceMatcher(None, bare, name).ratio()
        start = 0.95 * difflib.SequenceMatcher(None, bare, name[: len(bare)]).ratio()
        return max(ratio, start) + (0.01 if namespace == their_namespace else 0.0)

    scored = sorted(((score(pass_id), pass_id) for pass_id in ids), key=lambda pair: -pair[0])
    best = scored[0][0] if scored else 0.0
    return [pass_id for value, pass_id in scored[:n] if value >= max(0.6, best - 0.15)]


def _unknown_pass(spec: str, option: str, capital: bool = True) -> _Failure:
    from ..passes.registry import generic_passes

    near = nearest_pass_ids(spec, list(generic_passes()))
    hint = f" {'Did' if capital else 'did'} you mean {', '.join(near)}?" if near else ""
    return _Failure(
        f"{option}: {spec!r} is not a registered generic pass.{hint} `mil-patterns passes` lists them "
        f"(passes of your own: --import your_module)."
    )


def _checked_ids(option: str, values: tuple[str, ...]) -> list[str]:
    """The ids of ``--passes`` or ``--exclude``, each a registered generic pass (checked before any work)."""
    from ..passes.registry import generic_passes

    ids = _split_ids(values)
    registered = generic_passes()
    for pass_id in ids:
        if pass_id not in registered:
            raise _unknown_pass(pass_id, option)
    return ids


def _progress_default() -> bool:
    return sys.stderr.isatty()


_pass_options = [
    click.option(
        "--passes",
        "passes",
        multiple=True,
        metavar="ID[,ID...]",
        help="Run only these generic passes (ids as `mil-patterns passes` lists them).",
    ),
    click.option(
        "--exclude",
        "exclude",
        multiple=True,
        metavar="ID[,ID...]",
        help="Do not run these generic passes (coremltools' own pass stands in for a replaced one).",
    ),
    click.option(
        "--progress/--no-progress",
        default=None,
        help="Progress bar on stderr (default: when stderr is a terminal).",
    ),
]


def _with_pass_options(function: Any) -> Any:
    for option in reversed(_pass_options):
        function = option(function)
    return function


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EPILOG)
@click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="Import MODULE first (it registers passes of your own; looked up in the current "
    "directory first, as python -m does); repeatable.",
)
@click.option(
    "--debug",
    is_flag=True,
    help="On a failure, show the traceback instead of one line; also show coremltools' import-time "
    "warnings (an untested torch version, no Core ML runtime), which are silenced otherwise.",
)
@click.version_option(package_name="mil-pattern-infra", prog_name="mil-patterns")
@click.pass_context
def main(context: click.Context, imports: tuple[str, ...], debug: bool) -> None:
    """Run the generic MIL passes on saved Core ML models (.mlpackage), without the Core ML runtime."""
    from .quiet import held_import_warnings, show_held_warnings

    context.obj = {"debug": debug}
    if debug:
        show_held_warnings()  # coremltools' import-time warnings, held by `import pattern_infra`
    with held_import_warnings(show=debug):
        importlib.import_module("generic_passes")
    if imports and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # what python -m does; an installed console script does not
    for module in imports:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise click.BadParameter(
                f"cannot import {module!r} ({exc}); give a module importable from the current directory "
                f"({os.getcwd()}) or from PYTHONPATH.",
                param_hint="--import",
            ) from exc


@main.command(epilog=_EPILOG)
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    required=True,
    callback=_output_path,
    help="The .mlpackage to write (the name must end in .mlpackage).",
)
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a model package.")
@click.option(
    "--verify",
    is_flag=True,
    help="Run the model before and after the passes in the reference evaluator on random inputs, print "
    "the largest difference, and write nothing if it exceeds the tolerance.",
)
@click.option(
    "--tolerance",
    type=click.FloatRange(min=0.0),
    default=DEFAULT_TOLERANCE,
    show_default=True,
    help="With --verify: the largest |after - before| of each output may be at most T times the output's "
    "scale (its largest magnitude, at least 1).",
)
@_with_pass_options
@_fail_cleanly
def optimize(
    source: Path,
    output: Path,
    overwrite: bool,
    verify: bool,
    tolerance: float,
    passes: tuple[str, ...],
    exclude: tuple[str, ...],
    progress: bool | None,
) -> None:
    """Run the generic passes on SOURCE and write the result to OUTPUT (weights and metadata kept)."""
    from ..inspecting.report import non_const_ops
    from .mlpackage import optimize_mlpackage

    result = optimize_mlpackage(
        source,
        output,
        passes=_checked_ids("--passes", passes) or None,
        exclude=_checked_ids("--exclude", exclude),
        progress=_progress_default() if progress is None else progress,
        overwrite=overwrite,
        check=functools.partial(_verify, tolerance=tolerance, output=output) if verify else None,
    )
    before, after = non_const_ops(result.before), non_const_ops(result.after)
    click.echo(f"{result.written}: {len(result.rewrites)} rewrite(s); non-const ops {before} -> {after}")


@main.command(epilog=_EPILOG)
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--html",
    "html_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write an HTML page with pictures of every rewrite to this directory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the trace of every rewrite as JSON.")
@_with_pass_options
@_fail_cleanly
def report(
    source: Path,
    html_dir: Path | None,
    as_json: bool,
    passes: tuple[str, ...],
    exclude: tuple[str, ...],
    progress: bool | None,
) -> None:
    """List what each generic pass would fuse in SOURCE, and where; SOURCE is not changed."""
    from ..inspecting.report import report_text
    from .mlpackage import load_mlpackage, run_passes

    chosen, excluded = _checked_ids("--passes", passes) or None, _checked_ids("--exclude", exclude)
    model = load_mlpackage(source)
    result = run_passes(
        model.program,
        passes=chosen,
        exclude=excluded,
        progress=_progress_default() if progress is None else progress,
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "source": str(source),
                    "plan": result.plan,
                    "rewrites": result.rewrites.to_dicts(),
                    "before": dict(result.before),
                    "after": dict(result.after),
                    "near_misses": {pass_id: dict(c) for pass_id, c in result.near_misses.items()},
                },
                indent=1,
            )
        )
    else:
        click.echo(report_text(result))
    if html_dir is not None:
        from ..inspecting.report import write_html_report

        page = write_html_report(result, html_dir, title=source.name)
        click.echo(f"wrote {page}", err=as_json)


VERIFY_TRIALS = 2
"""Random input sets ``optimize --verify`` runs the model on (seeds 0 and 1)."""


def _verify(original: Any, optimized: Any, *, tolerance: float, output: Path) -> None:
    """``optimize --verify``: the model as read and ``optimized`` run in the reference evaluator (float64)
    on :data:`VERIFY_TRIALS` random input sets (flexible dimensions sized within their ranges); raises
    when an output moved by more than ``tolerance`` times its scale, before anything is written."""
    from ..verification.compare import largest_difference
    from ..verification.errors import VerificationError
    from ..verification.inputs import sizes_in_ranges
    from ..verification.verify import check_same_interface

    untouched = f"{output} was not written (an existing one is left as it was)"
    before = original.program
    try:
        check_same_interface(before.functions["main"], optimized.functions["main"], "the passes")
        sizes = sizes_in_ranges(before, original.spec.description)
        relative, absolute, name = largest_difference(before, optimized, trials=VERIFY_TRIALS, sizes=sizes)
    except VerificationError as exc:
        raise _Failure(f"--verify: {exc}; {untouched}.") from exc
    except PatternInfraError as exc:
        raise _Failure(
            f"--verify: the reference evaluator cannot compare the model before and after the passes "
            f"({' '.join(str(exc).split())}); {untouched}. Run without --verify to write it unchecked."
        ) from exc
    figures = f"largest difference {absolute:.3g} ({relative:.3g} of the output's scale"
    figures += f", output {name!r})" if absolute > 0 else ")"
    if relative > tolerance:
        raise _Failure(
            f"--verify: {figures} over {VERIFY_TRIALS} random input sets exceeds --tolerance {tolerance:g}: "
            f"the passes changed what the model computes; {untouched}. Find the pass with --exclude or "
            f"--passes, or raise --tolerance if the difference is expected (float16 models: docs/CLI.md)."
        )
    click.echo(f"verify: {figures} over {VERIFY_TRIALS} random input sets, tolerance {tolerance:g}")


@main.command(epilog=_EPILOG)
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--pattern",
    "pattern",
    required=True,
    metavar="MODULE:NAME|PASS_ID",
    help="A pattern program, a list of them or a registered pass (module:name), or a pass id.",
)
@click.option("--top", default=3, show_default=True, help="Near misses to show per pattern.")
@_fail_cleanly
def explain(source: Path, pattern: str, top: int) -> None:
    """Show the matches of a pattern in SOURCE and, where none, the nearest partial matches."""
    from ..inspecting.explain import explain as explain_pattern
    from .mlpackage import load_mlpackage

    target = _resolve_pattern(pattern)
    model = load_mlpackage(source)
    click.echo(str(explain_pattern(target, model.program, top=top)))


def _resolve_pattern(spec: str) -> Any:
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    from ..passes.container import PassContainer
    from ..passes.registry import generic_passes

    if "::" in spec:
        found = PASS_REGISTRY.passes.get(spec)
        if isinstance(found, PassContainer):
            return found
        raise _unknown_pass(spec, "--pattern", capital=False)
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        near = nearest_pass_ids(spec, list(generic_passes()))
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise click.BadParameter(
            f"expected MODULE:NAME or a pass id, got {spec!r}{hint}", param_hint="--pattern"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}", param_hint="--pattern") from exc
    if not hasattr(module, name):
        raise _Failure(f"--pattern: module {module_name!r} has no {name!r}")
    return getattr(module, name)


@main.command(name="passes", epilog=_EPILOG)
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def list_passes(as_json: bool) -> None:
    """List the generic passes in the order `optimize` runs them, with what each replaces."""
    from ..passes.registry import generic_passes
    from .mlpackage import pass_plan

    registered = generic_passes()
    leaders = {f.pass_id: c.pass_id for c in registered.values() for f in c.followers}
    rows: list[dict[str, Any]] = []
    for position, pass_id in enumerate(dict.fromkeys(pass_plan()), 1):
        container = registered[pass_id]
        replaces = container.replaces.__name__ if container.replaces is not None else None
        rows.append(
            {
                "order": position,
                "id": pass_id,
                "replaces": replaces,
                "run_after": leaders.get(pass_id),
                "patterns": container.order,
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    for row in rows:
        what = f"replaces coremltools' {row['replaces']}" if row["replaces"] else "new pass"
        if row["run_after"]:
            what += f", runs after {row['run_after']}"
        names = row["patterns"]
        shown = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ... ({len(names)} in all)"
        click.echo(f"{row['order']:3d}. {row['id']:45s} {what}; patterns: {shown}")


@main.command(name="suggest", epilog=_EPILOG)
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--max-ops", default=8, show_default=True, help="Most ops in a candidate.")
@click.option("--top", default=10, show_default=True, help="Candidates to show.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write one .py per candidate shown (the pattern, a transform stub) to this directory.",
)
@_fail_cleanly
def suggest_fusions(source: Path, max_ops: int, top: int, out_dir: Path | None) -> None:
    """List the repeated subgraphs of SOURCE no registered pass fuses, by ops a fusion would save."""
    from ..inspecting.suggest import candidate_module, suggest
    from .mlpackage import load_mlpackage

    candidates = suggest(load_mlpackage(source).program, max_ops=max_ops)[:top]
    if not candidates:
        click.echo("no repeated subgraph to suggest")
    for rank, cand in enumerate(candidates, 1):
        click.echo(f"{rank:3d}. saves {cand.saved:5d}  x{cand.count:<4d} {' -> '.join(cand.op_types)}")
        click.echo(f"       first at {', '.join(cand.where[0])}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for rank, cand in enumerate(candidates, 1):
            path = out_dir / f"candidate_{rank:02d}.py"
            path.write_text(candidate_module(cand, rank, source.name))
            click.echo(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    main()
