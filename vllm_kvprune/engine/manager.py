"""The capped single-type manager: the scheduler's half of "scheduler reserves, worker maps"."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.vllm_hooks import FullAttentionManager

PolicyLookup = Callable[[str], "KVPolicyConfig | None"]
PromptLookup = Callable[[str], "int | None"]


class KVPruneManager(FullAttentionManager):
    """Allocates like full attention while a prompt is prefilled, then caps the request.

    Invariants (per request, with policy p, block size bs and a prompt of P tokens):
    - while the prompt is prefilled it holds at most `p.prompt_blocks(bs, P)` blocks (the
      whole prompt for `prefill: full`), and admitting it never asks for more than
      `max(p.prompt_blocks(bs, P), p.cap_blocks(bs))`, even when a preempted request
      comes back with outputs to replay: a request that fits an empty pool is admitted;
    - from the first step after its prompt has been processed it holds at most
      `p.cap_blocks(bs)` blocks: the tail beyond the cap is returned to the pool then,
      and nothing is allocated past it (the worker has compacted the survivors into the
      first `cap` blocks by the end of that prefill step);
    - no block is ever prefix-cached: pruned contents must never be served as a hit.
    A policy that reports its footprint (`gvote`) has no fixed cap: past its prompt a request
    holds the blocks the worker last said its kept tokens and next tokens need
    (`set_footprint`, from the step output); what a vote gives back is freed at once. The
    worker's block-table row is append-only (VLLM_NOTES 5), so the blocks a vote gives back
    are the row positions the worker names (`holes`): they become vLLM's null block, in place,
    and a block allocated later goes after them, where the worker's row will have it. A block
    is never taken from the tail of the list, where the worker might not have seen it yet
    (async scheduling allocates for the next step before this step's report arrives).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._policy_of: PolicyLookup = lambda request_id: None
        self._prompt_of: PromptLookup = lambda request_id: None
        # Requests whose prompt has been processed since they were (re)scheduled.
        self._past_prompt: set[str] = set()
        # Footprint policies: blocks each request needs for its next step, from the worker.
        self._footprints: dict[str, int] = {}
        # Footprint policies: null positions the vote's give-back left in each request's list.
        self._holes: dict[str, int] = {}
        # Told of every block `_trim` gives back (the scheduler's metrics), if bound.
        self._on_returned: Callable[[str, int], None] | None = None

    def bind_policies(self, policy_of: PolicyLookup, prompt_of: PromptLookup | None = None) -> None:
        """Called by the scheduler, which owns the per-request policies and prompts."""
        self._policy_of = policy_of
        if prompt_of is not None:
            self._prompt_of = prompt_of

    def bind_returned(self, on_returned: Callable[[str, int], None]) -> None:
        """`on_returned(request_id, num_blocks)` after each trim (metrics)."""
        self._on_returned = on_returned

    def block_limit(self, request_id: str) -> int | None:
        """Blocks the request may hold now (None: no limit)."""
        policy = self._policy_of(request_id)
        if policy is None or not policy.active:
            return None
        if policy.reports_footprint:
            # The whole prompt while it is prefilled, then what the worker reports.
            footprint = self._footprints.get(request_id) if request_id in self._past_prompt else None
            return None if footprint is None else footprint + self._holes.get(request_id, 0)
        cap = policy.cap_blocks(self.block_size)
        if request_id in self._past_prompt:
            return cap
        num_prompt_tokens = self._prompt_of(request_id)
        if num_prompt_tokens is None:
            return policy.prefill_cap_blocks(self.block_size)
        # Before the prompt ends (also when a preempted request replays its outputs later):
        # the prompt's prefill, then the cap; never the whole replayed sequence at once.
        return max(policy.prompt_blocks(self.block_size, num_prompt_tokens), cap)

    def _clamped(self, request_id: str, num_tokens: int) -> int:
        limit = self.block_limit(request_id)
        if limit is None:
            return num_tokens
        if request_id in self._footprints:
            # The worker's count governs, not the sequence's length: its kept tokens may take
            # fewer blocks than the sequence, and the list's null positions count too.
            return limit * self.block_size
        return min(num_tokens, limit * self.block_size)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(
            request_id, self._clamped(request_id, num_tokens), *args, **kwargs
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        clamped = self._clamped(request_id, num_tokens)
        return super().allocate_new_blocks(request_id, clamped, min(num_tokens_main_model, clamped))

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        # Runs before every allocation of a scheduled request: the natural point to trim.
        if num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return
        self._past_prompt.add(request_id)
        self._trim(request_id)

    def set_footprint(self, request_id: str, num_blocks: int, holes: tuple[int, int] | None = None) -> None:
        """The worker's count of blocks the request needs for its next steps (it reports only
        requests past their prompt) and, once, after the vote, the positions `[start, stop)`
        of its list that the vote gave back: freed at once, left as null blocks."""
        self._footprints[request_id] = num_blocks
        self._past_prompt.add(request_id)
        if holes is not None:
            self._give_back(request_id, *holes)

    def _give_back(self, request_id: str, start: int, stop: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or start >= stop:
            return
        null_block = self.block_pool.null_block
        span = blocks[start:stop]
        freed = [block for block in span if not block.is_null]
        blocks[start:start + len(span)] = [null_block] * len(span)
        self._holes[request_id] = self._holes.get(request_id, 0) + len(span)
        self.block_pool.free_blocks(reversed(freed))
        if self._on_returned is not None and freed:
            self._on_returned(request_id, len(freed))

    def _trim(self, request_id: str) -> None:
        if (policy := self._policy_of(request_id)) is not None and policy.reports_footprint:
            return  # only the worker's named positions are given back (`_give_back`)
        limit = self.block_limit(request_id)
        blocks = self.req_to_blocks.get(request_id)
        if limit is None or not blocks or len(blocks) <= limit:
            return
        surplus = blocks[limit:]
        del blocks[limit:]
        self.block_pool.free_blocks(reversed(surplus))
        if self._on_returned is not None:
            self._on_returned(request_id, len(surplus))

    def pop_blocks_for_free(self, request_id: str):
        # Finish, abort and preemption all come through here; a resumed request
        # re-prefills, so it is "in its prompt" again.
        self._past_prompt.discard(request_id)
        self._footprints.pop(request_id, None)
        self._holes.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def cache_blocks(self, *args, **kwargs) -> None:
        return None

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids: Sequence[int], *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0
