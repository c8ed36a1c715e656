"""docs/PASSES.md has a section for every registered generic pass, and the README's table names each one."""

from __future__ import annotations

import re
from pathlib import Path

from pattern_infra import generic_passes

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PASSES = sorted(generic_passes())
"""The passes ``import generic_passes`` registers (conftest.py): read at collection, before any test
registers passes of its own."""


def test_passes_md_has_one_section_per_registered_generic_pass():
    sections = re.findall(r"^### `([a-z_]+::[a-z0-9_]+)`$", (ROOT / "docs" / "PASSES.md").read_text(), re.M)
    assert len(sections) == len(set(sections))
    assert sorted(sections) == PROJECT_PASSES, (
        "docs/PASSES.md: add a section (the module docstring, as markdown) for each new pass, remove the "
        "sections of removed passes"
    )


def test_the_readme_table_names_every_generic_pass():
    readme = (ROOT / "README.md").read_text()
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| `"))
    missing = [
        pass_id
        for pass_id in PROJECT_PASSES
        if f"`{pass_id}`" not in table and not re.search(rf", `{re.escape(pass_id.split('::')[1])}`", table)
    ]
    assert missing == []
