"""Requests, their sampling parameters and finish reasons (reference sections V, W1, W2)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

TOP_K_ALL = 1 << 30
# The largest integer sampling parameter (top_k, n, max/min_new_tokens, stop_token_ids), and the
# largest |priority|.
MAX_PARAM_INT = (1 << 31) - 1


class StashKey(Generic[T]):
    """A typed key into a `Stash`: plugins keep their per-request state here, not as ad-hoc attributes."""

    __slots__ = ("name",)

    def __init__(self, name: str = ""):
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """Per-object store for plugin state, keyed by `StashKey` objects (pytest's Stash idea)."""

    __slots__ = ("_data",)

    def __init__(self):
        self._data: dict[StashKey, Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return self._data[key]

    def get(self, key: StashKey[T], default: T | None = None) -> T | None:
        return self._data.get(key, default)

    def setdefault(self, key: StashKey[T], default: T) -> T:
        return self._data.setdefault(key, default)

    def __contains__(self, key: StashKey) -> bool:
        return key in self._data

    def __delitem__(self, key: StashKey) -> None:
        del self._data[key]


# ---------------------------------------------------------------------------------------------
# Finish reasons


class FinishReason:
    is_error = False

    def to_json(self) -> dict:
        raise NotImplementedError


@dataclass
class FinishLength(FinishReason):
    length: int

    def to_json(self) -> dict:
        return {"type": "length", "length": self.length}


@dataclass
class FinishMatchedToken(FinishReason):
    matched: int

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FinishMatchedStr(FinishReason):
    matched: str

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FinishAbort(FinishReason):
    message: str = "Unknown error"
    is_error = True

    def to_json(self) -> dict:
        return {"type": "abort", "message": self.message}


# ---------------------------------------------------------------------------------------------
# Sampling parameters


@dataclass
class SamplingParams:
    """Per-request sampling parameters with the reference's defaults (section W1)."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    spaces_between_special_tokens: bool = True
    regex: str | None = None
    n: int = 1
    json_schema: str | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None

    # Filled by normalize().
    stop_strs: list[str] = field(default_factory=list)
    stop_str_max_len: int = 0

    def has_output_penalties(self) -> bool:
        """Frequency, presence or repetition penalty set (they need every sampled token)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def drop_output_penalties(self) -> None:
        self.frequency_penalty = self.presence_penalty = 0.0
        self.repetition_penalty = 1.0

    @classmethod
    def from_dict(cls, data: dict | None) -> "SamplingParams":
        """Build from a user dict; unknown keys are an error naming them."""
        data = dict(data or {})
        known = {f for f in cls.__dataclass_fields__ if f not in ("stop_strs", "stop_str_max_len")}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {', '.join(unknown)}")
        return cls(**data)

    def verify(self) -> None:
        """Raise ValueError naming the first invalid field (reference W2, plus type and NaN checks)."""
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"sampling_params.{name}: must be a number, got {value!r}")
            if math.isnan(value) or math.isinf(value):
                raise ValueError(f"sampling_params.{name}: must be finite, got {value}")
        for name in ("top_k", "min_new_tokens", "n", "max_new_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_new_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"sampling_params.{name}: must be an integer, got {value!r}")
            # Counts reach int64 tensors (and C kernels' int32 ones): a larger value would crash the batch.
            if value > MAX_PARAM_INT:
                raise ValueError(f"sampling_params.{name}: must be <= {MAX_PARAM_INT}, got {value}")
        if self.temperature < 0.0:
            raise ValueError(f"sampling_params.temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p: must be in [0, 1], got {self.min_p}")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"sampling_params.top_k: must be -1 (disable) or >= 1, got {self.top_k}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"sampling_params.frequency_penalty: must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"sampling_params.presence_penalty: must be in [-2, 2], got {self.presence_penalty}")
        # The reference allows 0, which divides positive logits by zero (inf logits, NaN probabilities).
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"sampling_params.repetition_penalty: must be in (0, 2], got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            raise ValueError(f"sampling_params.min_new_tokens: must be >= 0, got {self.min_new_tokens}")
        if self.n < 1:
            raise ValueError(f"sampling_params.n: must be >= 1, got {self.n}")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise ValueError(f"sampling_params.max_new_tokens: must be >= 0, got {self.max_new_tokens}")
            if self.min_new_tokens > self.max_new_tokens:
                raise ValueError(
                    f"sampling_params.min_new_tokens: must be <= max_new_tokens "
                    f"({self.min_new_tokens} > {self.max_new_tokens})"
                )
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("sampling_params: regex and json_schema cannot both be set")
        if self.stop is not None and not (
            isinstance(self.stop, str)
            or (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))
        ):
            raise ValueError(f"sampling_params.stop: must be a string or a list of strings, got {self.stop!r}")
        for flag in ("no_stop_trim", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"sampling_params.{flag}: must be true or false, got {getattr(self, flag)!r}")
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, (list, tuple, set))
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_PARAM_INT
                    for t in self.stop_token_ids)
        ):
            raise ValueError(
                f"sampling_params.stop_token_ids: must be a list of non-negative integers <= {MAX_PARAM_INT}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"sampling_params.seed: must be an integer or null, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # (the draws key on its 64 bits)
            raise ValueError(f"sampling_params.seed: must fit in 64 bits, got {self.seed}")
        if self.regex is not None or self.json_schema is not None:
            from framework.grammar import check_grammar_params  # imports xgrammar, only when used

            check_grammar_params(self)

    def normalize(self, tokenizer=None) -> None:
        """Greedy when temperature ~ 0; top_k -1 means all; stop strings and their max token length."""
        if self.temperature < 1e-6:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1 or self.top_k > TOP_K_ALL:
            self.top_k = TOP_K_ALL
        stop = self.stop
        if stop is None:
            self.stop_strs = []
        elif isinstance(stop, str):
            self.stop_strs = [stop] if stop else []  # "" stops nothing, as in a list (it is in every text)
        else:
            self.stop_strs = [s for s in stop if s]
        if self.stop_strs:
            if tokenizer is not None:
                self.stop_str_max_len = max(
                    len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop_strs
                )
            else:
                self.stop_str_max_len = max(len(s) for s in self.stop_strs)
        self.stop_token_ids = set(self.stop_token_ids or ())

    @property
    def is_greedy(self) -> bool:
        return self.top_k <= 1


# ---------------------------------------------------------------------------------------------
# Request identity: who sent a request, how important it is, its first-token deadline


def check_client_id(value: Any, max_chars: int, name: str = "client_id") -> str | None:
    """A client id as given (None: anonymous); ValueError naming `name` otherwise. Control
    characters are refused: the id becomes a Prometheus label value and a log field."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a string or null, got {value!r}")
    if len(value) > max_chars:
        raise ValueError(f"{name}: must be at most {max_chars} characters (server.max_client_id_chars), "
                         f"got {len(value)}")
    bad = next((c for c in value if not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"{name}: must not contain control or unprintable characters, got {bad!r}")
    return value


def check_priority(value: Any, name: str = "priority") -> int | None:
    """An integer priority (larger is more important) with |value| <= MAX_PARAM_INT, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer or null, got {value!r}")
    if abs(value) > MAX_PARAM_INT:
        raise ValueError(f"{name}: must be between -{MAX_PARAM_INT} and {MAX_PARAM_INT}, got {value}")
    return value


def check_slo_ttft_ms(value: Any, name: str = "slo_ttft_ms") -> float | None:
    """A time-to-first-token deadline in milliseconds after arrival (finite, >= 0), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number of milliseconds or null, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
    return float(value)


def check_identity(client_id: Any, priority: Any, slo_ttft_ms: Any, max_client_id_chars: int,
                   client_id_name: str = "client_id") -> tuple[str | None, int | None, float | None]:
    """The three identity fields of one request, checked (ValueError naming the first bad one)."""
    return (check_client_id(client_id, max_client_id_chars, client_id_name), check_priority(priority),
            check_slo_ttft_ms(slo_ttft_ms))


def check_logprob_args(return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any, max_top: int,
                       prompt_len: int | None) -> None:
    """A request's logprob arguments (ValueError naming the first bad one): `return_logprob` a
    bool, `logprob_start_len` an integer >= -1 and below the prompt's length (`prompt_len`, None
    when unknown: a session's history), `top_logprobs_num` an integer in [0, max_top]."""
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob: must be true or false, got {return_logprob!r}")
    for name, value, minimum in (("logprob_start_len", logprob_start_len, -1), ("top_logprobs_num", top_logprobs_num, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    if prompt_len is not None and logprob_start_len > 0 and logprob_start_len >= prompt_len:
        raise ValueError(f"logprob_start_len: must be < the prompt length ({prompt_len}), got {logprob_start_len}")
    if top_logprobs_num > max_top:
        raise ValueError(f"top_logprobs_num: must be <= {max_top}, got {top_logprobs_num}")


def input_too_long_message(num_tokens: int, context_len: int, max_total_num_tokens: int,
                           max_req_input_len: int) -> str:
    """Why an input of `num_tokens` is refused, naming the limit that binds: the model's context
    or a smaller KV pool (cache.max_total_tokens / cache.kv_cache_memory_mb)."""
    limit = (f"the model's context length allows (context_len {context_len})"
             if context_len <= max_total_num_tokens else
             f"the KV pool allows (max_total_num_tokens {max_total_num_tokens}: "
             "cache.max_total_tokens / cache.kv_cache_memory_mb)")
    return f"The input ({num_tokens} tokens) is longer than {limit}: at most {max_req_input_len} tokens."


# ---------------------------------------------------------------------------------------------
# Request kinds and input_embeds


def request_kind_error(is_embedding: bool, is_generation: bool) -> str | None:
    """Why a request cannot be served by this model (embedding vs generation), or None."""
    if is_embedding and is_generation:
        return ("This model does not appear to be an embedding model: /encode and /v1/embeddings "
                "need one (a LlamaModel checkpoint, or model.is_embedding = true).")
    if not is_embedding and not is_generation:
        return ("This model is an embedding model: it serves /encode and /v1/embeddings, "
                "not generation.")
    return None


def split_input_embeds(value: Any) -> tuple[bool, list[Any]]:
    """(single, one value per prompt) for input_embeds given for one prompt (a list of vectors,
    a 2-D tensor) or for several (a list of those, a 3-D tensor)."""
    if hasattr(value, "dim"):
        return (True, [value]) if value.dim() != 3 else (False, list(value))
    try:
        first = value[0][0]
    except (TypeError, IndexError, KeyError):
        return True, [value]  # not nested enough: input_embeds_tensor names the problem
    if isinstance(first, (list, tuple)) or hasattr(first, "dim"):
        return False, list(value)
    return True, [value]


def input_embeds_tensor(value: Any, hidden_size: int) -> "torch.Tensor":
    """A prompt given as vectors (a [num_tokens][hidden_size] list of numbers, or a tensor) as a
    float32 tensor; ValueError naming the problem otherwise."""
    import torch

    try:
        embeds = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError("input_embeds: must be a list of vectors (lists of numbers) of equal length") from None
    if embeds is value:
        embeds = embeds.clone()  # the request keeps it; the caller's tensor may change
    if embeds.dim() != 2 or embeds.shape[0] == 0:
        raise ValueError(f"input_embeds: must be a non-empty list of vectors, got shape {list(embeds.shape)}")
    if embeds.shape[1] != hidden_size:
        raise ValueError(
            f"input_embeds: each vector must have {hidden_size} numbers (the model's hidden size), "
            f"got {embeds.shape[1]}"
        )
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("input_embeds: values must be finite")
    return embeds


# ---------------------------------------------------------------------------------------------
# Requests


class Req:
    """One generation request inside the scheduler."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        origin_input_text: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        eos_token_ids: set[int] | None = None,
        session_id: str | None = None,
        priority: int | None = None,
        is_embedding: bool = False,
        input_embeds: Any = None,
        lora_path: str | None = None,
        client_id: str | None = None,
        slo_ttft_ms: float | None = None,
    ):
        self.rid = rid
        # Who sent it (the OpenAI `user`); None: anonymous. Read by fairness policies and the
        # per-client accounting.
        self.client_id = client_id
        # Larger is more important; None: not given. Read by the priority-aware radix eviction
        # order (as 0) and priority policies.
        self.priority = priority
        # The first token is due this many milliseconds after `arrival_time`; None: no deadline.
        self.slo_ttft_ms = slo_ttft_ms
        # When the scheduler took the request in, on the scheduler's clock (set at intake; the wall
        # clock, or the sim worker's virtual one).
        self.arrival_time = time.perf_counter()
        # The LoRA adapter's name, None for the base model (reference AB2).
        self.lora_path = lora_path
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        # The id of the token sampled by a launched batch whose result is not processed yet: a
        # placeholder from a pipelined worker (reference K5), or None when `output_ids` is current.
        self.future_token_id: int | None = None
        # The last `num_draft_tokens` of `output_ids` are not sampled but proposed (jump-forward's
        # forced text): the next pass checks them against what the model would sample.
        self.num_draft_tokens = 0
        # [num_draft_tokens, ceil(vocab / 32)] int32: the grammar bitmask each draft is chosen under.
        self.draft_vocab_masks: Any = None
        self.fill_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids or set()
        self.session_id = session_id
        self.stream = stream
        # Images of a multimodal request; origin_input_ids then holds their pad ids (AA3).
        self.image_inputs: Any = None
        # An embedding request: one prefill, then `embedding` is its output (reference Y4).
        self.is_embedding = is_embedding
        self.embedding: list[float] | None = None
        # [len(origin_input_ids), hidden] float32 vectors that replace the embedding lookup of
        # the prompt, whose ids are then placeholders (reference Z2).
        self.input_embeds = input_embeds

        # Memory state.
        self.req_pool_idx: int | None = None
        self.prefix_indices = _EMPTY_INDICES
        self.last_node: Any = None
        self.extend_input_len = 0

        # Lifecycle.
        self.finished_reason: FinishReason | None = None
        self.is_being_chunked = 0
        self.is_retracted = False
        self.cached_tokens = 0
        self.vid = 0
        self.decoded_text = ""
        self.tokenizer: Any = None

        # Logprobs.
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.normalized_prompt_logprob: float | None = None
        self.input_token_logprobs: list | None = None
        self.output_token_logprobs: list = []
        self.input_top_logprobs: list | None = None
        self.output_top_logprobs: list = []
        self.extend_logprob_start_len = 0

        # Per-plugin state.
        self.stash = Stash()

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, input_len={len(self.origin_input_ids)}, "
            f"output_len={len(self.output_ids)})"
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def finished(self) -> bool:
        return self.finished_reason is not None

    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far, the one still in flight included."""
        return len(self.output_ids) + (self.future_token_id is not None)

    def last_token_id(self) -> int:
        """The input of this request's next decode step: the in-flight token, else the last output."""
        return self.future_token_id if self.future_token_id is not None else self.output_ids[-1]

    def keep_draft_tokens(self, kept: int) -> int:
        """The first `kept` draft tokens become outputs like any other, the rest leave
        `output_ids` and `fill_ids` (which holds them); returns how many left."""
        dropped = self.num_draft_tokens - kept
        if dropped:
            del self.output_ids[-dropped:]
            del self.fill_ids[-dropped:]
        self.num_draft_tokens = 0
        self.draft_vocab_masks = None
        return dropped

    def init_next_round_input(self, tree_cache=None) -> None:
        """Set `fill_ids` and, when a cache is given, match the prefix (reference D4 step 8)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            self.prefix_indices, self.last_node = tree_cache.match_prefix(
                rid=self.rid, key=self.adjust_max_prefix_ids()
            )
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def adjust_max_prefix_ids(self) -> list[int]:
        """The longest prefix that may come from the cache: at least one token is recomputed (U1)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        return self.fill_ids[: self.max_prefix_len()]

    def max_prefix_len(self) -> int:
        """How many leading tokens of the next input may come from the cache (U1)."""
        input_len = len(self.origin_input_ids) + len(self.output_ids)
        max_prefix_len = input_len - 1
        if self.input_embeds is not None:
            max_prefix_len = 0  # placeholder ids: a cached prefix under them is not this prompt's KV
        if self.return_logprob:
            if self.normalized_prompt_logprob is None:
                max_prefix_len = min(max_prefix_len, input_len - 2)
            max_prefix_len = min(max_prefix_len, self.logprob_start_len)
        return max(max_prefix_len, 0)

    def check_finished(self) -> None:
        """Stop conditions in the reference's order (section V)."""
        if self.finished():
            return
        params = self.sampling_params
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishLength(length=params.max_new_tokens)
            return
        last_token_id = self.output_ids[-1]
        # min_new_tokens is enforced by masking stop tokens in the sampler; the guard keeps a
        # stop token that slipped through (e.g. a forced token) from ending the request early.
        if not params.ignore_eos and len(self.output_ids) > params.min_new_tokens:
            if last_token_id in params.stop_token_ids or last_token_id in self.eos_token_ids:
                self.finished_reason = FinishMatchedToken(matched=last_token_id)
                return
        if params.stop_strs and self.tokenizer is not None:
            tail = self.tokenizer.decode(self.output_ids[-(params.stop_str_max_len + 1):])
            for stop_str in params.stop_strs:
                if stop_str in tail or stop_str in self.decoded_text:
                    self.finished_reason = FinishMatchedStr(matched=stop_str)
                    return

    def reset_for_retract(self) -> None:
        """Back to the waiting state; output ids are kept and re-prefilled later (reference I2)."""
        self.prefix_indices = _EMPTY_INDICES
        self.last_node = None
        self.extend_input_len = 0
        self.is_retracted = True
        # The in-flight token is dropped: it is recomputed by the re-prefill.
        self.future_token_id = None
        # No prompt logprobs on the re-prefill.
        self.logprob_start_len = 10**9


def _empty_indices():
    import torch

    return torch.empty((0,), dtype=torch.int64)


_EMPTY_INDICES = _empty_indices()
