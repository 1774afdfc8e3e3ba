"""Plugin discovery, selection by name, and the typed hook facade.

Bundled plugins and third-party plugins enter the same way: an entry point in the `batchyard`
group whose name is the plugin's name and whose value is a module. A module declares what it is
with ``PLUGIN_KIND`` (``policy``, ``cache``, ``worker``, ``observer`` or ``default``); its name is
the entry point's. When the distribution is not installed (running from a source tree),
`DEFAULT_PLUGINS` is registered through the same code path.

Exactly one policy, one cache and one worker are active; the others are blocked by name before
registration. Observers and defaults are all active unless listed in ``plugins.disable``. A plugin
may implement only its kind's hooks (`framework.hookspecs.KIND_HOOKS`), and a settings section
belongs to one plugin: both are checked at start-up. The core's own `trylast` fallbacks
(`framework.defaults`) are always registered.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from framework import PROJECT_NAME, defaults, hookspecs
from framework.hookspecs import KIND_HOOKS

if TYPE_CHECKING:
    from framework.config import Settings

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME
SELECTED_KINDS = ("policy", "cache", "worker")
STACKED_KINDS = ("observer", "default")
ALL_KINDS = SELECTED_KINDS + STACKED_KINDS

#: Bundled plugins: (name, module). Used when entry points are not available, and as the list a
#: test checks against pyproject.toml so the two never drift apart.
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("fcfs", "plugins.policies.fcfs"),
    ("lpm", "plugins.policies.lpm"),
    ("dfs-weight", "plugins.policies.dfs_weight"),
    ("lof", "plugins.policies.lof"),
    ("random", "plugins.policies.random"),
    ("vtc", "plugins.policies.vtc"),
    ("priority", "plugins.policies.priority"),
    ("edf", "plugins.policies.edf"),
    ("chunk", "plugins.caches.chunk"),
    ("radix", "plugins.caches.radix"),
    ("tp", "plugins.workers.tp"),
    ("overlap", "plugins.workers.overlap"),
    ("dp-attention", "plugins.workers.dp_attention"),
    ("clients", "plugins.observers.clients"),
    ("sim", "plugins.workers.sim"),
)


class PluginError(ValueError):
    """A plugin could not be found, loaded or selected."""


class PluginHookError(RuntimeError):
    """A plugin raised inside a request-time hook. The message names the plugin and the hook, so
    the scheduler can fail the request or batch concerned with it and keep serving."""

    def __init__(self, hook: str, plugin: str, exc: BaseException):
        self.hook = hook
        self.plugin = plugin
        super().__init__(f"plugin {plugin!r} failed in hook {hook}: {type(exc).__name__}: {exc}")


def _plugin_name(impl) -> str:
    # An object registered without a name is known to pluggy by its id; its class names it better.
    return type(impl.plugin).__name__ if impl.plugin_name.isdigit() else impl.plugin_name


def _raising_plugin(impls, exc: BaseException) -> str:
    """The name of the plugin whose hook implementation raised `exc`: its frame in the traceback,
    the innermost one, since an exception passing through a ``wrapper=True`` implementation has
    that wrapper's frame outside the one that raised."""
    by_code = {impl.function.__code__: _plugin_name(impl) for impl in impls}
    name = "?"
    tb = exc.__traceback__
    while tb is not None:
        name = by_code.get(tb.tb_frame.f_code, name)
        tb = tb.tb_next
    return name


@dataclass
class PluginInfo:
    name: str
    kind: str
    module_name: str
    source: str  # "entry point" or "bundled fallback"
    module: ModuleType | None = None
    error: str | None = None


def _load_module(info: PluginInfo) -> None:
    try:
        info.module = importlib.import_module(info.module_name)
    except Exception as exc:  # a broken third-party plugin must not hide the others
        info.error = f"{type(exc).__name__}: {exc}"
        return
    kind = getattr(info.module, "PLUGIN_KIND", None)
    if kind not in ALL_KINDS:
        info.error = f"module {info.module_name} has PLUGIN_KIND={kind!r}; expected one of {ALL_KINDS}"
        return
    info.kind = kind


def discover_plugins() -> dict[str, PluginInfo]:
    """All installed plugins by name: entry points first, then bundled ones not seen there."""
    found: dict[str, PluginInfo] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            logger.warning("plugin name %r is declared twice; keeping %s", ep.name, found[ep.name].module_name)
            continue
        found[ep.name] = PluginInfo(ep.name, "", ep.value, "entry point")
    for name, module_name in DEFAULT_PLUGINS:
        if name not in found:
            found[name] = PluginInfo(name, "", module_name, "bundled fallback")
    for info in found.values():
        _load_module(info)
    return found


