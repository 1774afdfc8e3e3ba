"""The offline Engine: the same Scheduler driven in-process, no sockets.

    from framework import Engine
    engine = Engine("serve.toml")                      # or Engine(settings), or Engine(**overrides)
    out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    out["text"], out["output_ids"], out["meta_info"]["finish_reason"]
    Engine(model={"path": "/models/my-embedder"}).encode(["one", "two"])[1]["embedding"]

`input_ids` may also be numpy arrays or torch tensors of integers (one, or a list of them).

Calls from several threads (a thread pool, `asyncio.to_thread`) are safe and run one at a time:
each waits for the running call to finish; pass one list of prompts to batch them together.

The Engine is one scheduler in this process, so it runs a single rank: parallel.tp_size > 1 is a
start-up error pointing to `batchyard serve`, which runs one scheduler process per rank.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

from framework.config import Settings
from framework.images import ImageProcessor, images_per_prompt
from framework.messages import AbortReq, BatchTokenOut, GenerateReqInput, ReqOutput
from framework.model.loader import resolve_model
from framework.multimodal import ImageInputs, image_count_problem
from framework.request import (
    MAX_PARAM_INT,
    FinishMatchedStr,
    FinishMatchedToken,
    SamplingParams,
    check_identity,
    check_logprob_args,
    input_embeds_tensor,
    split_input_embeds,
)
from framework.scheduler import Scheduler

logger = logging.getLogger(__name__)


def trim_output(tokenizer, out: ReqOutput) -> str:
    """Final text of a request: stop string cut off, matched stop token dropped (reference T2)."""
    ids = out.output_ids
    reason = out.finished_reason
    if not out.no_stop_trim and isinstance(reason, FinishMatchedToken):
        ids = ids[:-1]
    if tokenizer is None:
        return ""
    text = tokenizer.decode(
        ids, skip_special_tokens=out.skip_special_tokens,
        spaces_between_special_tokens=out.spaces_between_special_tokens,
    )
    if not out.no_stop_trim and isinstance(reason, FinishMatchedStr):
        pos = text.find(reason.matched)
        if pos != -1:
            text = text[:pos]
    return text


def _one_per_prompt(name: str, value: Any, num_prompts: int) -> list[Any]:
    """A list is one value per prompt; anything else is shared by all prompts."""
    if not isinstance(value, list):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"{name}: got {len(value)} values for {num_prompts} prompts")
    return value


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _plain_ids(input_ids: Any) -> Any:
    """input_ids with numpy arrays, torch tensors and their integer scalars (a batch job's ids
    often come as them) as Python lists and ints; anything else as it is (_prompts checks it)."""
    if isinstance(input_ids, (list, tuple)):
        return [_plain_ids(x) for x in input_ids]
    if hasattr(input_ids, "tolist") and hasattr(input_ids, "dtype"):
        return input_ids.tolist()
    return input_ids


# Signals whose Python handler may raise into the scheduler's iteration; their default actions
# (terminate) are left alone.
_DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGALRM") if hasattr(signal, name))


class _SignalGuard:
    """While an Engine call runs, the signals whose handlers are Python code (Ctrl-C's
    KeyboardInterrupt, a timeout's alarm) go through `handle`: inside a scheduler iteration the
    first of each kind waits for the iteration's end (`after_iteration` hands it to its handler,
    which may raise), so the iteration is never left half done; outside one, or a second time
    inside one (Ctrl-C pressed again: the caller insists), the handler runs at once. Handlers are
    swapped once per call, in the main thread only (where Python runs them)."""

    def __init__(self):
        self.saved: dict[int, Any] = {}
        self.busy = False
        self.caught: list[tuple[int, Any]] = []

    def handle(self, signum: int, frame: Any) -> None:
        if self.busy and all(s != signum for s, _ in self.caught):
            self.caught.append((signum, frame))
            return
        self.saved[signum](signum, frame)

    def after_iteration(self) -> None:
        self.busy = False
        caught, self.caught = self.caught, []
        for signum, frame in caught:
            self.saved[signum](signum, frame)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        try:
            for sig in _DEFERRED_SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler) and sig not in self.saved:
                    self.saved[sig] = handler
                    signal.signal(sig, self.handle)
            yield
        finally:
            self._restore()

    def _restore(self) -> None:
        """Put every saved handler back, even if a signal's handler raises meanwhile (the first
        such exception is raised once all are back)."""
        error: BaseException | None = None
        pending = list(self.saved.items())
        while pending:
            try:
                while pending:
                    sig, handler = pending[0]
                    signal.signal(sig, handler)
                    pending.pop(0)
            except BaseException as exc:  # (a handler ran between two of these steps)
                error = error or exc
        self.saved.clear()
        if error is not None:
            raise error


class Engine:
    """Offline batch generation with the full scheduler and plugins."""

    def __init__(
        self,
        settings: Settings | str | Path | None = None,
        extra_plugins: tuple[Any, ...] = (),
        **overrides: Any,
    ):
        if isinstance(settings, Settings):
            if overrides:
                raise TypeError("pass either a Settings object or overrides, not both")
            self.settings = settings
        else:
            self.settings = Settings.load(settings, **overrides)
        par = self.settings.parallel
        if par.dp_size > 1 and not par.enable_dp_attention:
            raise ValueError(
                f"parallel.dp_size={par.dp_size} runs one scheduler process per replica: use "
                "`batchyard serve` (the in-process Engine is one replica)"
            )
        self._outputs: dict[str, ReqOutput] = {}
        self.scheduler = Scheduler(self.settings, output_sink=self._collect, extra_plugins=extra_plugins)
        self.tokenizer = self.scheduler.tokenizer
        self._rid_counter = itertools.count()
        self._closed = False
        self._signals = _SignalGuard()
        # One call drives the scheduler at a time: calls from several threads (a thread pool,
        # asyncio.to_thread) wait their turn instead of stepping the same scheduler at once.
        # Reentrant, so a call made from inside a call fails as before rather than deadlocking.
        self._lock = threading.RLock()
        self._image_processor: ImageProcessor | None = None

    def _collect(self, batch_out: BatchTokenOut) -> None:
        for out in batch_out.outputs:
            self._outputs[out.rid] = out

    # -- public API -----------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        priority: int | list[int | None] | None = None,
        image_data: Any = None,
        input_embeds: Any = None,
        lora_path: str | list[str | None] | None = None,
        client_id: str | list[str | None] | None = None,
        slo_ttft_ms: float | list[float | None] | None = None,
    ) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list).

        Give exactly one of `prompt` (text), `input_ids` or `input_embeds`: per prompt a
        [num_tokens][hidden_size] list or tensor of vectors that replace the embedding lookup
        (such a prompt shares no prefix cache). `sampling_params` is one dict for all prompts or
        one per prompt. Request identity, each one value for all prompts or one per prompt:
        `client_id` (who sent it; None: anonymous; at most `server.max_client_id_chars`
        characters, no control characters), `priority` (an integer, larger is more important; the
        radix cache's `priority` eviction order keeps it) and `slo_ttft_ms` (a first-token
        deadline in milliseconds after arrival, >= 0). `lora_path` names a loaded LoRA adapter (model.lora_paths),
        one for all prompts or one per prompt; None is the base model. `image_data` (multimodal
        models): for one prompt an image or a list of images, for a batch one entry per prompt; an
        image is a data URL, a file path, base64 text or a PIL image, and each goes where the prompt
        has an image token. An image request longer than the context is answered with
        `finish_reason` abort (AA3). Raises ValueError naming the problem for bad input; nothing is
        left queued. An exception while it runs (KeyboardInterrupt from Ctrl-C, a timeout's
        signal: raised between two scheduler iterations, never inside one) aborts and releases this
        call's requests before it propagates, so the Engine serves the next call. RuntimeError
        after `shutdown()`.
        """
        self._check_open()
        single, id_lists, texts, embeds = self._prompts(prompt, input_ids, input_embeds)
        param_dicts = _one_per_prompt("sampling_params", sampling_params, len(id_lists))
        if any(pd is not None and not isinstance(pd, dict) for pd in param_dicts):
            raise ValueError("sampling_params: must be a dict (or one dict per prompt)")
        # No cap offline (server.max_top_logprobs_num is the HTTP API's): more than the vocabulary
        # is the whole vocabulary.
        max_top = MAX_PARAM_INT
        for ids in id_lists:
            check_logprob_args(return_logprob, logprob_start_len, top_logprobs_num, max_top,
                               None if embeds[0] is not None else len(ids))
        lora_paths = _one_per_prompt("lora_path", lora_path, len(id_lists))
        identities = self._identities(client_id, priority, slo_ttft_ms, len(id_lists))

        images = self._image_inputs(images_per_prompt(image_data, len(id_lists), not single))
        info = self.scheduler.worker.image_info
        if info is not None:  # (the scheduler would refuse them too, but as a finish, not a ValueError)
            for ids, image_inputs in zip(id_lists, images):
                problem = image_count_problem(ids, 0 if image_inputs is None else image_inputs.num_images, info)
                if problem is not None:
                    raise ValueError(problem)
        messages = []
        for ids, text, vectors, pd, image_inputs, lora, (client, prio, slo) in zip(
            id_lists, texts, embeds, param_dicts, images, lora_paths, identities
        ):
            params = SamplingParams.from_dict(pd)
            params.verify()
            params.normalize(self.tokenizer)
            if params.n != 1:
                raise ValueError("sampling_params.n > 1 is served by the HTTP API; the Engine takes n=1")
            messages.append(
                GenerateReqInput(
                    rid=self._new_rid(), input_ids=ids, sampling_params=params, input_text=text,
                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, priority=prio, input_embeds=vectors,
                    image_inputs=image_inputs, lora_path=lora, client_id=client, slo_ttft_ms=slo,
                )
            )
        return self._run(messages, single)

    def encode(
        self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
        client_id: str | list[str | None] | None = None, priority: int | list[int | None] | None = None,
        slo_ttft_ms: float | list[float | None] | None = None,
    ) -> dict | list[dict]:
        """Embed one prompt (returns a dict) or a list of prompts (returns a list) with an
        embedding model: ``{"embedding": [float, ...] (unit length), "meta_info": {...}}``.
        The identity fields are those of `generate`. Raises ValueError for bad input or a
        generation model."""
        self._check_open()
        single, id_lists, texts, _ = self._prompts(prompt, input_ids, embeds_taken=False)
        identities = self._identities(client_id, priority, slo_ttft_ms, len(id_lists))
        messages = [
            GenerateReqInput(
                rid=self._new_rid(), input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0),
                input_text=text, is_embedding=True, client_id=client, priority=prio, slo_ttft_ms=slo,
            )
            for ids, text, (client, prio, slo) in zip(id_lists, texts, identities)
        ]
        return self._run(messages, single)

    def _prompts(self, prompt: Any, input_ids: Any, input_embeds: Any = None, embeds_taken: bool = True):
        """(single, ids per prompt, text or None per prompt, input_embeds or None per prompt)."""
        if sum(x is not None for x in (prompt, input_ids, input_embeds)) != 1:
            raise ValueError("give exactly one of prompt, input_ids or input_embeds"
                             if embeds_taken else "give exactly one of prompt or input_ids")
        if input_embeds is not None:
            single, values = split_input_embeds(input_embeds)
            hidden_size = self.scheduler.worker.hidden_size
            embeds = [input_embeds_tensor(v, hidden_size) for v in values]
            # Placeholder ids: the vectors are the prompt.
            return single, [[0] * len(e) for e in embeds], [None] * len(embeds), embeds
        if prompt is not None and not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
        if input_ids is not None:
            input_ids = _plain_ids(input_ids)
        if input_ids is not None and not _is_ids(input_ids) and not (
            isinstance(input_ids, (list, tuple)) and input_ids and all(_is_ids(x) for x in input_ids)
        ):
            raise ValueError("input_ids must be a list of integers or a list of such lists")
        single = isinstance(prompt, str) or (
            input_ids is not None and (len(input_ids) == 0 or isinstance(input_ids[0], int))
        )
        if prompt is not None:
            prompts = [prompt] if single else list(prompt)
            if any(not isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass input_ids")
            id_lists = [self.tokenizer.encode(p) for p in prompts]
            texts: list[str | None] = list(prompts)
        else:
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
            texts = [None] * len(id_lists)
        return single, id_lists, texts, [None] * len(id_lists)

    def _identities(self, client_id: Any, priority: Any, slo_ttft_ms: Any,
                    num_prompts: int) -> list[tuple[str | None, int | None, float | None]]:
        """(client_id, priority, slo_ttft_ms) per prompt, checked; ValueError naming the field."""
        per_prompt = [
            _one_per_prompt(name, value, num_prompts)
            for name, value in (("client_id", client_id), ("priority", priority), ("slo_ttft_ms", slo_ttft_ms))
        ]
        max_chars = self.settings.server.max_client_id_chars
        return [check_identity(*values, max_chars) for values in zip(*per_prompt)]

    def _new_rid(self) -> str:
        return f"engine-{next(self._rid_counter)}-{uuid.uuid4().hex[:8]}"

    def _check(self, msg: GenerateReqInput) -> None:
        ids = msg.input_ids
        if not _is_ids(ids):
            raise ValueError("input_ids must be lists of integers")
        vocab = self.scheduler.worker.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"input_ids: token ids must be in [0, {vocab})")
        error = (
            self.scheduler.validate_request(msg) or self.scheduler.validate_input(ids)
            or self.scheduler.validate_lora(msg.lora_path)
        )
        if error is not None:
            raise ValueError(error)

    def _run(self, messages: list[GenerateReqInput], single: bool) -> dict | list[dict]:
        """Check every request, then run them all to completion; their outputs as dicts."""
        with self._lock:
            self._check_open()
            for msg in messages:
                self._check(msg)
            rids = [m.rid for m in messages]
            with self._signals.installed():
                self._run_requests(messages)
            results = [self._to_dict(self._outputs.pop(rid)) for rid in rids]
        return results[0] if single else results

    def _run_requests(self, messages: list[GenerateReqInput]) -> None:
        rids = [m.rid for m in messages]
        try:
            for msg in messages:  # (queued inside the guard: a Ctrl-C while queueing aborts them too)
                self.scheduler.send(msg)
            self._run_until_done(rids)
        except BaseException:
            # Interrupted (Ctrl-C, a timeout's signal) between two scheduler iterations, or a
            # failure: abort these requests and let the scheduler release them, so the Engine is
            # idle and whole for the next call.
            for rid in rids:
                self.scheduler.send(AbortReq(rid))
            try:
                self._drain()
            except Exception:
                logger.exception("the scheduler failed while releasing the interrupted requests")
            for rid in rids:
                self._outputs.pop(rid, None)
            raise

    def _image_inputs(self, per_prompt: list[list | None]) -> list[ImageInputs | None]:
        if all(images is None for images in per_prompt):
            return per_prompt
        if self.scheduler.worker.image_info is None:
            raise ValueError("image_data: this model does not take images")
        if self._image_processor is None:
            self._image_processor = ImageProcessor.from_model_folder(resolve_model(self.settings.model.path))
        return [None if images is None else self._image_processor.process(images) for images in per_prompt]

    def _run_until_done(self, rids: list[str]) -> None:
        pending = set(rids)
        while pending:
            self._run_once()
            pending = {
                r for r in pending
                if r not in self._outputs or self._outputs[r].finished_reason is None
            }
        self._drain()

    def _drain(self) -> None:
        """Drain the pipeline and run one idle iteration, so that the leak check sees the final state."""
        while self.scheduler.has_work():
            self._run_once()
        self._run_once()

    def _run_once(self) -> None:
        """One scheduler iteration, whole: a signal whose handler raises (Ctrl-C's
        KeyboardInterrupt, an alarm's timeout) raises after it, not in the middle, where it would
        leave the iteration half done (a request's KV slots allocated but not yet its own); a
        second one of the same kind meanwhile raises at once (_SignalGuard)."""
        self._signals.busy = True
        try:
            self.scheduler.run_once()
        finally:
            self._signals.after_iteration()

    def _to_dict(self, out: ReqOutput) -> dict:
        if out.embedding is not None:
            return {"embedding": list(out.embedding), "meta_info": dict(out.meta_info)}
        return {
            "text": trim_output(self.tokenizer, out),
            "output_ids": list(out.output_ids),
            "meta_info": dict(out.meta_info),
        }

    def flush_cache(self) -> bool:
        with self._lock:
            self._check_open()
            return self.scheduler.flush_cache()

    def update_weights_from_disk(self, model_path: str) -> tuple[bool, str]:
        """Load the weights of `model_path` (same architecture) without a restart; the prefix
        cache is flushed. On failure the old weights keep serving. Returns (success, message)."""
        with self._lock:
            self._check_open()
            return self.scheduler.update_weights(model_path)

    def start_profile(self) -> str:
        """Start the torch profiler (traces go to `server.profile_dir`); raises ValueError if
        it is already running."""
        with self._lock:
            self._check_open()
            return self._checked(self.scheduler.profile("start"))

    def stop_profile(self) -> str:
        """Stop the profiler and write its trace; returns the trace file's path."""
        with self._lock:
            self._check_open()
            return self._checked(self.scheduler.profile("stop"))

    @staticmethod
    def _checked(reply: tuple[bool, str]) -> str:
        success, message = reply
        if not success:
            raise ValueError(message)
        return message

    def shutdown(self) -> None:
        """Stop the scheduler and its threads; later calls raise RuntimeError. Idempotent. From
        another thread it waits for the running call to finish."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.scheduler.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was shut down; create a new one")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
