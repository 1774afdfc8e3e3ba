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
    assert msg.startswith("plugin 'ObserverWithPolicyHook' is an observer plugin"), msg  # (not its id)


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


def registering(section: str, model: type) -> object:
    """An observer plugin object that registers the settings section `section` with `model`."""

    class Registering:
        PLUGIN_KIND = "observer"

        @hookimpl
        def register_settings(self, register):
            register(section, model)

    return Registering()


def test_a_duplicate_settings_section_is_refused(tmp_path):
    from pydantic import BaseModel

    class Other(BaseModel):
        x: int = 0

    with pytest.raises(PluginError, match=r"\[plugin.lifo\] is registered by two plugins: .*'lifo'"):
        PluginManager(Settings.load(None, plugins={"policy": "lifo"}), extra_plugins=(registering("lifo", Other),))


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


def test_cli_lists_only_the_kind_asked_for():
    out = subprocess.run(
        [sys.executable, "-m", "framework.cli", "plugins", "--kind", "cache"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    kinds = {line.split()[0] for line in out.splitlines()[1:] if line.split()}
    assert kinds == {"cache"}


def test_cli_unknown_plugin_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "framework.cli", "plugins", "--plugins.policy", "nope"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "unknown policy plugin 'nope'" in proc.stderr


def test_a_misspelt_plugin_option_is_refused(tmp_path):
    """As in the core's sections: a key the section's model does not have is an error naming it
    and the options there are, not a setting silently left at its default."""
    from framework.config import SettingsError

    path = tmp_path / "s.toml"
    path.write_text("[plugins]\npolicy = 'lifo'\n[plugin.lifo]\nmax_new_per_rond = 3\n")
    with pytest.raises(SettingsError, match=r"plugin.lifo.max_new_per_rond: Extra inputs are not permitted "
                                            r"\(options: max_new_per_round\)"):
        PluginManager(Settings.load(path))
    with pytest.raises(SettingsError, match="plugin.vtc.input_weigth: Extra inputs are not permitted"):
        PluginManager(Settings.load(None, plugins={"policy": "vtc"}, plugin={"vtc": {"input_weigth": 3}}))


def test_a_plugin_model_that_sets_extra_decides_for_its_section():
    from pydantic import BaseModel, ConfigDict

    class Free(BaseModel):
        model_config = ConfigDict(extra="allow")
        known: int = 0

    settings = Settings.load(None, plugin={"free-form": {"known": 1, "anything": "goes"}})
    PluginManager(settings, extra_plugins=(registering("free-form", Free),))
    section = settings.plugin_section("free-form")
    assert section.known == 1 and section.anything == "goes"


def test_a_section_of_no_installed_plugin_is_warned_about(caplog):
    PluginManager(Settings.load(None, plugin={"lifoo": {"max_new_per_round": 3}, "lifo": {"max_new_per_round": 2}}))
    assert "settings section [plugin.lifoo] belongs to no installed plugin; it is ignored" in caplog.text
    # A section of an installed plugin that is not active (a shared config file) is no surprise.
    assert "[plugin.lifo]" not in caplog.text


def test_an_installed_stacked_plugin_may_be_passed_to_the_harness_too():
    """docs/writing-a-plugin.md, Testing: pass your module to SchedulerHarness. Once the package is
    installed an observer or default plugin is active anyway; the module passed is registered once."""
    faults = pytest.importorskip("batchyard_testplugin.faults")
    from framework.testing import SchedulerHarness

    harness = SchedulerHarness(faults, plugin={"faults": {"enabled": False}})
    rid = harness.add([1, 2, 3], max_new_tokens=2)
    harness.run()
    assert len(harness.outputs[rid]) == 2
    assert harness.scheduler.plugins.pm.is_registered(faults)


def test_an_unknown_name_in_plugins_disable_is_warned_about(caplog):
    PluginManager(Settings.load(None, plugins={"disable": ["clientz"]}))
    assert "plugins.disable: no installed plugin is named 'clientz'" in caplog.text


def test_a_selected_kind_in_plugins_disable_is_warned_about(caplog):
    """plugins.disable leaves observer and default plugins inactive; a policy, cache or worker
    named there stays as plugins.<kind> selects it (disable = ["radix"] kept the radix cache),
    which the log now says instead of nothing."""
    manager = PluginManager(Settings.load(None, plugins={"disable": ["radix", "fcfs"]}))
    assert "radix" in manager.active
    assert ("plugins.disable: 'radix' is a cache plugin, chosen by plugins.cache; only observer and "
            "default plugins can be disabled") in caplog.text
    assert "plugins.disable: 'fcfs' is a policy plugin, chosen by plugins.policy;" in caplog.text


def test_cli_config_checks_the_plugin_sections(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[plugin.lpm]\nin_batch_prefix_cachin = false\n")
    proc = subprocess.run([sys.executable, "-m", "framework.cli", "config", "--config", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "plugin.lpm.in_batch_prefix_cachin: Extra inputs are not permitted" in proc.stderr


class AnswersWorker:
    """A worker plugin object (it takes the place of the one the settings name) answering `answer`."""

    PLUGIN_KIND = "worker"

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def create_worker(self):
        return self.answer


class AnswersCache:
    PLUGIN_KIND = "cache"

    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def create_cache(self):
        return self.answer


class Workerish:
    """Some of a worker: the start-up check names what is missing."""

    is_pipelined = False

    def launch(self, batch):
        raise AssertionError("never launched")


@pytest.mark.parametrize("plugin, expected", [
    (AnswersWorker(None), "plugin 'AnswersWorker' returned NoneType None from create_worker; expected a "
                          "framework.worker.Worker"),
    (AnswersWorker(Workerish()), "expected a framework.worker.Worker (it lacks supports_output_penalties, "
                                 "req_to_token_pool"),
    (AnswersCache(None), "plugin 'AnswersCache' returned NoneType None from create_cache; expected a "
                         "framework.cache.BasePrefixCache"),
    (AnswersCache("radix"), "plugin 'AnswersCache' returned str 'radix' from create_cache"),
], ids=["no worker", "part of a worker", "no cache", "a cache's name"])
def test_a_start_up_hook_answering_no_worker_or_cache_is_a_start_up_error(plugin, expected):
    """Before, the scheduler stopped on an AttributeError naming no plugin (a worker), or started
    and stopped at its first request (a cache)."""
    from framework.testing import FakeWorkerPlugin
    from framework.scheduler import Scheduler

    plugins = (plugin,) if plugin.PLUGIN_KIND == "worker" else (FakeWorkerPlugin(), plugin)
    with pytest.raises(PluginError) as info:
        Scheduler(Settings.load(None, plugins={"policy": "fcfs"}), extra_plugins=plugins)
    assert expected in str(info.value)
