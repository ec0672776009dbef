"""The generation driver shared by the reference policies, on :mod:`.model`'s forward.

:class:`BudgetedReference`: the unified step rule (budget ``B``, lazy pruning interval ``R``),
the two position modes, full or chunked ("streaming") prefill, greedy generation with logprobs
and margins. A policy overrides only :meth:`BudgetedReference.choose_keep` (which tokens
survive) and, if it needs scores, :meth:`BudgetedReference.on_step` (set
``needs_attentions = True`` to get the attention probabilities there).

Tie-breaking rule for score-based policies (see :func:`lowest_scores_first`): when scores are
equal, the *oldest* token (lowest cache index) is evicted first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Generator, Sequence

import torch
from torch import nn

from .model import ContiguousKVCache, HeadTransform, StepOutput, _decoder, compute_logits, forward_step

__all__ = ["BudgetedReference", "PromptKeepReference", "ReferenceOutput", "generate_together", "lowest_scores_first"]

POSITION_MODES = ("original", "cache")
PREFILL_MODES = ("full", "streaming")
# Rows of hidden states projected to the vocabulary at once when computing prompt logprobs.
_LOGITS_ROW_BLOCK = 256


def lowest_scores_first(scores: torch.Tensor) -> torch.Tensor:
    """Cache indices ordered from first victim to last: ascending score, ties broken by age
    (the oldest token, i.e. the lowest cache index, goes first).  ``scores`` ``[..., n]``."""
    return torch.sort(scores, dim=-1, stable=True).indices


# ---------------------------------------------------------------------------------------------
# Generation driver
# ---------------------------------------------------------------------------------------------


@dataclass
class ReferenceOutput:
    """What a reference generation returns.

    ``token_ids``/``logprobs``/``margins``: one entry per generated token (greedy); the logprob
    is ``log_softmax`` of the fp32 logits at the chosen token, the margin the top-1 minus top-2
    logit.  ``prompt_logprobs``: ``None`` for the first prompt token, then the logprob of each
    prompt token given the ones before (as computed under the policy); ``None`` if not asked.
    ``kept_sizes``: for each decode step (``max_new_tokens - 1`` of them: the first generated
    token comes from the prompt's logits, the last one is never fed back), the number of keys the
    decode query attends to, i.e. ``len(cache)`` after eviction plus the new token.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    kept_sizes: list[int] = field(default_factory=list)


class BudgetedReference:
    """Generation driver for a token-eviction policy on a contiguous cache.

    Unified step rule.  Every step processes ``q`` new tokens (``q = 1`` for decode, a chunk for
    prefill).  Before the step, if ``len(cache) + q > B + R - 1`` and ``len(cache) > B - 1``,
    the policy's :meth:`choose_keep` picks ``B - 1`` survivors and the rest are evicted.  Then
    the ``q`` tokens are appended and attend causally to the kept cache and to each other.
    ``budget=None`` disables eviction (plain full-cache decoding through the same forward).

    Positions: ``"original"`` rotates every key once at its absolute position (post-RoPE cache)
    and queries at their absolute positions.  ``"cache"`` caches raw keys and, at every step,
    rotates the kept cache at ``0..n-1`` (cache order, ``n`` after eviction) and the new tokens
    (keys and queries) at ``n..n+q-1``.

    Prefill: ``"full"`` is one step over the whole prompt (cache empty, so no eviction);
    ``"streaming"`` splits the prompt into consecutive chunks of ``prefill_chunk`` tokens (the
    last one shorter), each one step under the rule.

    Subclasses implement :meth:`choose_keep` and may override :meth:`on_step`.
    """

    #: set to True in a subclass whose :meth:`on_step` needs the attention probabilities
    needs_attentions: bool = False

    def __init__(
        self,
        model: nn.Module,
        *,
        budget: int | None,
        prune_interval: int = 1,
        positions: str = "original",
        prefill: str = "full",
        prefill_chunk: int = 256,
        head_transform: HeadTransform | None = None,
    ) -> None:
        if head_transform is not None and positions != "original":
            raise ValueError("a head transform (FDC) needs positions='original': keys are "
                             "projected after RoPE, so they cannot be re-rotated later")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int or None, got {budget!r}")
        if not isinstance(prune_interval, int) or prune_interval < 1:
            raise ValueError(f"prune_interval must be an int >= 1, got {prune_interval!r}")
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        self.model = model
        self.budget = budget
        self.prune_interval = prune_interval
        self.positions = positions
        self.prefill = prefill
        self.prefill_chunk = prefill_chunk
        self.head_transform = head_transform
        self.num_layers = len(_decoder(model).layers)
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: empty cache, next absolute position 0."""
        self.cache = ContiguousKVCache(self.num_layers, rope="pre" if self.positions == "cache" else "post")
        self.next_position = 0  # absolute position of the next token
        self.tokens_seen = 0
        self.last_kept = 0  # len(cache) after the last step (kept before it + its new tokens)

    # -- policy hooks --------------------------------------------------------------------------
    def choose_keep(self, n_keep: int) -> torch.Tensor | Sequence[torch.Tensor]:
        """Return the cache indices of the ``n_keep`` survivors (``[n_keep]`` for all layers and
        heads, ``[kv_heads, n_keep]`` per head, or one of those per layer)."""
        raise NotImplementedError

    def on_step(self, out: StepOutput, num_new: int) -> None:
        """Called after every step (e.g. to accumulate attention scores)."""

    def should_evict(self, n: int, q: int) -> bool:
        """The unified lazy rule: evict before a step of ``q`` tokens on a cache of ``n``."""
        if self.budget is None:
            return False
        b, r = self.budget, self.prune_interval
        return n + q > b + r - 1 and n > b - 1

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, token_ids: Sequence[int]) -> StepOutput:
        """Apply the eviction rule, then process ``token_ids`` as one step; returns the step's
        output (hidden states of the new tokens)."""
        q = len(token_ids)
        if q == 0:
            raise ValueError("a step needs at least one token")
        n = len(self.cache)
        if self.should_evict(n, q):
            self.cache.keep(self.choose_keep(self.budget - 1))
            n = len(self.cache)
        pos = torch.arange(self.next_position, self.next_position + q)
        if self.positions == "cache":
            out = forward_step(
                self.model, token_ids, self.cache, pos,
                query_rope_positions=torch.arange(n, n + q),
                key_rope_positions=torch.arange(n + q),
                output_attentions=self.needs_attentions,
            )
        else:
            out = forward_step(self.model, token_ids, self.cache, pos, output_attentions=self.needs_attentions,
                               head_transform=self.head_transform)
        self.next_position += q
        self.tokens_seen += q
        self.last_kept = n + q
        self.on_step(out, q)
        return out

    # -- generation ----------------------------------------------------------------------------
    def _prompt_chunks(self, prompt_ids: Sequence[int]) -> list[list[int]]:
        if self.prefill == "full":
            return [list(prompt_ids)]
        c = self.prefill_chunk
        return [list(prompt_ids[i : i + c]) for i in range(0, len(prompt_ids), c)]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, prompt_logprobs: bool = True) -> ReferenceOutput:
        """Prefill ``prompt_ids`` and generate ``max_new_tokens`` greedy tokens (EOS ignored).

        Greedy ties (exactly equal logits) go to the lowest token id (``torch.argmax``)."""
        return generate_together([(self, prompt_ids)], max_new_tokens, prompt_logprobs=prompt_logprobs)[0]

    def generate_each(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[ReferenceOutput]:
        """:meth:`generate` of each prompt at this reference's settings, side by side (one copy of
        the reference per prompt: this object's own state is left as it was)."""
        return generate_together([(copy.copy(self), prompt) for prompt in prompts], max_new_tokens,
                                 prompt_logprobs=False)

    @torch.inference_mode()
    def _generation(self, prompt_ids: Sequence[int], max_new_tokens: int,
                    prompt_logprobs: bool) -> Generator[torch.Tensor, torch.Tensor, ReferenceOutput]:
        """:meth:`generate`'s steps: yields each step's last hidden state (``[1, hidden]``) and is
        sent its fp32 logits (``[vocab]``) back, so a driver may project several generations'
        states at once (:func:`generate_together`); returns the output."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        self.reset()
        result = ReferenceOutput(prompt_logprobs=[None] if prompt_logprobs else None)
        start = 0
        for chunk in self._prompt_chunks(prompt_ids):
            out = self.step(chunk)
            if prompt_logprobs:
                # row i of the chunk predicts prompt token start + i + 1
                targets = prompt_ids[start + 1 : start + len(chunk) + 1]
                for r0 in range(0, len(targets), _LOGITS_ROW_BLOCK):
                    r1 = min(len(targets), r0 + _LOGITS_ROW_BLOCK)
                    lp = torch.log_softmax(compute_logits(self.model, out.hidden[r0:r1]), dim=-1)
                    tgt = torch.tensor(targets[r0:r1], device=lp.device)
                    result.prompt_logprobs.extend(lp.gather(1, tgt[:, None])[:, 0].tolist())
            start += len(chunk)
        if max_new_tokens == 0:
            return result

        logits = yield out.hidden[-1:]
        for t in range(max_new_tokens):
            top = torch.topk(logits, 2)
            token = int(torch.argmax(logits))
            result.token_ids.append(token)
            result.logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            result.margins.append(float(top.values[0] - top.values[1]))
            if t == max_new_tokens - 1:
                break
            out = self.step([token])
            result.kept_sizes.append(self.last_kept)
            logits = yield out.hidden[-1:]
        return result


@torch.inference_mode()
def generate_together(runs: Sequence[tuple[BudgetedReference, Sequence[int]]], max_new_tokens: int, *,
                      prompt_logprobs: bool = False) -> list[ReferenceOutput]:
    """Each ``(reference, prompt)``'s :meth:`BudgetedReference.generate`, the generations advanced
    one token at a time side by side, each on its own reference object and cache; only the
    projection to the vocabulary is shared, one product for the runs on the same model. (On a
    small model it is most of a decode step: reading the vocabulary's weights costs as much for
    one row as for a dozen.) A run's logits may differ from the one-row product's in the last
    bits, so its greedy token could differ only where two logits tie to within those bits."""
    if len({id(reference) for reference, _ in runs}) < len(runs):
        raise ValueError("one reference object per run (generate_each copies one for each prompt)")
    generations = [reference._generation(prompt, max_new_tokens, prompt_logprobs) for reference, prompt in runs]
    outputs: list[ReferenceOutput | None] = [None] * len(runs)
    waiting: dict[int, torch.Tensor] = {}  # run -> its last hidden state, waiting for its logits

    def advance(index: int, logits: torch.Tensor | None) -> None:
        try:
            waiting[index] = next(generations[index]) if logits is None else generations[index].send(logits)
        except StopIteration as finished:
            waiting.pop(index, None)
            outputs[index] = finished.value

    for index in range(len(runs)):
        advance(index, None)
    while waiting:
        by_model: dict[int, list[int]] = {}
        for index in waiting:
            by_model.setdefault(id(runs[index][0].model), []).append(index)
        for indices in by_model.values():
            logits = compute_logits(runs[indices[0]][0].model, torch.cat([waiting[index] for index in indices]))
            for row, index in enumerate(indices):
                advance(index, logits[row])
    return outputs


class PromptKeepReference(BudgetedReference):
    """A policy that compresses the prompt only (``gvote``; ``snapkv`` with a per-layer or
    per-head allocation): one full step over the prompt, after which :meth:`choose_prompt`
    gives each layer's kept prompt tokens per KV head (bool ``[kv_heads, P]``); every later
    token is kept.  A query of KV head h attends to h's kept prompt tokens and to every token
    after the prompt (the cache stays whole and the rest is hidden, which equals compacting it
    per head).  ``last_kept`` after a decode step: the mean over layers and heads of the keys
    its query attends to."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, budget=None, positions="original", prefill="full")

    def reset(self) -> None:
        super().reset()
        self.prompt_keep: list[torch.Tensor] | None = None  # per layer, bool [Hkv, P]
        self.num_prompt = 0

    def choose_prompt(self, out: StepOutput, capture: dict) -> list[torch.Tensor]:
        """Each layer's kept prompt tokens, bool ``[kv_heads, P]``, from the prompt's step
        (``out``; ``capture``: :func:`.model.forward_step`'s)."""
        raise NotImplementedError

    @torch.inference_mode()
    def step(self, token_ids: Sequence[int]) -> StepOutput:
        q = len(token_ids)
        if q == 0:
            raise ValueError("a step needs at least one token")
        n = len(self.cache)
        pos = torch.arange(self.next_position, self.next_position + q)
        if n == 0:
            capture: dict = {}
            out = forward_step(self.model, token_ids, self.cache, pos, capture=capture,
                               output_attentions=self.needs_attentions)
            self.num_prompt = q
            self.prompt_keep = self.choose_prompt(out, capture)
            self.last_kept = q
        else:
            after_prompt = n + q - self.num_prompt
            masks = [torch.cat([keep, torch.ones(keep.shape[0], after_prompt, dtype=torch.bool, device=keep.device)],
                               dim=1) for keep in self.prompt_keep]
            out = forward_step(self.model, token_ids, self.cache, pos, key_keep=masks)
            self.last_kept = float(torch.stack([keep.sum(dim=1) for keep in self.prompt_keep]).float().mean()) \
                + after_prompt
        self.next_position += q
        self.tokens_seen += q
        return out


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
