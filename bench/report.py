"""Turns measurements into the printed table, the PASS/FAIL targets, ``results.json`` and the plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .runners import RUNNER_KEYS, RUNNER_LABELS
from .suites import ChainRow

__all__ = [
    "FLOOR_RATIO_TARGET",
    "K_TIME_TOLERANCE",
    "SPEEDUP_N",
    "SPEEDUP_TARGET",
    "Target",
    "chain_table",
    "evaluate_targets",
    "fmt_seconds",
    "plot_scaling",
    "write_json",
]

SPEEDUP_N = 200
"""The GELU chain length at which ours must beat both coremltools runners by SPEEDUP_TARGET."""
SPEEDUP_TARGET = 20.0
"""Required (a)/(c) and (b)/(c) at N = SPEEDUP_N."""
FLOOR_RATIO_TARGET = 1.75
"""Required upper bound of (c)/(d) at every N."""
FLOOR_MAX_N = 2000
"""The floor target covers every measured N up to this."""
K_TIME_TOLERANCE = 1.25
"""Best GELU time with the most dummies may exceed the one with none by this factor (timing noise)."""


@dataclass
class Target:
    """One goal of the benchmark and whether it was met."""

    name: str
    """What is required."""
    status: str
    """``PASS``, ``FAIL`` or ``NOT MEASURED``."""
    detail: str
    """The numbers behind the status."""
    cpu_status: str = ""
    """The verdict of the same rule on CPU time (empty when not applicable)."""


def fmt_seconds(seconds: float | None) -> str:
    """``51.2 ms``, ``5.38 s``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x"


def _cell(row: ChainRow, key: str, notes: list[str]) -> str:
    timing = row.timings.get(key)
    if timing is None:
        return "-"
    if key in row.void:
        return f"VOID (wrong result) {fmt_seconds(timing.seconds)}"
    if timing.seconds is None:
        note = timing.note or "-"
        if len(note) <= 40:
            return note
        if note not in notes:
            notes.append(note)
        return f"{note.split(':')[0]} [{notes.index(note) + 1}]"
    return fmt_seconds(timing.seconds) + ("" if timing.repeats > 1 else " (1 run)")


def chain_table(rows: Sequence[ChainRow], skipped: dict[str, str]) -> str:
    """The side-by-side table of every chain workload, then one line per skipped workload."""
    header = ["workload", "N", "ops"]
    header += [f"({k}) {RUNNER_LABELS[k]}" for k in RUNNER_KEYS]
    header += ["a/c", "b/c", "c/d", "c/d cpu", "ours binds/N", "check"]
    body: list[list[str]] = []
    notes: list[str] = []
    for row in rows:
        a, b, c, d = (row.seconds(k) for k in RUNNER_KEYS)
        binds = row.ours_stats.get("bind_attempts")
        check = "ok" if not row.problems else "FAIL: " + "; ".join(row.problems)
        if not row.problems and row.same_text:
            same = [k for k, v in row.same_text.items() if v]
            check += f" (str == (a): {','.join(same) or 'none'})"
        body.append(
            [row.workload, str(row.n), str(row.ops)]
            + [_cell(row, k, notes) for k in RUNNER_KEYS]
            + [
                _fmt_ratio(_ratio(a, c)),
                _fmt_ratio(_ratio(b, c)),
                _fmt_ratio(_ratio(c, d)),
                _fmt_ratio(_ratio(row.seconds("c", cpu=True), row.seconds("d", cpu=True))),
                "-" if binds is None else f"{binds / row.n:.1f}",
                check,
            ]
        )
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    right = {1, 2} | set(range(3, len(header) - 1))

    def line(cells: list[str]) -> str:
        return " | ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [line(header), "-+-".join("-" * w for w in widths)]
    previous = None
    for cells in body:
        if previous is not None and cells[0] != previous:
            out.append("-+-".join("-" * w for w in widths))
        previous = cells[0]
        out.append(line(cells))
    for i, note in enumerate(notes, 1):
        out.append(f"[{i}] {note}")
    for workload, note in skipped.items():
        out.append(f"{workload}: {note}")
    return "\n".join(out)


