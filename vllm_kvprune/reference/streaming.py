"""Reference implementation of StreamingLLM (attention sinks + recent window).

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (arXiv 2309.17453),
written plainly on a contiguous per-layer cache (shift-and-append), fp32, as the oracle the
engine's ``streaming`` policy is tested against.

Semantics (the engine implements exactly the same):

* ``budget`` B: the maximum number of keys a decode query attends to, *including* the new token.
  ``sinks`` S (``0 <= S < B``): the first S tokens ever seen are never evicted.
  ``prune_interval`` R >= 1 (lazy pruning).
* Unified step rule: a step processes q new tokens (q = 1 for decode, a chunk for prefill).
  Before it, if ``len(cache) + q > B + R - 1`` and ``len(cache) > B - 1``, the oldest non-sink
  tokens are evicted until ``len(cache) == B - 1``.  Then the q tokens are appended and each one
  attends to the kept cache plus the new tokens up to itself.  With R = 1 a decode query sees
  ``min(n, B)`` keys; with R > 1 the cache grows to ``B + R - 1`` keys and then drops back to B.
  Note that a step never evicts when ``len(cache) <= B - 1``, even when ``len(cache) + q`` is far
  above the budget (a long prefill chunk on a short cache attends to all of it).
* ``prefill="full"``: the prompt is one step (cache empty, no eviction), full causal attention.
  ``prefill="streaming"``: consecutive chunks of ``prefill_chunk`` tokens, each one step under the
  rule (C = 1, R = 1 is StreamingLLM's token-by-token streaming evaluation).  Prompt logprobs
  are computed in both modes from the logits of the steps.
* ``positions="original"``: keys rotated once at their absolute position, queries at theirs.
  ``positions="cache"`` (StreamingLLM's own semantics, as in its ``pos_shift`` code): raw
  (pre-RoPE) keys are cached; at each step the kept tokens are rotated at ``0..n-1`` in cache
  order and the q new tokens (keys and queries) at ``n..n+q-1``.
* Generation is greedy, ignores EOS and runs exactly ``max_new_tokens`` tokens.  The victims are
  determined by position only, so no score ties arise (the shared tie rule, oldest first, is in
  :func:`vllm_kvprune.reference.model.lowest_scores_first`).
* ``budget=None``: no eviction, plain full-cache decoding through the same forward.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from .model import HeadTransform, load_reference_model
from .budgeted import BudgetedReference, ReferenceOutput

__all__ = ["StreamingLLMReference", "ReferenceOutput", "load_reference_model", "main"]


class StreamingLLMReference(BudgetedReference):
    """StreamingLLM on a contiguous cache: keep the ``sinks`` first tokens and the most recent
    ones (see the module docstring for the exact rule)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        budget: int | None,
        sinks: int = 4,
        prune_interval: int = 1,
        positions: str = "original",
        prefill: str = "full",
        prefill_chunk: int = 256,
        head_transform: HeadTransform | None = None,
    ) -> None:
        if not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
        if isinstance(budget, int) and sinks >= budget:
            raise ValueError(f"sinks ({sinks}) must be smaller than budget ({budget})")
        self.sinks = sinks
        super().__init__(
            model,
            budget=budget,
            prune_interval=prune_interval,
            positions=positions,
            prefill=prefill,
            prefill_chunk=prefill_chunk,
            head_transform=head_transform,
        )

    def choose_keep(self, n_keep: int) -> torch.Tensor:
        """Sinks (cache indices ``0..S-1``: the first S tokens ever seen, never evicted before)
        followed by the ``n_keep - S`` most recent tokens."""
        n = len(self.cache)
        s = self.sinks
        assert s <= n_keep < n, (s, n_keep, n)
        first = self.cache.positions[0][0, :s]
        assert torch.equal(first, torch.arange(s)), "sinks must be the first tokens ever seen"
        return torch.cat([torch.arange(s), torch.arange(n - (n_keep - s), n)])


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parse_budget(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "full") else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvprune.reference.streaming",
        description="Greedy generation with the StreamingLLM reference (contiguous cache, fp32).",
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model folder")
    parser.add_argument("--budget", type=_parse_budget, default=None,
                        help="max keys per decode query incl. the new token; 'none' = no eviction")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--prune-interval", type=int, default=1)
    parser.add_argument("--positions", choices=["original", "cache"], default="original")
    parser.add_argument("--prefill", choices=["full", "streaming"], default="full")
    parser.add_argument("--prefill-chunk", type=int, default=256)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt text from this file")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--show-tokens", action="store_true", help="print one line per generated token")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 is best when other jobs share the cores)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # BatchEncoding in recent transformers
            ids = ids["input_ids"]
    else:
        ids = tok(text)["input_ids"]
    ids = [int(i) for i in ids]

    model = load_reference_model(args.model)
    ref = StreamingLLMReference(
        model,
        budget=args.budget,
        sinks=args.sinks,
        prune_interval=args.prune_interval,
        positions=args.positions,
        prefill=args.prefill,
        prefill_chunk=args.prefill_chunk,
    )
    t0 = time.perf_counter()
    out = ref.generate(ids, args.max_new_tokens)
    dt = time.perf_counter() - t0

    print(f"prompt tokens: {len(ids)}  generated: {len(out.token_ids)}  time: {dt:.2f}s")
    if out.kept_sizes:
        print(f"keys per decode query: min {min(out.kept_sizes)}  max {max(out.kept_sizes)}")
    if args.show_tokens:
        for i, (t, lp, m) in enumerate(zip(out.token_ids, out.logprobs, out.margins)):
            print(f"{i:5d} {t:7d} {tok.decode([t])!r:20s} logprob {lp:9.5f} margin {m:8.4f}")
    print("token ids:", out.token_ids)
    print("text:", tok.decode(out.token_ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def from_config(model: nn.Module, config, block_size: int) -> StreamingLLMReference:
    """The oracle of a served `streaming` config (`KVPolicyConfig`), FDC's narrow heads included."""
    from .fdc import transform_for

    return StreamingLLMReference(model, budget=config.budget, sinks=config.sinks, prune_interval=config.prune_interval,
                                 positions=config.positions, prefill=config.prefill,
                                 prefill_chunk=config.prefill_chunk, head_transform=transform_for(model, config))
