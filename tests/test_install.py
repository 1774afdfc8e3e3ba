""".ci/requirements.py: what .ci/setup.sh installs is the project's requirements, triton left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+; .ci/requirements.py has pip's parser too)

ROOT = Path(__file__).resolve().parent.parent


def listed(*args):
    proc = subprocess.run(
        [sys.executable, ".ci/requirements.py", *args], cwd=ROOT, check=True, capture_output=True, text=True,
    )
    return [Requirement(line) for line in proc.stdout.splitlines()]


def test_setup_installs_every_requirement_but_triton():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"] + project["optional-dependencies"]["bench"]
    names = {req.name for req in listed("test", "bench")}
    for line in wanted:
        name = Requirement(line).name
        if name != "xgrammar":
            assert name in names, name
    # xgrammar itself goes in alone (--no-deps); in its place, what it needs but triton.
    assert "xgrammar" not in names and "triton" not in names
    assert "apache-tvm-ffi" in names
    assert [str(req) for req in listed("--spec", "xgrammar")] == [
        next(line for line in project["dependencies"] if Requirement(line).name == "xgrammar")
    ]