class Hooks:
    """The typed facade the core calls hooks through (keyword arguments only).

    Start-up hooks raise as they are (start-up fails). Request-time hooks raise `PluginHookError`,
    which names the plugin; the scheduler fails the request or batch concerned and keeps serving.
    """

    def __init__(self, pm: pluggy.PluginManager):
        self._hook = pm.hook

    def _call(self, name: str, **kwargs):
        caller = getattr(self._hook, name)
        try:
            return caller(**kwargs)
        except Exception as exc:
            raise PluginHookError(name, _raising_plugin(caller.get_hookimpls(), exc), exc) from exc

    def create_worker(self, settings, tp_rank: int):
        return self._hook.create_worker(settings=settings, tp_rank=tp_rank)

    def create_cache(self, settings, req_to_token_pool, token_to_kv_pool):
        return self._hook.create_cache(
            settings=settings, req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool
        )

    def on_request_received(self, req, view) -> None:
        self._call("on_request_received", req=req, view=view)

    def select_prefill(self, view, adder):
        return self._call("select_prefill", view=view, adder=adder)

    def on_decode_oom(self, batch, view):
        return self._call("on_decode_oom", batch=batch, view=view)

    def prepare_batch(self, batch, view):
        return self._call("prepare_batch", batch=batch, view=view)

    def on_batch_result(self, batch, result, view) -> None:
        self._call("on_batch_result", batch=batch, result=result, view=view)

    def on_request_finished(self, req, view) -> None:
        self._call("on_request_finished", req=req, view=view)

    def on_idle(self, view) -> None:
        self._call("on_idle", view=view)


def check_kind(pm: pluggy.PluginManager, plugin: Any, name: str, kind: str) -> None:
    """Raise PluginError when `plugin` implements a hook its kind may not."""
    allowed = KIND_HOOKS[kind]
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.name not in allowed:
            owners = sorted(k for k, hooks in KIND_HOOKS.items() if caller.name in hooks)
            raise PluginError(
                f"plugin {name!r} is a {kind} plugin but implements {caller.name!r}, "
                f"a hook only {' or '.join(owners)} plugins may implement"
            )


class PluginManager:
    """Loads the installed plugins and activates the selected ones."""

    def __init__(self, settings: "Settings", extra_plugins: tuple[Any, ...] = ()):
        self.settings = settings
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.installed = discover_plugins()
        self.active: dict[str, PluginInfo] = {}
        #: Settings section -> the plugin that registered it.
        self.section_owners: dict[str, str] = {}
        self._activate(extra_plugins)
        self.hooks = Hooks(self.pm)
        self._register_plugin_settings()

    def _activate(self, extra_plugins: tuple[Any, ...]) -> None:
        selection = self.settings.plugins
        disabled = set(selection.disable)
        chosen = {"policy": selection.policy, "cache": selection.cache, "worker": selection.worker}
        # An extra plugin object of a selected kind (framework.testing) takes the named one's place.
        replaced = {getattr(p, "PLUGIN_KIND", None) for p in extra_plugins} & set(SELECTED_KINDS)
        for kind, name in chosen.items():
            info = self.installed.get(name)
            if kind not in replaced and (info is None or info.kind != kind):
                installed = sorted(n for n, i in self.installed.items() if i.kind == kind)
                hint = f" ({name!r} is a {info.kind} plugin)" if info is not None and info.kind else ""
                broken = f" (failed to load: {info.error})" if info is not None and info.error else ""
                raise PluginError(
                    f"plugins.{kind}: unknown {kind} plugin {name!r}{hint}{broken}; "
                    f"installed: {', '.join(installed) or 'none'}"
                )
        for name, info in self.installed.items():
            if info.error is not None:
                if name in chosen.values():
                    raise PluginError(f"plugin {name!r} failed to load: {info.error}")
                logger.warning("plugin %r not loaded: %s", name, info.error)
                continue
            selected = info.kind in SELECTED_KINDS and chosen[info.kind] == name and info.kind not in replaced
            stacked = info.kind in STACKED_KINDS and name not in disabled
            if selected or stacked:
                self.pm.register(info.module, name=name)
                check_kind(self.pm, info.module, name, info.kind)
                self.active[name] = info
            else:
                self.pm.set_blocked(name)
        self.pm.register(defaults, name="core-defaults")
        for plugin in extra_plugins:
            self.register(plugin)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"a plugin implements an unknown hook: {exc}") from exc

    def _register_plugin_settings(self) -> None:
        # One call per implementation, so that a section registered twice names both plugins.
        for impl in self.pm.hook.register_settings.get_hookimpls():
            owner = impl.plugin_name

            def register(section: str, model: type, owner: str = owner) -> None:
                first = self.section_owners.setdefault(section, owner)
                if first != owner:
                    raise PluginError(
                        f"settings section [plugin.{section}] is registered by two plugins: "
                        f"{first!r} and {owner!r}"
                    )
                self.settings.register_plugin_section(section, model)

            impl.function(register=register)

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register an extra plugin object at run time (tests, scripts). One that declares a
        ``PLUGIN_KIND`` is held to that kind's hooks; one without may implement any hook."""
        try:
            name = self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise PluginError(f"plugin {name or plugin!r} cannot be registered: {exc}") from exc
        kind = getattr(plugin, "PLUGIN_KIND", None)
        if kind is not None:
            if kind not in ALL_KINDS:
                raise PluginError(f"plugin {name!r} has PLUGIN_KIND={kind!r}; expected one of {ALL_KINDS}")
            check_kind(self.pm, plugin, name, kind)

    def describe(self) -> list[tuple[str, str, bool, str]]:
        """(kind, name, is_active, note) for every installed plugin, sorted by kind then name."""
        rows = []
        for name, info in self.installed.items():
            note = info.error or info.source
            rows.append((info.kind or "?", name, name in self.active, note))
        order = {k: i for i, k in enumerate(ALL_KINDS)}
        return sorted(rows, key=lambda r: (order.get(r[0], 99), r[1]))
