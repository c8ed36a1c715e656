"""The HTML report: the drawn graphs, the page, and that it renders in a real (headless) browser.

The browser test needs Chromium at /usr/bin/chromium (or `chromium` on PATH). It is skipped, with the
reason, where Chromium is absent; `.ci/run` installs it (apt-get) before `make test`. With
UPDATE_REPORT_PNG=1 it also refreshes docs/report.png, the picture in the README.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from coremltools.converters.mil import Builder as mb

import pattern_infra
from pattern_infra import register_generic_pass
from pattern_infra.cli.commands import main
from pattern_infra.inspecting.report import draw_graph, write_html_report
from pattern_infra.inspecting.tracing import OpRecord
from pattern_infra.testing.passes import relu_exp, to_softplus

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_draw_graph_draws_every_op_input_constant_and_output():
    ops = [
        OpRecord("m", "mul", ["x", "c"], ["m"], {"c": "1.702"}),
        OpRecord("s", "sigmoid", ["m"], ["s"]),
        OpRecord("out", "mul", ["x", "s"], ["out"]),
    ]
    root = ET.fromstring(draw_graph(ops, "before"))
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert sorted(labels) == sorted(["mul", "sigmoid", "mul", "x", "1.702", "out"])
    assert len(list(root.iter(f"{SVG}ellipse"))) == 2  # input x (shared by two ops) and output out
    assert len(list(root.iter(f"{SVG}path"))) == 1 + 6  # the arrow head, and six edges
    boxes = {r.get("stroke") for r in root.iter(f"{SVG}rect")}
    assert boxes == {"#c5221f", "#9aa0a6"}  # matched ops red, the constant grey
    tops = {t.text: float(t.get("y")) for t in root.iter(f"{SVG}text") if t.text in ("x", "sigmoid", "out")}
    assert tops["x"] < tops["sigmoid"] < tops["out"]  # layered top to bottom


def two_instances():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        a = mb.exp(x=mb.relu(x=x, name="r1"), name="e1")
        return mb.exp(x=mb.relu(x=a, name="r2"), name="e2")

    return prog


def test_report_from_a_trace_lists_every_rewrite(namespace, tmp_path):
    container = register_generic_pass(relu_exp, None, to_softplus, "softplus", namespace)
    with pattern_infra.trace() as rewrites:
        container(two_instances())
    page = write_html_report(rewrites, tmp_path / "out", title="toy")
    text = page.read_text()
    assert text.count('<section class="rewrite"') == 2
    assert "r1, e1" in text and "r2, e2" in text and '<img src="histogram.svg"' not in text
    for index in range(2):
        for kind in ("before", "after"):
            ET.parse(tmp_path / "out" / f"rewrite{index}_{kind}.svg")  # well-formed SVG


def _chromium(*args: str, user_dir: Path) -> str:
    done = subprocess.run(
        [CHROMIUM, *HEADLESS, f"--user-data-dir={user_dir}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (apt-get install chromium; "
    ".ci/run installs it before make test)",
)
def test_report_renders_in_headless_chromium(saved, tmp_path):
    out = tmp_path / "html"
    result = CliRunner().invoke(main, ["report", str(saved["path"]), "--html", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    page = out / "index.html"
    rewrites = [line for line in result.output.splitlines() if " -> " in line and " in main/" in line]
    assert len(rewrites) == 5
    dom = _chromium("--virtual-time-budget=10000", "--dump-dom", page.as_uri(), user_dir=tmp_path / "profile")
    assert "pictures: 11, broken: 0" in dom  # the histogram and two graphs per rewrite, every one loaded
    assert dom.count('<section class="rewrite"') == 5
    for line in rewrites:  # every rewrite listed, with its matched ops
        matched = line.split(": ", 1)[1].split(" -> ")[0]
        assert matched in dom
    shot = tmp_path / "report.png"
    _chromium(
        "--window-size=1100,1400",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        page.as_uri(),
        user_dir=tmp_path / "profile",
    )
    assert _png_size(shot) == (1100, 1400)
    if os.environ.get("UPDATE_REPORT_PNG") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "report.png")
    (out / "rewrite3_after.svg").unlink()  # the check itself can fail: a missing picture is counted
    dom = _chromium("--virtual-time-budget=10000", "--dump-dom", page.as_uri(), user_dir=tmp_path / "profile")
    assert "pictures: 11, broken: 1" in dom


def test_without_matplotlib_the_html_report_names_the_extra(namespace, tmp_path, monkeypatch):
    container = register_generic_pass(relu_exp, None, to_softplus, "softplus", namespace)
    with pattern_infra.trace() as rewrites:
        container(two_instances())
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if absent
    with pytest.raises(pattern_infra.PatternInfraError, match=r"pip install 'mil-pattern-infra\[report\]'"):
        write_html_report(rewrites, tmp_path, before={"relu": 2}, after={"softplus": 2})
