"""Structured output with xgrammar (reference sections X and J).

A request with `json_schema` or `regex` gets a `Grammar`: a matcher over a compiled grammar.
Compilation runs on a thread pool, keyed by `(kind, string)` in a cache, so the scheduler loop never
waits for it: a request whose grammar is still compiling waits in the scheduler's grammar queue.
Each step the batch's vocabulary bitmask is filled from the matchers and applied to the logits
before sampling; after sampling each matcher accepts its request's token.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from framework.request import Req, SamplingParams, StashKey

logger = logging.getLogger(__name__)

# How far a matcher can roll back (the reference's value): a refused jump rolls back its partial
# accept, and drafts the model disagrees with are rolled back.
MAX_ROLLBACK_TOKENS = 200
# Draft tokens proposed per jump (a longer forced string goes on at the next jump).
MAX_DRAFT_TOKENS = 64

GrammarKey = tuple[str, str]


class GrammarError(ValueError):
    """A schema or regex that xgrammar cannot turn into a grammar."""


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    if params.json_schema is not None:
        return ("json", params.json_schema)
    if params.regex is not None:
        return ("regex", params.regex)
    return None


# Bounds on what a request may ask of the grammar engine, checked before it is queued: parsing a
# schema nested N levels deep takes ~N^3 time (600 levels: 16 s, on the tokenizer's one thread),
# and a counted repetition's forced text (`g{10000000}`) is what jump-forward searches each step.
MAX_SCHEMA_DEPTH = 64  # levels of JSON objects and arrays in a schema
MAX_REPEAT = 1000  # the largest count of a regex's {n}, {n,} or {n,m}, and of a schema's minItems
# The largest product of nested counts (`((a{1000}){1000}){1000}`: each count is within MAX_REPEAT,
# but jump-forward's search for its forced text took minutes, in the scheduler loop).
MAX_NESTED_REPEAT = 100_000
# A forced string longer than this (in characters) is jumped once; the request then decodes
# plainly (the same output), so that its grammar is not searched for it at every step.
MAX_JUMP_CHARS = 4096
# Characters of the forced string encoded per draft token wanted (no token of a vocabulary is
# longer), so that encoding it costs no more than the drafts taken.
MAX_CHARS_PER_DRAFT = 64


def check_grammar_params(params: SamplingParams) -> None:
    """Raise ValueError naming the field when its schema or regex cannot be parsed, or asks for
    what xgrammar would silently ignore or what would stall the server (the bounds above).

    Parsing without a tokenizer takes a few milliseconds at most within those bounds (64 levels:
    ~12 ms), so bad input is rejected before it is queued (the reference compiles it, fails, and runs the request
    unconstrained).
    """
    import json

    import xgrammar as xgr

    for name in ("json_schema", "regex"):
        value = getattr(params, name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"sampling_params.{name}: must be a string, got {type(value).__name__}")
        if name == "json_schema":
            try:
                schema = json.loads(value)
            except RecursionError:
                raise ValueError(f"sampling_params.json_schema: nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
            except ValueError as exc:
                raise ValueError(f"sampling_params.json_schema: invalid: not JSON ({_clip(str(exc))})") from None
            problem = _schema_problem(schema)
        else:
            problem = _regex_problem(value)
        if problem is not None:
            raise ValueError(f"sampling_params.{name}: {problem}")
        try:
            if name == "json_schema":
                xgr.Grammar.from_json_schema(value)
            else:
                xgr.Grammar.from_regex(value)
        except RuntimeError as exc:
            raise ValueError(f"sampling_params.{name}: invalid: {_short_message(exc)}") from None


def _regex_problem(regex: str) -> str | None:
    """Why `regex` is refused before xgrammar parses it (a repetition count above MAX_REPEAT, or
    nested counts whose product is above MAX_NESTED_REPEAT), or None. Escaped characters and
    character classes are skipped; xgrammar reports the rest."""
    i, n, in_class = 0, len(regex), False
    # Largest product of counts inside the current group, those of the enclosing groups, and that
    # of the group just closed (a count right after its `)` multiplies it).
    inner, outer, closed = 1, [], None
    while i < n:
        c = regex[i]
        after_group, closed = closed, None
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex.startswith("]", i + 1) or regex.startswith("^]", i + 1):
                i += 1 + (regex[i + 1] == "^")  # a leading ] is a literal
        elif c == "(":
            outer.append(inner)
            inner = 1
        elif c == ")" and outer:
            closed = inner
            inner = max(inner, outer.pop())
        elif c == "{":
            end = regex.find("}", i)
            counts = regex[i + 1 : end].split(",") if end > 0 else []
            if 1 <= len(counts) <= 2 and all(part.isdigit() or part == "" for part in counts) and counts[0]:
                largest = max(int(part) for part in counts if part)
                if largest > MAX_REPEAT:
                    return f"a repetition count of {largest} is above {MAX_REPEAT} (`{_clip(regex[i : end + 1])}`)"
                product = largest * (after_group or 1)
                if product > MAX_NESTED_REPEAT:
                    return (f"nested repetition counts multiply to {product}, above {MAX_NESTED_REPEAT} "
                            f"(`{_clip(regex[: end + 1])}`)")
                inner = max(inner, product)
                i = end
        i += 1
    return None


# Keywords whose value is a schema, a list of schemas, or a name -> schema mapping.
_SUBSCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems",
              "unevaluatedItems", "unevaluatedProperties", "if", "then", "else")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _schema_problem(schema: Any) -> str | None:
    """Why a JSON schema is refused before xgrammar parses it, or None: nested deeper than
    MAX_SCHEMA_DEPTH; `not` or a `$ref` to another document, which xgrammar ignores (with a warning
    on stderr only), so the output would not follow the schema; a `pattern` that is not a regex
    xgrammar takes (a lookahead is ignored there but refused as `regex`)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"nested more than {MAX_SCHEMA_DEPTH} levels deep"
        if isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, dict):
            stack.extend((value, depth + 1) for value in node.values())  # (for the depth)
    return _keyword_problem(schema)


