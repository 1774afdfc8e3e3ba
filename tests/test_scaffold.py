"""`batchyard plugins new` writes a package that installs (`pip install -e`) and passes its own test."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from framework.scaffold import write_skeleton

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", ["policy", "observer"])
def test_new_plugin_installs_and_passes_its_own_test(tmp_path, kind):
    name = f"demo-{kind}"
    subprocess.run(
        [sys.executable, "-m", "framework.cli", "plugins", "new", name, "--kind", kind, "--dir", str(tmp_path)],
        check=True, cwd=ROOT, capture_output=True, text=True,
    )
    package = tmp_path / f"batchyard-{name}"
    # Installed into a prefix of its own, so the project's environment is left as it was.
    prefix = tmp_path / "prefix"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--prefix", str(prefix), "-e", str(package)],
        check=True, capture_output=True, text=True,
    )
    site_dir = sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})
    run_tests = (
        "import site, sys, pytest; site.addsitedir(sys.argv[1]);"
        "from framework.plugins import discover_plugins;"
        f"assert discover_plugins()[{name!r}].source == 'entry point';"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[2]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run_tests, site_dir, str(package / "tests")],
        cwd=package, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


@pytest.mark.parametrize("name, kind, message", [
    ("Bad_Name", "policy", "lowercase"),
    ("ok", "cache", "--kind 'cache'"),
])
def test_new_plugin_refuses_bad_input(tmp_path, name, kind, message):
    with pytest.raises(ValueError, match=message):
        write_skeleton(name, kind, tmp_path)


def test_new_plugin_refuses_an_existing_folder(tmp_path):
    write_skeleton("twice", "policy", tmp_path)
    with pytest.raises(ValueError, match="already exists"):
        write_skeleton("twice", "policy", tmp_path)
