"""Plugin discovery and selection: entry points, names, blocking, check_pending, the CLI listing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from framework import hookimpl
from framework.config import Settings
from framework.hookspecs import ALL_HOOKS
from framework.plugins import DEFAULT_PLUGINS, PluginError, PluginManager, discover_plugins

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_entry_points_list_every_bundled_plugin():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = data["project"]["entry-points"]["batchyard"]
    assert declared == dict(DEFAULT_PLUGINS)


def test_bundled_plugins_come_through_entry_points():
    found = discover_plugins()
    for name, _ in DEFAULT_PLUGINS:
        assert found[name].source == "entry point", name
        assert found[name].error is None


def test_the_test_plugin_package_is_installed_as_a_third_party_plugin():
    info = discover_plugins()["lifo"]
    assert info.kind == "policy" and info.source == "entry point"
    assert info.module_name == "batchyard_testplugin.lifo"


def test_exactly_one_of_each_kind_is_active():
    manager = PluginManager(Settings.load(None, plugins={"policy": "fcfs", "cache": "chunk"}))
    active_by_kind = {}
    for name, info in manager.active.items():
        active_by_kind.setdefault(info.kind, []).append(name)
    assert active_by_kind["policy"] == ["fcfs"]
    assert active_by_kind["cache"] == ["chunk"]
    assert active_by_kind["worker"] == ["tp"]  # the default
    assert manager.pm.is_blocked("lpm") and manager.pm.is_blocked("radix")


@pytest.mark.parametrize("kind, name", [("policy", "lpmm"), ("cache", "radx"), ("worker", "gpu9")])
def test_unknown_name_lists_the_installed_ones(kind, name):
    with pytest.raises(PluginError) as info:
        PluginManager(Settings.load(None, plugins={kind: name}))
    msg = str(info.value)
    assert f"plugins.{kind}: unknown {kind} plugin {name!r}" in msg
    expected = {"policy": "fcfs", "cache": "chunk", "worker": "tp"}[kind]
    assert expected in msg


def test_a_plugin_of_the_wrong_kind_is_named():
    with pytest.raises(PluginError, match="'radix' is a cache plugin"):
        PluginManager(Settings.load(None, plugins={"policy": "radix"}))


def test_misspelled_hook_fails_at_startup():
    class Typo:
        @hookimpl
        def select_prefil(self, view, adder):  # noqa: D401 - the typo is the point
            return None

    with pytest.raises(PluginError, match="unknown hook"):
        PluginManager(Settings.load(None), extra_plugins=(Typo(),))


def test_disable_leaves_a_default_plugin_inactive():
    manager = PluginManager(Settings.load(None, plugins={"disable": ["dp-attention"]}))
    assert "dp-attention" not in manager.active
    assert manager.pm.get_plugin("core-defaults") is not None  # the core's fallbacks stay


class ObserverWithPolicyHook:
    PLUGIN_KIND = "observer"

    @hookimpl
    def select_prefill(self, view):
        return list(view.waiting_queue)


def test_an_observer_implementing_select_prefill_is_refused_at_startup():
    with pytest.raises(PluginError) as info:
        PluginManager(Settings.load(None), extra_plugins=(ObserverWithPolicyHook(),))
    msg = str(info.value)
    assert "observer plugin" in msg and "'select_prefill'" in msg and "policy" in msg


@pytest.mark.parametrize("kind, hook, args", [
    ("policy", "create_worker", "settings, tp_rank"),
    ("cache", "select_prefill", "view"),
    ("worker", "on_decode_oom", "batch"),
    ("default", "create_cache", "settings"),
])
def test_every_kind_is_held_to_its_hooks(kind, hook, args):
    namespace = {}
    exec(f"def {hook}(self, {args}):\n    return None", namespace)
    plugin = type("Wrong", (), {"PLUGIN_KIND": kind, hook: hookimpl(namespace[hook])})()
    with pytest.raises(PluginError, match=f"is a {kind} plugin but implements '{hook}'"):
        PluginManager(Settings.load(None), extra_plugins=(plugin,))


def test_installed_plugins_implement_only_their_kinds_hooks():
    from framework.hookspecs import KIND_HOOKS

    for name, info in discover_plugins().items():
        implemented = {a for a in ALL_HOOKS if hasattr(getattr(info.module, a, None), "batchyard_impl")}
        assert implemented <= set(KIND_HOOKS[info.kind]), name


def test_a_duplicate_settings_section_is_refused(tmp_path):
    from pydantic import BaseModel

    class Other(BaseModel):
        x: int = 0

    class SecondLifo:
        PLUGIN_KIND = "observer"

        @hookimpl
        def register_settings(self, register):
            register("lifo", Other)

    with pytest.raises(PluginError, match=r"\[plugin.lifo\] is registered by two plugins: .*'lifo'"):
        PluginManager(Settings.load(None, plugins={"policy": "lifo"}), extra_plugins=(SecondLifo(),))


def test_plugin_names_come_from_entry_points():
    for name, info in discover_plugins().items():
        assert not hasattr(info.module, "PLUGIN_NAME"), f"{name}: the entry point names a plugin"


def test_plugin_settings_section_from_toml(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[plugins]\npolicy = 'lifo'\n[plugin.lifo]\nmax_new_per_round = 3\n")
    settings = Settings.load(path)
    PluginManager(settings)
    assert settings.plugin_section("lifo").max_new_per_round == 3


def test_plugin_settings_are_validated(tmp_path):
    from framework.config import SettingsError

    path = tmp_path / "s.toml"
    path.write_text("[plugins]\npolicy = 'lifo'\n[plugin.lifo]\nmax_new_per_round = -1\n")
    with pytest.raises(SettingsError, match="plugin.lifo.max_new_per_round"):
        PluginManager(Settings.load(path))


def test_cli_lists_plugins_by_kind_and_marks_active():
    out = subprocess.run(
        [sys.executable, "-m", "framework.cli", "plugins", "--plugins.policy", "lifo"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    rows = {tuple(line.split()[:3]) for line in out.splitlines()[1:] if line.split()}
    assert ("policy", "lifo", "*") in rows
    assert ("cache", "radix", "*") in rows
    assert any(r[:2] == ("policy", "lpm") and "*" not in r for r in rows)


def test_cli_unknown_plugin_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "framework.cli", "plugins", "--plugins.policy", "nope"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "unknown policy plugin 'nope'" in proc.stderr