def evaluate_targets(
    rows: Sequence[ChainRow],
    k_results: Sequence[dict[str, Any]] | None,
    transformer: dict[str, Any] | None,
    quick: bool,
) -> list[Target]:
    """Checks each goal of the benchmark against the measurements.

    The status is decided on wall time (``time.perf_counter``); ``cpu_status`` gives the verdict the same
    rule reaches on the CPU time of the benchmark thread, which other processes on the machine do not
    inflate.
    """
    targets: list[Target] = []
    gelu = {r.n: r for r in rows if r.workload == "gelu"}

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    row = gelu.get(SPEEDUP_N)
    name = f"GELU N={SPEEDUP_N}: ours >= {SPEEDUP_TARGET:g}x faster than (a) and than (b)"
    if row is None or row.seconds("c") is None:
        targets.append(
            Target(name, "NOT MEASURED", f"N={SPEEDUP_N} not in this run" + (" (--quick)" if quick else ""))
        )
    else:
        found = {}
        for cpu in (False, True):
            a_c = _ratio(row.seconds("a", cpu), row.seconds("c", cpu))
            b_c = _ratio(row.seconds("b", cpu), row.seconds("c", cpu))
            ok = a_c is not None and b_c is not None and a_c >= SPEEDUP_TARGET and b_c >= SPEEDUP_TARGET
            found[cpu] = (verdict(ok), f"a/c = {_fmt_ratio(a_c)}, b/c = {_fmt_ratio(b_c)}")
        detail = f"wall: {found[False][1]}; CPU: {found[True][1]}"
        targets.append(Target(name, found[False][0], detail, found[True][0]))

    for workload in dict.fromkeys(r.workload for r in rows):
        measured = [r for r in rows if r.workload == workload and r.n <= FLOOR_MAX_N]
        name = f"{workload}: ours <= {FLOOR_RATIO_TARGET:g}x the rewrite floor for every N <= {FLOOR_MAX_N}"
        found = {}
        for cpu in (False, True):
            ratios = [(r.n, _ratio(r.seconds("c", cpu), r.seconds("d", cpu))) for r in measured]
            missing = [n for n, v in ratios if v is None]
            if not ratios or missing:
                found[cpu] = ("FAIL", f"no valid (c)/(d) at N = {missing or 'any'}")
                continue
            worst_n, worst = max(ratios, key=lambda item: item[1] or 0.0)
            over = [n for n, v in ratios if v is not None and v > FLOOR_RATIO_TARGET]
            text = f"worst c/d {worst:.2f}x at N={worst_n}, over target at N = {over or 'none'}"
            found[cpu] = (verdict(not over), text)
        detail = f"wall: {found[False][1]}; CPU: {found[True][1]}; N measured: {[r.n for r in measured]}"
        if quick:
            detail += " (quick: small N only)"
        targets.append(Target(name, found[False][0], detail, found[True][0]))

    name = "Transformer convert: override on no slower than off, with the same or fewer ops"
    if transformer is None:
        targets.append(Target(name, "NOT MEASURED", "skipped"))
    else:
        off, on = transformer["off"], transformer["on"]
        fewer = on["ops"][-1] <= off["ops"][-1]
        wall_ok = on["best_seconds"] <= off["best_seconds"] and fewer
        cpu_ok = min(on["cpu_seconds"]) <= min(off["cpu_seconds"]) and fewer
        detail = (
            f"{transformer['n_layers']} layers: off {off['best_seconds']:.2f}s / {off['ops'][-1]} ops, "
            f"on {on['best_seconds']:.2f}s / {on['ops'][-1]} ops (best of {len(on['seconds'])}; CPU time "
            f"off {min(off['cpu_seconds']):.2f}s, on {min(on['cpu_seconds']):.2f}s)"
        )
        targets.append(Target(name, verdict(wall_ok), detail, verdict(cpu_ok)))

    name = (
        f"Matching cost independent of unrelated sub-passes: GELU bind_attempts equal for every K, and "
        f"the pass's time at the largest K <= {K_TIME_TOLERANCE:g}x its time at K=0"
    )
    if not k_results:
        targets.append(Target(name, "NOT MEASURED", "skipped"))
    else:
        binds = {e["k"]: e["gelu_bind_attempts"] for e in k_results}
        first, last = k_results[0], k_results[-1]
        whole = last["best_seconds"] / first["best_seconds"]
        whole_cpu = last["best_cpu_seconds"] / first["best_cpu_seconds"]
        gelu_only = last["best_gelu_seconds"] / first["best_gelu_seconds"]
        binds_ok = len(set(binds.values())) == 1 and all(e["ok"] for e in k_results)
        detail = (
            f"GELU bind_attempts by K: {binds} ({'equal' if binds_ok else 'NOT equal'}); dummy "
            f"bind_attempts: { {e['k']: e['dummy_bind_attempts'] for e in k_results} }; K={last['k']} vs "
            f"K={first['k']}: whole pass {whole:.2f}x wall / {whole_cpu:.2f}x CPU; the GELU sub-passes' own "
            f"sweeps {gelu_only:.2f}x"
        )
        targets.append(
            Target(
                name,
                verdict(binds_ok and whole <= K_TIME_TOLERANCE),
                detail,
                verdict(binds_ok and whole_cpu <= K_TIME_TOLERANCE),
            )
        )
    return targets


