"""The experiment file: parsing, checking everything up front, and expanding the grid into cells.

    [experiment]                  # name, backend (sim | real), out_dir
    [slo]                         # ttft_ms, itl_ms, e2e_ms: goodput counts requests meeting all
    [scheduler] / [cache] / ...   # base settings, the same sections as serve.toml
    [grid]                        # "section.field" or "plugin.<name>.<option>" = [values, ...]
    [[workload]]                  # framework.workload.WorkloadSpec fields, with rates = [...], seeds = [...]

A cell is one point of grid × workload × rate × seed. `load_experiment` checks every cell's
settings (pydantic), plugin names (against the installed plugins) and plugin options, and builds
every workload (so a bad trace line is found) before anything runs; the first problem is raised as
an `ExperimentError` with a one-line message.

Workloads are sampled and tokenized once, in this process, with the tokenizer of the first grid
point's model; cells with the same workload, rate and seed get the very same requests.
"""

from __future__ import annotations

import copy
import functools
import difflib
import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from framework.config import Settings, SettingsError, iter_fields
from framework.workload import TimedRequest, WorkloadError, WorkloadSpec, build_workload

EXPERIMENT_SECTIONS = ("experiment", "slo", "grid", "workload")
SETTINGS_SECTIONS = tuple(Settings.model_fields)


class ExperimentError(ValueError):
    """The experiment file is wrong; the message is one line naming the problem."""


class ExperimentOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", description="Name stored in every result; empty: the file's stem.")
    description: str = ""
    backend: Literal["sim", "real"] = Field(
        "sim", description="sim: the sim worker on a virtual clock; real: the model on the wall clock."
    )
    out_dir: str = Field("", description="Output folder (relative: to the current directory); "
                                         "empty: <file stem>-results.")