def _keyword_problem(schema: Any) -> str | None:
    import xgrammar as xgr

    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if "not" in node:
            return "the keyword `not` is not supported (the output would not follow it)"
        for key in ("anyOf", "oneOf"):
            if node.get(key) == []:
                return f"`{key}` is empty: the schema allows no value"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "`allOf` with more than one schema is not supported (the output would not follow it)"
        if "multipleOf" in node and node.get("type") != "integer":
            return "`multipleOf` is only supported with `\"type\": \"integer\"` (the output would not follow it)"
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            return "`minLength`/`maxLength` with `pattern` or `format` is not supported (the output would not follow it)"
        min_items = node.get("minItems")
        if isinstance(min_items, int) and min_items > MAX_REPEAT:
            return f"`minItems` {min_items} is above {MAX_REPEAT}"
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("additionalProperties") is False and "patternProperties" not in node:
            required = node.get("required") if isinstance(node.get("required"), list) else []
            missing = [name for name in required if isinstance(name, str) and name not in properties]
            if missing:
                return (f"required property {_clip(str(missing[0]))!r} is not in `properties` and "
                        "`additionalProperties` is false: the schema allows no value")
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"`$ref` to another document ({_clip(ref)}) is not supported; only `#...` references"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            problem = _regex_problem(pattern)
            if problem is None:
                try:
                    xgr.Grammar.from_regex(pattern)
                except RuntimeError as exc:
                    problem = f"invalid: {_short_message(exc)}"
            if problem is not None:
                return f"`pattern` {_clip(pattern)!r}: {problem}"
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return None


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def _short_message(exc: Exception) -> str:
    """xgrammar's message without its timestamps, C++ source locations and check expressions,
    and without the input it echoes (a schema can be megabytes), at most ~200 characters."""
    import re

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"\[[0-9:.]+\] \S+:\d+: ", "", text)  # "[17:19:33] /project/cpp/x.cc:36: "
    text = re.sub(r"Check failed: \(.*?\) is false: ", "", text)
    text = text.split(" The JSON string is:", 1)[0]
    return _clip(text.strip())


class Grammar:
    """One request's matcher: mask, accept, jump-forward and rollback."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def fill_vocab_mask(self, mask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(mask, index)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def jump_forward_string(self) -> str:
        return self.matcher.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def accept_drafts(self, token_ids: list[int], vocab_size: int) -> torch.Tensor | None:
        """Accept all of `token_ids` or none (None), recording before each the bitmask it is
        chosen under: [len(token_ids), ceil(vocab / 32)] int32."""
        import xgrammar as xgr

        masks = xgr.allocate_token_bitmask(len(token_ids), vocab_size)
        for n, tok in enumerate(token_ids):
            self.matcher.fill_next_token_bitmask(masks, n)
            if not self.matcher.accept_token(tok):
                self.rollback(n)
                return None
        return masks


# Compiled grammars kept, least recently used dropped first: every distinct schema or regex a client
# sends would otherwise stay in the scheduler's memory for good.
MAX_CACHED_GRAMMARS = 512


class GrammarBackend:
    """Compiles grammars on a thread pool and caches them by key (the `max_cached` most recently
    used); hands out fresh matchers.

    `compile_fn(key)` returns a compiled grammar or raises; the default builds an xgrammar
    `GrammarCompiler` on first use (its tokenizer scan takes about a second, off the loop too).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, num_threads: int = 1,
                 compile_fn: Callable[[GrammarKey], Any] | None = None, max_cached: int = MAX_CACHED_GRAMMARS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_fn = compile_fn or self._compile
        self.executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self.max_cached = max_cached
        self.cache: collections.OrderedDict[GrammarKey, Future] = collections.OrderedDict()
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    def _get_compiler(self) -> Any:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        kind, text = key
        compiler = self._get_compiler()
        try:
            if kind == "json":
                # One fixed layout (json.dumps's compact separators), as the reference's xgrammar
                # had: free whitespace lets a model pad forever and leaves jump-forward only
                # fragments to append.
                return compiler.compile_json_schema(text, any_whitespace=False)
            return compiler.compile_regex(text)
        except RuntimeError as exc:
            raise GrammarError(f"{kind}: invalid: {_short_message(exc)}") from None

    def submit(self, key: GrammarKey) -> Future:
        """The compilation of `key`: started now, or the one already running or done."""
        future = self.cache.get(key)
        if future is None:
            future = self.executor.submit(self.compile_fn, key)
            self.cache[key] = future
            if len(self.cache) > self.max_cached:
                # A request waiting on the dropped compilation holds its own reference to it.
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return future

    def make_grammar(self, future: Future) -> Grammar:
        """A matcher over a finished compilation (raises its error if it failed)."""
        import xgrammar as xgr

        compiled = future.result()
        return Grammar(xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS))

    def reset(self) -> None:
        """Forget compiled grammars (flush_cache); compilations in flight finish unreferenced."""
        self.cache.clear()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