def k_table(k_results: Sequence[dict[str, Any]]) -> str:
    """One line per K."""
    lines = [
        "K dummies | sub-passes | whole pass | whole pass cpu | GELU sub-passes | GELU bind_attempts | "
        "dummy bind_attempts | ok"
    ]
    for e in k_results:
        lines.append(
            f"{e['k']:>9} | {e['sub_passes']:>10} | {fmt_seconds(e['best_seconds']):>10} | "
            f"{fmt_seconds(e['best_cpu_seconds']):>14} | "
            f"{fmt_seconds(e['best_gelu_seconds']):>15} | {e['gelu_bind_attempts']:>18} | "
            f"{e['dummy_bind_attempts']:>19} | {'ok' if e['ok'] else e.get('problem', 'FAIL')}"
        )
    return "\n".join(lines)


def transformer_table(result: dict[str, Any]) -> str:
    """Times and op counts of the conversions."""
    lines = [f"model: {result['model']}, {result['n_layers']} layers; export {result['export_seconds']:.1f}s"]
    for label in ("off", "on"):
        side = result[label]
        runs = ", ".join(f"{s:.2f}" for s in side["seconds"])
        lines.append(
            f"override {label:<3}: best {side['best_seconds']:.2f}s (runs: {runs}; best CPU "
            f"{min(side['cpu_seconds']):.2f}s); non-const ops "
            f"{side['ops'][-1]}{'' if side['stable_ops'] else ' (varied: ' + str(side['ops']) + ')'}"
        )
    off, on = result["off"]["op_types"], result["on"]["op_types"]
    changed = {
        t: (off.get(t, 0), on.get(t, 0)) for t in sorted(set(off) | set(on)) if off.get(t, 0) != on.get(t, 0)
    }
    lines.append(
        "op types that changed (off -> on): " + ", ".join(f"{t} {a}->{b}" for t, (a, b) in changed.items())
    )
    lines.append(f"generic passes that rewrote (rewrites): {result['on'].get('generic_rewrites', {})}")
    return "\n".join(lines)


def _row_json(row: ChainRow) -> dict[str, Any]:
    return {
        "workload": row.workload,
        "n": row.n,
        "ops": row.ops,
        "runners": {
            key: {
                "label": RUNNER_LABELS[key],
                "best_seconds": row.seconds(key),
                "all_seconds": timing.all_seconds,
                "best_cpu_seconds": None if key in row.void else timing.cpu_seconds,
                "repeats": timing.repeats,
                "note": timing.note,
                "void": key in row.void,
            }
            for key, timing in row.timings.items()
        },
        "ratios": {
            "a/c": _ratio(row.seconds("a"), row.seconds("c")),
            "b/c": _ratio(row.seconds("b"), row.seconds("c")),
            "c/d": _ratio(row.seconds("c"), row.seconds("d")),
            "c/d cpu": _ratio(row.seconds("c", cpu=True), row.seconds("d", cpu=True)),
        },
        "ours_stats_per_run": row.ours_stats,
        "str_equal_to_a": row.same_text,
        "problems": row.problems,
    }


