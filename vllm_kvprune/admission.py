"""Admission that cannot stall: what one request needs from the KV pool, checked where the
user can be told (start-up, or HTTP 400 for the one request).

vLLM admits a configuration only if one request at `max_model_len` fits the pool, and a
queued request waits until it fits: a request that can never fit would wait forever and
hold up every request behind it. A policy changes what "fits" means (`KVPolicyConfig.
peak_blocks`): past its prompt a request keeps `cap` blocks, so generations far longer
than the pool run; while a prompt is prefilled it holds the whole prompt (`prefill: full`)
or `budget - 1 + prefill_chunk` tokens (`prefill: streaming`). These checks refuse, with a
message naming the setting and the remedy:
- at start-up, a pool that cannot hold one request's peak (vLLM's own check, with our hint);
- per request, a `kv_*` override whose peak exceeds the pool, and under `prefill: full` a
  prompt longer than the pool.
They see only the policy's own KV-cache group; the scheduler checks the exact need over all
groups again (`KVPruneScheduler.add_request`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvprune.config import REQUEST_KEYS, KVConfigError, KVPolicyConfig


def _explain(policy: KVPolicyConfig, block_size: int) -> str:
    return policy.policy.explain_capacity(policy, block_size)


def check_request_fits(policy: KVPolicyConfig, extra_args: Mapping[str, Any] | None, block_size: int,
                       max_model_len: int, usable_blocks: int) -> None:
    """A request's own settings must fit an empty pool (the prompt is checked separately)."""
    needed = policy.peak_blocks(block_size, max_model_len)
    if needed <= usable_blocks:
        return
    given = [key for key in ("kv_budget", "kv_window", "kv_sinks", "kv_recent") if key in (extra_args or {})]
    setting = given[0] if given else "kv_budget"
    raise KVConfigError(
        setting,
        f"{REQUEST_KEYS.get(setting, setting)} = {getattr(policy, REQUEST_KEYS.get(setting, 'budget'))} needs "
        f"{needed} KV blocks of {block_size} tokens at once ({_explain(policy, block_size)}), but the whole pool "
        f"has {usable_blocks}; use a smaller kv_budget",
    )


def check_prompt_fits(policy: KVPolicyConfig, num_prompt_tokens: int, block_size: int, usable_blocks: int) -> None:
    """Under `prefill: full` a prompt is cached whole before it is pruned: it must fit the pool."""
    needed = policy.prompt_blocks(block_size, num_prompt_tokens)
    if needed <= usable_blocks:
        return
    raise KVConfigError(
        "prompt",
        f"{num_prompt_tokens} tokens are cached whole before kv_policy {policy.name} (prefill: {policy.prefill}) "
        f"prunes them, which needs {needed} KV blocks; the pool has {usable_blocks} "
        f"({usable_blocks * block_size} tokens): send a shorter prompt, or serve with --kv-prefill streaming",
    )


def memory_hint(policy: KVPolicyConfig, block_size: int, max_model_len: int) -> str | None:
    """vLLM's start-up error when one request does not fit, with the policy's remedy."""
    if not policy.active:
        return None
    needed = policy.peak_blocks(block_size, max_model_len)
    remedy = "lower --max-model-len" if policy.uncapped else "lower --kv-budget"
    return (f"kv_policy {policy.name}: one request needs {needed} KV blocks of {block_size} tokens at once "
            f"({_explain(policy, block_size)}) and the KV pool cannot hold them; {remedy}"
            + (" or --kv-prefill-chunk" if policy.prefill == "streaming" else "")
            + ", or give the KV cache more memory (--kv-cache-memory-bytes)")