GRAMMAR_KEY: StashKey[Grammar] = StashKey("grammar")
GRAMMAR_FUTURE_KEY: StashKey[Future] = StashKey("grammar_future")
# Set on a request whose forced string was longer than MAX_JUMP_CHARS: it jumps no more.
LONG_JUMP_KEY: StashKey[bool] = StashKey("grammar_long_jump")


def grammar_of(req: Req) -> Grammar | None:
    return req.stash.get(GRAMMAR_KEY)


def batch_vocab_mask(reqs: list[Req], vocab_size: int) -> torch.Tensor | None:
    """One bitmask for the batch, rows filled from each constrained request's matcher; None
    when no request of the batch has a grammar (rows of the others allow every token)."""
    grammars = [grammar_of(r) for r in reqs]
    if all(g is None for g in grammars):
        return None
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(reqs), vocab_size)
    for i, grammar in enumerate(grammars):
        if grammar is not None and not grammar.is_terminated():
            grammar.fill_vocab_mask(mask, i)
    return mask


def apply_vocab_mask(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Disallowed tokens to -inf, on a copy (the caller keeps the raw logits for logprobs)."""
    if mask is None:
        return logits
    import xgrammar as xgr

    masked = logits.to(torch.float32, copy=True)
    xgr.apply_token_bitmask_inplace(masked, mask.to(masked.device, non_blocking=True))
    return masked


def accept_last_token(req: Req) -> bool:
    """Feed the request's newest token to its matcher; True when the grammar is now complete.

    A refused token (it should not happen under the mask) is logged and the matcher stays put.
    """
    grammar = grammar_of(req)
    if grammar is None:
        return False
    token_id = req.output_ids[-1]
    if not grammar.accept_token(token_id):
        logger.warning("request %s: grammar refused token %d", req.rid, token_id)
    return grammar.is_terminated()


def jump_forward_drafts(
    req: Req, tokenizer: Any, vocab_size: int, limit: int = MAX_DRAFT_TOKENS
) -> tuple[list[int], torch.Tensor] | None:
    """Up to `limit` tokens of the string the request's grammar forces next (reference J2), as
    drafts, and the bitmask each is chosen under; the matcher has accepted them. None when nothing
    can be jumped; then nothing changed.

    The forced string is encoded on its own and nothing sampled is re-encoded (the reference
    re-encodes the whole output with it, QUIRK). Its tokens are only a guess at how the model spells
    it ("Monday" may be "M" "ond" "ay" to the model): the next pass checks each against the token
    plain decoding would sample there (`framework.batch.DraftCheck`), so the output is the one of
    plain constrained decoding.
    """
    grammar = grammar_of(req)
    # Room for the drafts and the token sampled after them.
    room = min(limit, MAX_DRAFT_TOKENS, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
    if grammar is None or grammar.is_terminated() or room <= 0 or req.stash.get(LONG_JUMP_KEY):
        return None
    jump = grammar.jump_forward_string()
    if not jump:
        return None
    if len(jump) > MAX_JUMP_CHARS:
        req.stash[LONG_JUMP_KEY] = True  # this one jump, then plain decoding (MAX_JUMP_CHARS)
    tokens = tokenizer.encode(jump[: room * MAX_CHARS_PER_DRAFT], add_special_tokens=False)[:room]
    if not tokens:
        return None
    masks = grammar.accept_drafts(tokens, vocab_size)
    if masks is None:
        return None
    return tokens, masks