def write_json(
    path: Path,
    meta: dict[str, Any],
    rows: Sequence[ChainRow],
    skipped: dict[str, str],
    k_results: Sequence[dict[str, Any]] | None,
    transformer: dict[str, Any] | None,
    targets: Sequence[Target],
) -> None:
    """Writes every measurement and target to ``path``."""
    data = {
        "meta": meta,
        "chains": [_row_json(r) for r in rows],
        "skipped_workloads": skipped,
        "k_independence": list(k_results or []),
        "transformer": transformer,
        "targets": [
            {"name": t.name, "status": t.status, "cpu_status": t.cpu_status, "detail": t.detail}
            for t in targets
        ],
    }
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


_STYLE = {
    "a": dict(color="#d62728", marker="o"),
    "b": dict(color="#ff7f0e", marker="s"),
    "c": dict(color="#1f77b4", marker="^"),
    "d": dict(color="#2ca02c", marker="v"),
}


def plot_scaling(path: Path, rows: Sequence[ChainRow], title_note: str = "") -> None:
    """Log-log plots of time against N for each runner on the GELU chains, wall time and CPU time.

    Skipped coremltools runs are drawn hollow at their predicted time; O(N) and O(N^2) guides pass
    through ours' first point.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    gelu = [r for r in rows if r.workload == "gelu"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 6.2), dpi=110, sharey=True)
    all_n = [r.n for r in gelu]
    for ax, cpu in zip(axes, (False, True)):
        for key in RUNNER_KEYS:
            points = [(r.n, r.seconds(key, cpu)) for r in gelu if r.seconds(key, cpu)]
            if not points:
                continue
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=f"({key}) {RUNNER_LABELS[key]}", linewidth=2, markersize=7, **_STYLE[key])
            skipped = [r.n for r in gelu if r.timings.get(key) and r.timings[key].note.startswith("skipped")]
            if skipped and len(points) >= 2:
                (n0, t0), (n1, t1) = points[-2], points[-1]
                exponent = max(2.0, math.log(t1 / t0) / math.log(n1 / n0))
                px = [n1] + skipped
                py = [t1 * (n / n1) ** exponent for n in px]
                ax.plot(
                    px,
                    py,
                    linestyle=":",
                    color=_STYLE[key]["color"],
                    marker=_STYLE[key]["marker"],
                    markerfacecolor="none",
                    markersize=7,
                    label=f"({key}) skipped: predicted",
                )
        ours = [(r.n, r.seconds("c", cpu)) for r in gelu if r.seconds("c", cpu)]
        if ours and all_n:
            n0, t0 = ours[0]
            xs = [min(all_n), max(all_n)]
            ax.plot(
                xs, [t0 * x / n0 for x in xs], color="gray", linestyle="--", linewidth=1, label="O(N) guide"
            )
            ax.plot(
                xs,
                [t0 * (x / n0) ** 2 for x in xs],
                color="gray",
                linestyle="-.",
                linewidth=1,
                label="O(N²) guide",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        if all_n:
            ax.xaxis.set_major_locator(FixedLocator(all_n))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(axis="x", labelrotation=45)
        ax.set_xlabel("N (tanh-GELU blocks in the chain; 8 pattern ops + 1 relu each)")
        ax.set_title(
            "CPU time of the benchmark thread (time.thread_time)" if cpu else "wall time (time.perf_counter)"
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("seconds per run (best of repeats)")
    axes[0].legend(loc="upper left", fontsize=9)
    fig.suptitle(
        "common::fuse_gelu_tanh_approximation on GELU chains: coremltools vs ours vs the rewrite floor"
        + (f"\n{title_note}" if title_note else "")
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
