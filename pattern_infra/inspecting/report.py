"""An HTML page of the rewrites a run made: each matched subgraph and its replacement, drawn, and the op
histogram before and after.

``write_html_report(result, "out/")`` writes ``out/index.html`` with one SVG picture per graph next to
it. ``result`` is what :func:`pattern_infra.cli.mlpackage.run_passes` returns (``mil-patterns report --html``
passes it), or the rewrites of a :func:`pattern_infra.trace` block::

    with pattern_infra.trace() as rewrites:
        mlmodel = ct.convert(exported_program, convert_to="mlprogram")
    write_html_report(rewrites, "out/")

The graphs are drawn by :func:`draw_graph`, a small layered layout written here (no graph library, no
program to install); the histogram is a matplotlib figure, saved as SVG (the ``report`` extra:
``pip install 'mil-pattern-infra[report]'``). The page needs no network and no script to show; a short
script only marks pictures that failed to load, and counts them at the bottom.
"""

from __future__ import annotations

import html
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..language.errors import PatternInfraError
from .tracing import OpRecord, Rewrite

__all__ = ["draw_graph", "non_const_ops", "report_text", "write_html_report"]

_ROW = 64
"""Vertical distance between layers, in pixels."""
_GAP = 18
"""Horizontal gap between nodes of a layer."""
_HEIGHT = 30
"""Node height."""

_STYLES = {
    "before": ("#fce8e6", "#c5221f"),
    "after": ("#e6f4ea", "#188038"),
    "input": ("#ffffff", "#5f6368"),
    "const": ("#f1f3f4", "#9aa0a6"),
    "output": ("#ffffff", "#5f6368"),
}


@dataclass
class _Node:
    key: str
    label: str
    kind: str
    title: str
    layer: int = 0
    x: float = 0.0
    width: float = 0.0


def draw_graph(ops: Sequence[OpRecord | Mapping[str, Any]], kind: str = "before") -> str:
    """Draws a small dataflow graph as an SVG document, top to bottom.

    Ops are boxes (op type, then name); variables read from outside the graph are ellipses above them,
    constants grey boxes with their value, and variables no op of the graph reads are ellipses below.

    Args:
        ops: The ops (:class:`~pattern_infra.inspecting.tracing.OpRecord` or their ``to_dict`` form), in
            program order.
        kind: ``"before"`` (matched ops, red) or ``"after"`` (replacement, green).

    Returns:
        The SVG text.
    """
    records = [op if isinstance(op, OpRecord) else OpRecord(**op) for op in ops]
    nodes: dict[str, _Node] = {}
    edges: list[tuple[str, str]] = []
    producer = {var: op.name for op in records for var in op.outputs}
    read = {var for op in records for var in op.inputs}
    for op in records:
        nodes["op:" + op.name] = _Node("op:" + op.name, op.type, kind, f"{op.name} ({op.type})")
    for op in records:
        for var in op.inputs:
            if var in producer:
                source = "op:" + producer[var]
            elif var in op.consts:
                source = f"const:{op.name}:{var}"
                nodes.setdefault(source, _Node(source, op.consts[var], "const", f"{var} = {op.consts[var]}"))
            else:
                source = "in:" + var
                nodes.setdefault(source, _Node(source, var, "input", var))
            edges.append((source, "op:" + op.name))
    for op in records:
        for var in op.outputs:
            if var not in read:
                nodes["out:" + var] = _Node("out:" + var, var, "output", var)
                edges.append(("op:" + op.name, "out:" + var))
    _layer(nodes, edges)
    return _svg(nodes, edges)


