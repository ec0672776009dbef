"""Teacher forcing in a vLLM engine: a logits processor that makes every step emit a given token.

Perplexity under a bounded cache needs the text fed one token per decode step, so that the
policy evicts inside it as it would while generating (StreamingLLM's evaluation). vLLM scores
the sampled token from the raw logits (`logprobs_mode="raw_logprobs"`, its default) before
logits processors run, so a request with `logprobs=0` gets the model's log-probability of each
forced token while this processor makes that token the one sampled.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCED_KEY = "forced_token_ids"


def forced_tokens(params: SamplingParams) -> list[int] | None:
    return (params.extra_args or {}).get(FORCED_KEY)


class ForcedTokens(LogitsProcessor):
    """Requests whose `extra_args["forced_token_ids"]` is set emit those tokens in order."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        forced = forced_tokens(params)
        if forced is None:
            return
        if not isinstance(forced, list) or not all(isinstance(t, int) and t >= 0 for t in forced):
            raise ValueError(f"{FORCED_KEY} must be a list of token ids")
        if params.max_tokens is None or params.max_tokens > len(forced):
            raise ValueError(f"max_tokens must be at most len({FORCED_KEY}) = {len(forced)}")

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (tokens to force, the request's live output token list)
        self._forced_rows: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self._forced_rows, batch_update,
            lambda params, _prompt, output_ids: (f, output_ids) if (f := forced_tokens(params)) else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        for row, (forced, output_ids) in self._forced_rows.items():
            if len(output_ids) < len(forced):
                rows.append(row)
                tokens.append(forced[len(output_ids)])
        if rows:
            logits[rows] = float("-inf")
            logits[rows, tokens] = 0.0
        return logits
