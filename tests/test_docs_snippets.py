"""Every ```python block of README.md and docs/*.md runs, so no snippet goes stale.

One fresh interpreter per file (a process forked from one that has imported coremltools and torch once,
``tests/forked.py``); its blocks run in order in one namespace, as a reader would paste them into
one session. A failing block fails the test with the file and line where the block starts, and the
traceback points at the line of the markdown file. Other fences (```text, ```sh, ...) are not run; a
```text block right after a python block (only blank lines between them) is what that block prints, and
the test compares the two.

A block that needs a long conversion is marked with the line ``<!-- snippet: slow -->`` right before
its fence: it runs only under ``pytest --run-slow`` (``make models``), so later blocks of the same file
must not need what it defines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import forked
import pytest

ROOT = Path(__file__).resolve().parents[1]
SLOW_MARK = "<!-- snippet: slow -->"
_OPENING = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")

_RUNNER = r"""
import contextlib, io, json, sys, traceback
job = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
printed = []
for block in job["blocks"]:
    code = "\n" * (block["line"] - 1) + block["code"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, job["path"], "exec"), namespace)
    except BaseException:
        sys.stdout.write(out.getvalue())
        traceback.print_exc()
        print(f"FAILED BLOCK: {job['path']}:{block['line']}", file=sys.stderr)
        sys.exit(1)
    sys.stdout.write(out.getvalue())
    printed.append(out.getvalue())
with open(job["printed"], "w") as f:
    json.dump(printed, f)
print(f"ran {len(job['blocks'])} blocks of {job['path']}")
"""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown file."""

    line: int
    """1-based line of the block's first code line in the file."""
    code: str
    """The code, with the fence's indentation removed."""
    slow: bool
    """The line before the fence is ``<!-- snippet: slow -->``."""
    prints: str | None = None
    """The ```text block right after it (only blank lines between): what the block prints."""


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPENING.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, lang = opening["indent"], opening["fence"], opening["lang"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if end == len(lines):
            raise ValueError(f"line {i + 1}: the {fence} fence opened here is never closed")
        if lang == "python":
            body = [
                line[len(indent) :] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1 : end]
            ]
            slow = i > 0 and lines[i - 1].strip() == SLOW_MARK
            blocks.append(Block(i + 2, "\n".join(body) + "\n", slow, _text_after(lines, end + 1)))
        i = end + 1
    return blocks


def _text_after(lines: list[str], start: int) -> str | None:
    """The body of a ```text block opening at ``start`` after blank lines, else None."""
    while start < len(lines) and not lines[start].strip():
        start += 1
    opening = _OPENING.match(lines[start]) if start < len(lines) else None
    if opening is None or opening["lang"] != "text":
        return None
    end = start + 1
    while end < len(lines) and lines[end].strip() != opening["fence"]:
        end += 1
    return "\n".join(line[len(opening["indent"]) :] for line in lines[start + 1 : end])


def _same_text(printed: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]

    return lines(printed) == lines(expected)


def run_markdown(path: Path, *, run_slow: bool, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the python blocks of ``path`` in order in one fresh interpreter (slow ones only if asked)."""
    blocks = [b for b in python_blocks(path.read_text()) if run_slow or not b.slow]
    job = {
        "path": str(path),
        "blocks": [{"line": b.line, "code": b.code} for b in blocks],
        "printed": str(cwd / "printed.json"),
    }
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_EXPERIMENTAL_PASSES"}
    env.update(HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])  # this checkout
    return forked.run(["-c", _RUNNER], input=json.dumps(job), cwd=cwd, env=env, timeout=1800)


def _failure(done: subprocess.CompletedProcess[str]) -> str:
    where = [line for line in done.stderr.splitlines() if line.startswith("FAILED BLOCK: ")]
    return f"{where[-1] if where else 'the interpreter failed'}\n{done.stderr[-6000:]}"


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WITH_PYTHON = [path for path in DOCS if python_blocks(path.read_text())]


@pytest.mark.parametrize("path", WITH_PYTHON, ids=[str(p.relative_to(ROOT)) for p in WITH_PYTHON])
def test_every_python_block_runs(path, request, tmp_path):
    run_slow = request.config.getoption("--run-slow")
    done = run_markdown(path, run_slow=run_slow, cwd=tmp_path)
    assert done.returncode == 0, _failure(done)
    blocks = [b for b in python_blocks(path.read_text()) if run_slow or not b.slow]
    printed = json.loads((tmp_path / "printed.json").read_text())
    for block, out in zip(blocks, printed, strict=True):
        if block.prints is not None:
            assert _same_text(out, block.prints), (
                f"{path}:{block.line}: the ```text block after this python block is not what it prints; "
                f"it prints:\n{out}"
            )


def test_the_readme_walkthrough_is_collected():
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len([b for b in blocks if not b.slow]) >= 3
    assert any("pattern_from_torch" in b.code and "register_generic_pass" in b.code for b in blocks)


def test_only_python_fences_are_collected_with_their_lines_and_slow_mark():
    text = "\n".join(
        [
            "# title",  # 1
            "```python",  # 2
            "a = 1",  # 3
            "```",  # 4
            "```sh",  # 5
            "make test",  # 6
            "```",  # 7
            SLOW_MARK,  # 8
            "```python",  # 9
            "b = 2",  # 10
            "```",  # 11
            "* item:",  # 12
            "  ```python",  # 13
            "  c = 3",  # 14
            "  ```",  # 15
            "````text",  # 16
            "```python",  # 17  (text inside a longer fence)
            "````",  # 18
        ]
    )
    assert python_blocks(text) == [
        Block(3, "a = 1\n", False),
        Block(10, "b = 2\n", True),
        Block(14, "c = 3\n", False, "```python"),  # the text block right after it: what it prints
    ]


def test_a_broken_block_fails_with_its_file_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "```python",
                "shared = 41",
                "```",
                "```text",
                "this is not python",
                "```",
                "```python",
                "assert shared == 41  # the blocks share one namespace",
                "result = shared + undefined_name",
                "```",
            ]
        )
        + "\n"
    )
    done = run_markdown(page, run_slow=False, cwd=tmp_path)
    assert done.returncode == 1
    message = _failure(done)
    assert message.startswith(f"FAILED BLOCK: {page}:8")
    assert "NameError: name 'undefined_name' is not defined" in message
    assert f'File "{page}", line 9' in message  # the traceback points at the markdown line
    page.write_text(page.read_text().replace("undefined_name", "1"))
    assert run_markdown(page, run_slow=False, cwd=tmp_path).returncode == 0


def test_a_slow_block_runs_only_when_asked(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"{SLOW_MARK}\n```python\nraise SystemExit('the slow block ran')\n```\n")
    assert run_markdown(page, run_slow=False, cwd=tmp_path).returncode == 0
    done = run_markdown(page, run_slow=True, cwd=tmp_path)
    assert done.returncode == 1 and "FAILED BLOCK" in done.stderr and "the slow block ran" in done.stderr