def _layer(nodes: dict[str, _Node], edges: list[tuple[str, str]]) -> None:
    """Longest-path layers (sources on top, constants just above their consumer), then x positions with
    one barycentre pass to untangle each layer."""
    preds: dict[str, list[str]] = {key: [] for key in nodes}
    for source, target in edges:
        preds[target].append(source)
    done: dict[str, int] = {}

    def depth(key: str) -> int:
        if key not in done:
            done[key] = 0  # a cycle cannot occur in a dataflow graph; this only guards the recursion
            done[key] = 1 + max((depth(p) for p in preds[key] if nodes[p].kind != "const"), default=-1)
        return done[key]

    for key, node in nodes.items():
        node.layer = depth(key)
    for source, target in edges:
        if nodes[source].kind == "const":
            nodes[source].layer = max(nodes[target].layer - 1, 0)
    for node in nodes.values():
        node.width = max(64.0, 7.2 * len(node.label) + 18)
    layers: dict[int, list[_Node]] = {}
    for node in nodes.values():
        layers.setdefault(node.layer, []).append(node)
    for index in sorted(layers):
        row = layers[index]
        if index > 0:

            def centre(node: _Node, index: int = index) -> float:
                xs = [nodes[p].x + nodes[p].width / 2 for p in preds[node.key] if nodes[p].layer < index]
                return sum(xs) / len(xs) if xs else 0.0

            row.sort(key=centre)
        x = 0.0
        for node in row:
            node.x = x
            x += node.width + _GAP
    widest = max((sum(n.width + _GAP for n in row) for row in layers.values()), default=0.0)
    for row in layers.values():
        shift = (widest - sum(n.width + _GAP for n in row)) / 2
        for node in row:
            node.x += shift + 8