class Slo(BaseModel):
    """Service-level objectives; a completed request is *good* when it meets every one given."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0, description="Time to first token.")
    itl_ms: float | None = Field(None, gt=0, description="The request's mean inter-token latency (TPOT).")
    e2e_ms: float | None = Field(None, gt=0, description="Arrival to last token.")


class WorkloadEntry(WorkloadSpec):
    """A [[workload]] table: a WorkloadSpec whose rate and seed may be lists."""

    rates: list[float] | None = Field(None, min_length=1, description="Rates to sweep (req/s).")
    seeds: list[int] | None = Field(None, min_length=1, description="Seeds to sweep.")

    def expand(self) -> list[WorkloadSpec]:
        if self.dataset == "trace":
            given = sorted({"rates", "rate", "arrival", "cv"} & self.model_fields_set)
            if given:
                raise ExperimentError(f"workload {self.label}: {', '.join(given)}: a trace's requests arrive at "
                                      "the trace's own arrival_s times; leave them out")
        twice = [f"{one} and {many}" for one, many in (("rate", "rates"), ("seed", "seeds"))
                 if {one, many} <= self.model_fields_set]
        if twice:  # (the list won, the single value was dropped without a word)
            raise ExperimentError(f"workload {self.label}: {'; '.join(twice)}: give one or the other (a list sweeps)")
        base = self.model_dump(exclude={"rates", "seeds"})
        for rate in self.rates or []:
            if not rate > 0:
                raise ExperimentError(f"workload {self.label}: rates: every rate must be > 0, got {rate!r}")
        for seed in self.seeds or [self.seed]:
            if not 0 <= seed < 2**32:  # (numpy's bound, whose own message named no workload)
                raise ExperimentError(f"workload {self.label}: seed {seed} is outside 0 .. 2**32 - 1")
        return [
            WorkloadSpec(**{**base, "rate": rate, "seed": seed})
            for rate in (self.rates or [self.rate]) for seed in (self.seeds or [self.seed])
        ]


@dataclass
class Cell:
    """One run: settings overrides (base + a grid point), one workload at one rate and seed."""

    index: int
    grid: dict[str, Any]  # the grid point, e.g. {"plugins.policy": "lpm"}
    settings: dict[str, Any]  # nested overrides by section, as Settings.load takes them
    workload: WorkloadSpec
    workload_key: tuple  # cells with equal keys share one request list
    backend: str

    @property
    def label(self) -> str:
        """The grid point in short form: "policy=lpm, chunked_prefill_size=512"."""
        return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.grid.items()) or "base"


@dataclass
class Experiment:
    path: Path
    options: ExperimentOptions
    slo: Slo
    grid: dict[str, list[Any]]
    cells: list[Cell]
    workloads: dict[tuple, list[TimedRequest]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.options.name or self.path.stem

    def out_dir(self, override: str | None = None) -> Path:
        return Path(override or self.options.out_dir or f"{self.path.stem}-results")


# -- checks --------------------------------------------------------------------------------------


def _one_line(exc: ValidationError, where: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        shown = "" if err["type"] == "missing" or isinstance(value, (dict, list)) else f" (got {value!r})"
        parts.append(f"{where}{'.' if loc else ''}{loc}: {err['msg']}{shown}")
    return "; ".join(parts)


def _setting_paths() -> list[str]:
    return [name for name, _, _ in iter_fields()]


def plugin_sections() -> dict[str, type[BaseModel]]:
    """Settings models of every installed plugin, by section name (what `[plugin.<name>]` takes)."""
    from framework.plugins import discover_plugins

    sections: dict[str, type[BaseModel]] = {}
    for info in discover_plugins().values():
        hook = getattr(info.module, "register_settings", None)
        if info.error is None and callable(hook):
            hook(register=lambda name, model: sections.setdefault(name, model))
    return sections


def check_setting_path(key: str, sections: dict[str, type[BaseModel]], what: str = "grid key") -> None:
    """Raise ExperimentError unless `key` names a setting: "section.field" or "plugin.<name>.<option>"."""
    parts = key.split(".")
    if parts[0] == "plugin":
        if len(parts) != 3:
            raise ExperimentError(f"{what} {key!r} is no setting: plugin options are plugin.<name>.<option>")
        name, option = parts[1], parts[2]
        if name not in sections:
            raise ExperimentError(
                f"{what} {key!r} is no setting: no installed plugin declares [plugin.{name}] "
                f"(declared: {', '.join(sorted(sections)) or 'none'})"
            )
        fields = sections[name].model_fields
        if option not in fields:
            raise ExperimentError(
                f"{what} {key!r} is no setting: [plugin.{name}] has {', '.join(fields) or 'no options'}"
            )
        return
    known = _setting_paths()
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ExperimentError(f"{what} {key!r} is no setting{hint}")


def _check_plugin_options(overrides: dict[str, Any], sections: dict[str, type[BaseModel]]) -> None:
    """Every [plugin.<name>] option exists and validates, as at start-up (where a section's model
    that sets `extra` itself decides about unknown keys)."""
    for name, options in (overrides.get("plugin") or {}).items():
        if not isinstance(options, dict):
            raise ExperimentError(f"plugin.{name}: expected a table of options")
        model = sections.get(name)
        if model is None or model.model_config.get("extra") is None:
            for option in options:
                check_setting_path(f"plugin.{name}.{option}", sections, "option")
        try:
            sections[name](**options)
        except ValidationError as exc:
            raise ExperimentError(_one_line(exc, f"plugin.{name}")) from None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"plugins": {"policy": [...]}} -> {"plugins.policy": [...]}: unquoted dotted keys in [grid]
    are nested tables to TOML."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _set_path(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def check_settings(overrides: dict[str, Any], backend: str, where: str) -> Settings:
    """Build the Settings a run of `overrides` on `backend` gets and activate its plugins, as the
    run would at start-up."""
    from framework.plugins import PluginError, PluginManager
    from framework.sim.driver import driver_settings

    try:
        settings = driver_settings(overrides, backend)
        PluginManager(settings)
        if backend == "sim":  # the sim worker's cost model, as it starts (CostModelError is a ValueError)
            from framework.sim.costmodel import resolve_hardware

            sim = settings.plugin_section("sim")
            if sim.cost_model != "profile":
                resolve_hardware(sim.hardware, sim.profile)
            elif not sim.profile:
                from framework.sim.costmodel import CostModelError

                raise CostModelError('plugin.sim.profile: cost_model = "profile" needs a profile file '
                                     "(make one with `batchyard sim calibrate`)")
    except SettingsError as exc:
        lines = str(exc).splitlines()
        problem = "; ".join(lines[1:] if lines[0].endswith(":") else lines)
        raise ExperimentError(f"{where}invalid settings: {problem}") from None
    except (PluginError, ValueError) as exc:  # ValueError: a worker the backend cannot run
        raise ExperimentError(f"{where}{exc}") from None
    return settings


# -- loading -------------------------------------------------------------------------------------


def parse_experiment(path: str | Path) -> tuple[Experiment, dict[str, Any], list[WorkloadEntry]]:
    """Read the file and check its shape; no settings are built yet."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ExperimentError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ExperimentError(f"{path}: invalid TOML: {exc}") from None
    for key in data:
        if key not in EXPERIMENT_SECTIONS and key not in SETTINGS_SECTIONS:
            raise ExperimentError(
                f"unknown section [{key}]: experiment sections are {', '.join(EXPERIMENT_SECTIONS)}, "
                f"settings sections {', '.join(SETTINGS_SECTIONS)}"
            )
    try:
        options = ExperimentOptions(**data.get("experiment", {}))
    except ValidationError as exc:
        raise ExperimentError(_one_line(exc, "experiment")) from None
    try:
        slo = Slo(**data.get("slo", {}))
    except ValidationError as exc:
        raise ExperimentError(_one_line(exc, "slo")) from None

    grid = _flatten(data.get("grid", {}))
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ExperimentError(f"grid key {key!r}: expected a non-empty list of values, got {values!r}")

    raw_workloads = data.get("workload")
    if raw_workloads is None:
        raise ExperimentError("no [[workload]]: give at least one workload table")
    if isinstance(raw_workloads, dict):
        raw_workloads = [raw_workloads]
    workloads = []
    for i, raw in enumerate(raw_workloads):
        try:
            entry = WorkloadEntry(**raw)
        except ValidationError as exc:
            raise ExperimentError(_one_line(exc, f"workload[{i}]")) from None
        # Files named in an experiment travel with it: relative paths are the file's.
        if entry.trace and not Path(entry.trace).is_absolute():
            entry.trace = str(path.parent / entry.trace)
        if entry.dataset_path and not Path(entry.dataset_path).is_absolute():
            entry.dataset_path = str(path.parent / entry.dataset_path)
        workloads.append(entry)
    labels = [w.label for w in workloads]
    if len(set(labels)) != len(labels):
        raise ExperimentError(f"workload names must differ (give each a name): {labels}")

    base = {k: v for k, v in data.items() if k in SETTINGS_SECTIONS}
    return Experiment(path, options, slo, grid, []), base, workloads


