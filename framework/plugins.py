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
import math
import numbers
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

from framework import PROJECT_NAME, defaults, hookspecs
from framework.hookspecs import KIND_HOOKS
from framework.worker import WORKER_MEMBERS

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


class PluginReturnError(PluginHookError):
    """A plugin's request-time hook returned a value outside the hook's contract. The core treats
    it as if the hook had raised (a `PluginHookError`): the requests concerned fail, the server
    serves on."""

    def __init__(self, hook: str, plugins: list[str], problem: str):
        self.hook = hook
        self.plugin = " or ".join(plugins)
        RuntimeError.__init__(self, f"{_who(plugins)} returned an invalid value from {hook}: {problem}")


def _who(plugins: list[str]) -> str:
    # A firstresult hook's answer comes from one implementation; pluggy does not say which, so
    # where several plugins implement the hook (in-process objects beside the policy) all are named.
    return (f"plugin {plugins[0]!r}" if len(plugins) == 1
            else f"one of the plugins {', '.join(repr(p) for p in plugins)}")


def _shown(value: Any) -> str:
    """A short description of a returned value for an error message: its type and a short repr."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _is_ratio(value: Any) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
        """The worker; a `PluginError` naming the plugin when the answer is not one (start-up)."""
        worker = self._hook.create_worker(settings=settings, tp_rank=tp_rank)
        missing = [member for member in WORKER_MEMBERS if not hasattr(worker, member)]
        if worker is None or missing:
            lacks = f" (it lacks {', '.join(missing)})" if worker is not None else ""
            raise PluginError(f"{_who(self._decider('create_worker'))} returned {_shown(worker)} from "
                              f"create_worker; expected a framework.worker.Worker{lacks}")
        return worker

    def create_cache(self, settings, req_to_token_pool, token_to_kv_pool):
        """The prefix cache; a `PluginError` naming the plugin when the answer is not one (start-up:
        the scheduler would otherwise start and stop at its first request)."""
        from framework.cache import BasePrefixCache  # (torch: imported where a pool exists)

        cache = self._hook.create_cache(
            settings=settings, req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool
        )
        if not isinstance(cache, BasePrefixCache):
            raise PluginError(f"{_who(self._decider('create_cache'))} returned {_shown(cache)} from "
                              "create_cache; expected a framework.cache.BasePrefixCache")
        return cache

    def _broadcast(self, name: str, **kwargs) -> None:
        """Call every implementation of broadcast hook `name`, each even where one before it raised
        (pluggy stops at the first exception, so one failing plugin would keep the event from the
        others, e.g. the `clients` observer's token counts); then raise the first failure as
        `PluginHookError`. Where an implementation is a wrapper, pluggy runs them all as usual."""
        caller = getattr(self._hook, name)
        impls = caller.get_hookimpls()
        if any(impl.wrapper or impl.hookwrapper for impl in impls):
            self._call(name, **kwargs)
            return
        failure = None
        for impl in reversed(impls):  # (pluggy's call order)
            try:
                impl.function(*(kwargs[arg] for arg in impl.argnames))
            except Exception as exc:
                if failure is None:
                    failure = PluginHookError(name, _plugin_name(impl), exc)
                    failure.__cause__ = exc
                else:
                    logger.error("plugin %r failed in hook %s too: %s: %s", _plugin_name(impl), name,
                                 type(exc).__name__, exc)
        if failure is not None:
            raise failure

    def on_request_received(self, req, view) -> None:
        self._broadcast("on_request_received", req=req, view=view)

    def _decider(self, name: str) -> list[str]:
        """The plugins one of which gave a firstresult hook's answer: its implementers other than
        the core's `trylast` fallbacks, in call order (in a server: the active policy, for
        prepare_batch the worker and default plugins)."""
        impls = getattr(self._hook, name).get_hookimpls()
        return [_plugin_name(impl) for impl in reversed(impls) if impl.plugin is not defaults] or ["core-defaults"]

    def _requests(self, name: str, returned: Any, among: tuple, where: str) -> list:
        """`returned` as a list of distinct requests from `among` (identity), or PluginReturnError."""
        if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, Iterable):
            raise PluginReturnError(name, self._decider(name),
                                    f"got {_shown(returned)}; expected a list of requests from {where}")
        try:
            items = list(returned)  # (a generator runs the plugin's code here)
        except Exception as exc:
            raise PluginReturnError(name, self._decider(name),
                                    f"iterating it raised {type(exc).__name__}: {exc}") from exc
        allowed = {id(r) for r in among}
        seen: set[int] = set()
        for item in items:
            if id(item) not in allowed:
                raise PluginReturnError(name, self._decider(name),
                                        f"{_shown(item)} is not a request of {where}")
            if id(item) in seen:
                raise PluginReturnError(name, self._decider(name), f"request {item.rid!r} is listed twice")
            seen.add(id(item))
        return items

    def select_prefill(self, view, adder) -> list | None:
        """The requests to admit, in order: distinct requests of `view.waiting_queue`, or None.
        Anything else raises PluginReturnError."""
        chosen = self._call("select_prefill", view=view, adder=adder)
        if chosen is None:
            return None
        return self._requests("select_prefill", chosen, view.waiting_queue, "view.waiting_queue")

    def on_decode_oom(self, batch, view) -> tuple[list, float | None]:
        """(victims, new_token_ratio or None): distinct requests of `batch.reqs`, in retraction
        order, and a ratio in [0, 1] where the plugin gave one. A plugin may return the victims
        alone (any sequence, a tuple of requests included) or ``(victims, ratio)``: a pair whose
        second item is a number. Anything else raises PluginReturnError."""
        decision = self._call("on_decode_oom", batch=batch, view=view)
        if decision is None:
            return [], None
        ratio = None
        # A pair: a number second, or a sequence (the victims) first, as no request is a sequence.
        # (victims, None) leaves the ratio to the core, as victims alone do.
        if (isinstance(decision, (tuple, list)) and len(decision) == 2
                and (_is_ratio(decision[1]) or isinstance(decision[0], (tuple, list)))):
            decision, ratio = decision
            if ratio is not None and not (_is_ratio(ratio) and math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
                raise PluginReturnError("on_decode_oom", self._decider("on_decode_oom"),
                                        f"the new token ratio {_shown(ratio)} of (victims, new_token_ratio) "
                                        "is not a number in [0, 1]")
        victims = self._requests("on_decode_oom", decision, batch.reqs, "the running batch (batch.reqs)")
        return victims, None if ratio is None else float(ratio)

    def prepare_batch(self, batch, view):
        """The batch to run: `batch` itself, or where it is None, None or an IDLE batch (from
        `view.idle_batch()`). Anything else raises PluginReturnError."""
        prepared = self._call("prepare_batch", batch=batch, view=view)
        if batch is not None and prepared is not batch:
            raise PluginReturnError("prepare_batch", self._decider("prepare_batch"),
                                    f"got {_shown(prepared)} in place of the batch the scheduler built "
                                    "(its KV slots are allocated); return that batch")
        if batch is None and prepared is not None and not _is_idle_batch(prepared):
            raise PluginReturnError("prepare_batch", self._decider("prepare_batch"),
                                    f"got {_shown(prepared)} where there was no batch; expected None or "
                                    "view.idle_batch()")
        return prepared

    def refused(self, name: str, problem: str) -> PluginReturnError:
        """The error for an answer of firstresult hook `name` that passed the facade's checks but
        proved outside the contract once the core applied it (on_decode_oom's victims too few)."""
        return PluginReturnError(name, self._decider(name), problem)

    def on_batch_result(self, batch, result, view) -> None:
        self._broadcast("on_batch_result", batch=batch, result=result, view=view)

    def on_request_finished(self, req, view) -> None:
        self._broadcast("on_request_finished", req=req, view=view)

    def on_idle(self, view) -> None:
        self._broadcast("on_idle", view=view)


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _is_idle_batch(value: Any) -> bool:
    from framework.batch import ScheduleBatch  # (torch: imported where a batch can exist)

    return isinstance(value, ScheduleBatch) and value.forward_mode is not None and value.forward_mode.is_idle()


def check_kind(pm: pluggy.PluginManager, plugin: Any, name: str, kind: str) -> None:
    """Raise PluginError when `plugin` implements a hook its kind may not."""
    allowed = KIND_HOOKS[kind]
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.name not in allowed:
            owners = sorted(k for k, hooks in KIND_HOOKS.items() if caller.name in hooks)
            raise PluginError(
                f"plugin {name!r} is {_article(kind)} {kind} plugin but implements {caller.name!r}, "
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
        self._warn_unclaimed_sections()

    def _activate(self, extra_plugins: tuple[Any, ...]) -> None:
        selection = self.settings.plugins
        disabled = set(selection.disable)
        for name in sorted(disabled - set(self.installed)):
            logger.warning("plugins.disable: no installed plugin is named %r (installed: %s)", name,
                           ", ".join(sorted(self.installed)))
        for name in sorted(disabled & set(self.installed)):
            kind = self.installed[name].kind
            if kind in SELECTED_KINDS:  # (chosen by plugins.<kind> alone: disable does not apply)
                logger.warning("plugins.disable: %r is a %s plugin, chosen by plugins.%s; only observer and "
                               "default plugins can be disabled", name, kind, kind)
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
        passed = {id(p) for p in extra_plugins}
        for name, info in self.installed.items():
            if info.module is not None and id(info.module) in passed:
                continue  # an installed module passed in as well (tests): registered once, below
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
        if not self.pm.hook.select_prefill.get_hookimpls():
            # The core has no fallback: nothing would ever be admitted, and every request would wait.
            policy = next((getattr(p, "__name__", type(p).__name__) for p in extra_plugins
                           if getattr(p, "PLUGIN_KIND", None) == "policy"), selection.policy)
            raise PluginError(
                f"plugins.policy: policy plugin {policy!r} does not implement select_prefill, so no "
                "request would ever be admitted. A policy implements it; to change only the retraction "
                "order, reuse a bundled one's (`from plugins.policies.fcfs import select_prefill`)"
            )

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

    def _warn_unclaimed_sections(self) -> None:
        """A [plugin.<name>] section no active plugin registered, named after no installed plugin:
        most likely a misspelt name, whose settings would otherwise be dropped without a word. (A
        section of an installed plugin that is not active is normal: a shared config file.)"""
        for section in sorted(self.settings.plugin):
            if section not in self.section_owners and section not in self.installed:
                logger.warning("settings section [plugin.%s] belongs to no installed plugin; it is ignored "
                               "(installed: %s)", section, ", ".join(sorted(self.installed)))

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
            # An object registered without a name is known to pluggy by its id; its class names it better.
            name = type(plugin).__name__ if name.isdigit() else name
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
