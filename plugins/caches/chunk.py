"""The chunk cache (reference section O): no sharing between requests.

Only a request's own earlier chunks are "cached", so a chunked prefill can continue where it
stopped. Everything is freed when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework import hookimpl
from framework.cache import BasePrefixCache

PLUGIN_KIND = "cache"


@dataclass
class ChunkCacheEntry:
    rid: str
    value: torch.Tensor


class ChunkCache(BasePrefixCache):
    disable = True

    def __init__(self, req_to_token_pool, token_to_kv_pool):
        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.entries: dict[str, ChunkCacheEntry] = {}

    def reset(self) -> None:
        self.entries = {}

    def match_prefix(self, rid, key):
        entry = self.entries.get(rid)
        if entry is None:
            return torch.empty((0,), dtype=torch.int64), None
        max_prefix_len = len(key)
        return entry.value[:max_prefix_len], entry

    def cache_finished_req(self, req, token_ids=None):
        if token_ids is None:
            token_ids = (req.origin_input_ids + req.output_ids)[:-1]
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)]
        self.free_req_slot(req)
        self.token_to_kv_pool.free(kv_indices.clone())
        self.entries.pop(req.rid, None)

    def cache_unfinished_req(self, req, token_ids=None):
        if token_ids is None:
            token_ids = req.fill_ids
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)].clone()
        entry = self.entries.get(req.rid)
        if entry is None:
            entry = self.entries[req.rid] = ChunkCacheEntry(req.rid, kv_indices)
        else:
            entry.value = kv_indices
        req.prefix_indices = kv_indices
        req.last_node = entry

    def retract_req(self, req, kv_len):
        # The prefix is the request's own KV: all of it goes back to the pool.
        self.token_to_kv_pool.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len].clone())
        self.free_req_slot(req)
        self.entries.pop(req.rid, None)

    def evict(self, num_tokens, evict_callback):
        return None

    def inc_lock_ref(self, node):
        return 0

    def dec_lock_ref(self, node):
        return 0

    def evictable_size(self):
        return 0


@hookimpl
def create_cache(settings, req_to_token_pool, token_to_kv_pool):
    return ChunkCache(req_to_token_pool, token_to_kv_pool)