def load_experiment(path: str | Path) -> Experiment:
    """Parse, check and expand an experiment file (module docstring). Raises ExperimentError."""
    exp, base, workloads = parse_experiment(path)
    sections = plugin_sections()
    for key in exp.grid:
        check_setting_path(key, sections)

    if exp.options.backend == "sim":
        base.setdefault("plugins", {}).setdefault("worker", "sim")
    points = [dict(zip(exp.grid, combo)) for combo in itertools.product(*exp.grid.values())]
    settings_per_point = []
    tokenizer_settings = None
    for point in points:
        overrides = copy.deepcopy(base)
        for key, value in point.items():
            _set_path(overrides, key, value)
        sim = overrides.get("plugin", {}).get("sim")
        if isinstance(sim, dict) and isinstance(sim.get("profile"), str) and sim["profile"] \
                and not Path(sim["profile"]).is_absolute():
            sim["profile"] = str(exp.path.parent / sim["profile"])  # (relative to the experiment file too)
        where = "grid " + ", ".join(f"{k}={v!r}" for k, v in point.items()) + ": " if point else ""
        _check_plugin_options(overrides, sections)
        settings = check_settings(overrides, exp.options.backend, where)
        tokenizer_settings = tokenizer_settings or settings
        settings_per_point.append((point, overrides))

    index = itertools.count()
    for entry in workloads:
        for spec in entry.expand():
            key = (spec.label, spec.rate, spec.seed)
            for point, overrides in settings_per_point:
                exp.cells.append(Cell(next(index), point, overrides, spec, key, exp.options.backend))
    tokenizer = _tokenizer(tokenizer_settings)
    samples: dict = {}  # rates share one dataset sample
    for cell in exp.cells:
        if cell.workload_key not in exp.workloads:
            try:
                exp.workloads[cell.workload_key] = build_workload(cell.workload, tokenizer, samples)
            except WorkloadError as exc:
                raise ExperimentError(f"workload {cell.workload.label}: {exc}") from None
    return exp


def _tokenizer(settings: Settings):
    """The model's tokenizer, which turns dataset text into the ids every cell's requests carry."""
    try:
        return _load_tokenizer(settings.model.tokenizer_path or settings.model.path)
    except (OSError, ValueError) as exc:
        raise ExperimentError(f"model: cannot load the tokenizer ({exc})") from None


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str | None):
    from framework.bench.common import load_bench_tokenizer

    return load_bench_tokenizer(path)  # seconds: loaded once per process and path
