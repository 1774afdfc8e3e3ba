"""`batchyard plugins new NAME --kind KIND`: write an installable plugin package skeleton.

The package has a pyproject with the `batchyard` entry point, the plugin module and a test that
runs the plugin through `framework.testing.SchedulerHarness`; after `pip install -e DIR` its test
passes (`pytest DIR`), so an author starts from green.
"""

from __future__ import annotations

import re
from pathlib import Path

KINDS = ("policy", "observer")

PYPROJECT = '''[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "batchyard-{name}"
version = "0.1.0"
description = "A batchyard {kind} plugin"
requires-python = ">=3.10"
dependencies = ["batchyard"]

[project.entry-points.batchyard]
{name} = "{package}.plugin"

[tool.setuptools]
packages = ["{package}"]
'''

POLICY = '''"""{name}: a batchyard policy. Shortest prompt first; change `select_prefill` to taste.

Select it with ``[plugins] policy = "{name}"``. The hook gets a read-only view of the scheduler and
returns the waiting requests to admit, in order; the core admits as many as the budget allows.
"""

from framework import hookimpl

PLUGIN_KIND = "policy"


@hookimpl
def select_prefill(view):
    return sorted(view.waiting_queue, key=lambda req: len(req.origin_input_ids))
'''

POLICY_TEST = '''from framework.testing import SchedulerHarness


def test_shortest_prompt_is_admitted_first():
    # One running request at a time, so each prefill batch holds the policy's next choice.
    with SchedulerHarness(policy="{name}", scheduler={{"max_running_requests": 1}}) as harness:
        long, short, middle = harness.add([1] * 9), harness.add([2] * 2), harness.add([3] * 5)
        harness.run()
        assert harness.prefill_batches() == [[short], [middle], [long]]
        harness.check_no_leak()
'''

OBSERVER = '''"""{name}: a batchyard observer. Counts finished requests by finish reason.

Observers are active once installed (unless listed in ``plugins.disable``); they read read-only
views and keep their state in ``view.stash``.
"""

from framework import hookimpl
from framework.request import StashKey

PLUGIN_KIND = "observer"

FINISHED: StashKey[dict] = StashKey("{package}_finished")


@hookimpl
def on_request_finished(req, view):
    counts = view.stash.setdefault(FINISHED, {{}})
    reason = req.finished_reason.to_json()["type"]
    counts[reason] = counts.get(reason, 0) + 1
'''

OBSERVER_TEST = '''from framework.testing import SchedulerHarness
from {package}.plugin import FINISHED


def test_finished_requests_are_counted():
    with SchedulerHarness() as harness:
        harness.add([1, 2, 3], max_new_tokens=2)
        harness.add([4, 5], max_new_tokens=3)
        harness.run()
        assert harness.scheduler.stash[FINISHED] == {{"length": 2}}
        harness.check_no_leak()
'''

TEMPLATES = {"policy": (POLICY, POLICY_TEST), "observer": (OBSERVER, OBSERVER_TEST)}


def write_skeleton(name: str, kind: str, parent: Path) -> Path:
    """Write ``parent/batchyard-NAME/`` and return it; raises ValueError on a bad name or kind,
    or when the folder exists."""
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", name):
        raise ValueError(f"plugin name {name!r}: use lowercase letters, digits and single dashes")
    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r}: one of {', '.join(KINDS)}")
    package = "batchyard_" + name.replace("-", "_")
    root = Path(parent) / f"batchyard-{name}"
    if root.exists():
        raise ValueError(f"{root} already exists")
    module, test = TEMPLATES[kind]
    fields = {"name": name, "kind": kind, "package": package}
    files = {
        "pyproject.toml": PYPROJECT,
        f"{package}/__init__.py": '"""batchyard plugin {name}."""\n',
        f"{package}/plugin.py": module,
        f"tests/test_{package}.py": test,
    }
    for path, text in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text.format(**fields))
    return root
