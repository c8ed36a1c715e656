"""Helpers shared by the command line's tests: run ``mil-patterns`` in process, fingerprint a package."""

from __future__ import annotations

import hashlib
from pathlib import Path

from click.testing import CliRunner, Result

from pattern_infra.cli.commands import main


def digest(package: Path) -> str:
    """A SHA-256 of every file of a package (paths and bytes): equal digests, untouched package."""
    sha = hashlib.sha256()
    for file in sorted(p for p in package.rglob("*") if p.is_file()):
        sha.update(file.relative_to(package).as_posix().encode())
        sha.update(file.read_bytes())
    return sha.hexdigest()


def invoke(*args: object) -> Result:
    """``mil-patterns ARGS...`` in this process, its output captured."""
    return CliRunner().invoke(main, [str(a) for a in args])