def _svg(nodes: dict[str, _Node], edges: list[tuple[str, str]]) -> str:
    width = max((n.x + n.width for n in nodes.values()), default=100.0) + 8
    height = (max((n.layer for n in nodes.values()), default=0) + 1) * _ROW + 8
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#5f6368"/></marker></defs>',
    ]
    for source, target in edges:
        a, b = nodes[source], nodes[target]
        x1, y1 = a.x + a.width / 2, _top(a) + _HEIGHT
        x2, y2 = b.x + b.width / 2, _top(b)
        mid = (y1 + y2) / 2
        parts.append(
            f'<path d="M {x1:.1f} {y1:.1f} C {x1:.1f} {mid:.1f}, {x2:.1f} {mid:.1f}, {x2:.1f} {y2 - 1:.1f}" '
            f'fill="none" stroke="#5f6368" stroke-width="1.2" marker-end="url(#arrow)"/>'
        )
    for node in nodes.values():
        fill, stroke = _STYLES[node.kind]
        y = _top(node)
        if node.kind in ("input", "output"):
            dash = ' stroke-dasharray="4 3"' if node.kind == "output" else ""
            shape = (
                f'<ellipse cx="{node.x + node.width / 2:.1f}" cy="{y + _HEIGHT / 2:.1f}" '
                f'rx="{node.width / 2:.1f}" ry="{_HEIGHT / 2:.1f}" fill="{fill}" stroke="{stroke}"{dash}/>'
            )
        else:
            shape = (
                f'<rect x="{node.x:.1f}" y="{y:.1f}" width="{node.width:.1f}" height="{_HEIGHT}" rx="6" '
                f'fill="{fill}" stroke="{stroke}" '
                f'stroke-width="{1.6 if node.kind in ("before", "after") else 1}"/>'
            )
        weight = ' font-weight="bold"' if node.kind in ("before", "after") else ""
        parts.append(
            f"<g><title>{html.escape(node.title)}</title>{shape}"
            f'<text x="{node.x + node.width / 2:.1f}" y="{y + _HEIGHT / 2 + 4:.1f}" '
            f'text-anchor="middle"{weight}>'
            f"{html.escape(node.label)}</text></g>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _top(node: _Node) -> float:
    return 4 + node.layer * _ROW


def write_html_report(
    result: Any,
    directory: str | os.PathLike[str],
    *,
    before: Mapping[str, int] | None = None,
    after: Mapping[str, int] | None = None,
    title: str = "MIL rewrites",
) -> Path:
    """Writes ``index.html`` and its pictures to ``directory`` (created if needed).

    Args:
        result: What :func:`pattern_infra.cli.mlpackage.run_passes` returned (rewrites and op counts), or a
            sequence of :class:`~pattern_infra.Rewrite` (e.g. a :func:`pattern_infra.trace`).
        directory: Where to write; existing files of an earlier report there are replaced.
        before: Op counts before the rewrites (default: ``result.before`` if it has them).
        after: Op counts after (default: ``result.after``).
        title: The page's title.

    Returns:
        The path of ``index.html``.

    Raises:
        PatternInfraError: matplotlib, needed for the histogram, is not installed.
    """
    rewrites: list[Rewrite] = list(getattr(result, "rewrites", result))
    before = before if before is not None else getattr(result, "before", None)
    after = after if after is not None else getattr(result, "after", None)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    body = [f"<h1>{html.escape(title)}</h1>"]
    if before is not None and after is not None:
        _histogram(Counter(before), Counter(after), out / "histogram.svg")
        non_const = [sum(n for t, n in counts.items() if t != "const") for counts in (before, after)]
        body.append(
            f'<p class="summary">{len(rewrites)} rewrite(s); '
            f"non-const ops {non_const[0]} &rarr; {non_const[1]}.</p>"
            '<figure><img src="histogram.svg" alt="op histogram before and after"/>'
            "<figcaption>Ops by type, before and after.</figcaption></figure>"
        )
    else:
        body.append(f'<p class="summary">{len(rewrites)} rewrite(s).</p>')
    by_pass: dict[str, list[tuple[int, Rewrite]]] = {}
    for index, rewrite in enumerate(rewrites):
        by_pass.setdefault(rewrite.pass_id, []).append((index, rewrite))
    if by_pass:
        body.append(
            "<nav><ul>"
            + "".join(
                f'<li><a href="#{_anchor(pass_id)}">{html.escape(pass_id)}</a>: {len(items)}</li>'
                for pass_id, items in by_pass.items()
            )
            + "</ul></nav>"
        )
    else:
        body.append("<p>No rewrite.</p>")
    for pass_id, items in by_pass.items():
        body.append(f'<h2 id="{_anchor(pass_id)}">{html.escape(pass_id)} ({len(items)})</h2>')
        for index, rewrite in items:
            pictures = []
            for kind, ops in (("before", rewrite.before), ("after", rewrite.after)):
                name = f"rewrite{index}_{kind}.svg"
                (out / name).write_text(draw_graph(ops, kind), encoding="utf-8")
                count = f"{len(ops)} op{'' if len(ops) == 1 else 's'}"
                pictures.append(
                    f'<figure><figcaption>{kind} ({count})</figcaption><img src="{name}" '
                    f'alt="{kind}"/></figure>'
                )
            replaced = ", ".join(rewrite.replaced_by) or "(outputs redirected)"
            body.append(
                f'<section class="rewrite" id="rewrite{index}" data-pass="{html.escape(pass_id)}">'
                f"<h3>#{index + 1} {html.escape(rewrite.pattern)} in {html.escape(rewrite.function)}/"
                f"{html.escape(rewrite.block)}</h3>"
                f"<p>matched: <code>{html.escape(', '.join(rewrite.matched))}</code> &rarr; "
                f"<code>{html.escape(replaced)}</code></p>"
                f'<div class="pair">{"".join(pictures)}</div></section>'
            )
    page = out / "index.html"
    page.write_text(_PAGE.format(title=html.escape(title), body="\n".join(body)), encoding="utf-8")
    return page


def _anchor(pass_id: str) -> str:
    return "pass-" + "".join(c if c.isalnum() else "-" for c in pass_id)


def _histogram(before: Counter[str], after: Counter[str], path: Path) -> None:
    try:
        from matplotlib.figure import Figure  # no pyplot: no backend chosen for the caller's process
    except ImportError as exc:
        raise PatternInfraError(
            "The HTML report draws its histogram with matplotlib, which is not installed: "
            "pip install 'mil-pattern-infra[report]' (or pip install matplotlib)."
        ) from exc
    types = sorted(set(before) | set(after), key=lambda t: (-max(before[t], after[t]), t))
    figure = Figure(figsize=(8, 0.3 * len(types) + 1.2))
    axes = figure.add_subplot()
    rows = range(len(types))
    axes.barh(
        [r - 0.2 for r in rows], [before[t] for t in types], height=0.4, label="before", color="#c5221f"
    )
    axes.barh([r + 0.2 for r in rows], [after[t] for t in types], height=0.4, label="after", color="#188038")
    axes.set_yticks(list(rows), types)
    axes.invert_yaxis()
    axes.set_xlabel("ops")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})  # no date: the same input, the same file


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #202124; }}
.rewrite {{ border-top: 1px solid #dadce0; padding: 0.5em 0; }}
.pair {{ display: flex; gap: 2em; align-items: flex-start; flex-wrap: wrap; }}
figure {{ margin: 0; }} figcaption {{ color: #5f6368; font-size: 90%; margin-bottom: 0.3em; }}
img[src="histogram.svg"] {{ max-width: 640px; }}
img.broken {{ outline: 3px solid red; }}
</style></head>
<body>
{body}
<p id="render-check">pictures: loading</p>
<script>
window.addEventListener("load", function () {{
  var images = document.images, broken = 0;
  for (var i = 0; i < images.length; i++) {{
    if (!images[i].complete || images[i].naturalWidth === 0) {{ images[i].className = "broken"; broken++; }}
  }}
  document.getElementById("render-check").textContent =
    "pictures: " + images.length + ", broken: " + broken;
}});
</script>
</body></html>
"""


def non_const_ops(counts: Any) -> int:
    """The number of ops of an op histogram that are not ``const``."""
    return sum(n for op_type, n in counts.items() if op_type != "const")


def report_text(result: Any) -> str:
    """``mil-patterns report``'s text: each pass's rewrites, the op counts before and after, and the
    near misses (:func:`pattern_infra.cli.mlpackage.run_passes`' result)."""
    lines = []
    by_pass: dict[str, list[Any]] = {}
    for rewrite in result.rewrites:
        by_pass.setdefault(rewrite.pass_id, []).append(rewrite)
    for pass_id, rewrites in by_pass.items():
        lines.append(f"{pass_id}: {len(rewrites)} rewrite(s)")
        for r in rewrites:
            new = ", ".join(f"{op.name} ({op.type})" for op in r.after) or "outputs redirected"
            lines.append(f"  {r.pattern} in {r.function}/{r.block}: {', '.join(r.matched)} -> {new}")
    if not by_pass:
        lines.append("no generic pass found anything to fuse")
    lines.append(f"non-const ops: {non_const_ops(result.before)} -> {non_const_ops(result.after)}")
    lines.extend(_near_miss_lines(getattr(result, "near_misses", {})))
    return "\n".join(lines)


_NEEDS_TARGET = re.compile(r"needs (iOS\d+|macOS\d+) or later")
"""A refusal worded after the deployment target that would lift it (``needs iOS18 or later (op)``)."""


def _near_miss_lines(near_misses: Any) -> list[str]:
    """Per pass, the places its own checks refused, by reason, and what a newer target would fuse."""
    if not near_misses:
        return []
    lines = ["near misses (refused by a pass's own checks):"]
    for pass_id, reasons in near_misses.items():
        lines.append(f"{pass_id}: {sum(reasons.values())} near miss(es)")
        targets: Counter[str] = Counter()
        for reason, n in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
            lines.append(f"  {n} x {reason}")
            needed = _NEEDS_TARGET.search(reason)
            if needed:
                targets[needed.group(1)] += n
        for target, n in targets.items():
            lines.append(f"  would fuse {n} match{'' if n == 1 else 'es'} at {target}")
    return lines
