"""What GVote needs from the model, per layer: the query projection's input over the prompt
(statistics gathered by a hook while the prompt runs) and the projection and RoPE that turn
synthetic hidden states into queries. The vote itself is `GVotePolicy`'s."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_kvprune import vllm_hooks
from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.policies.gvote import GVotePolicy


@dataclass
class LayerVoter:
    """One attention layer's query path, for synthetic queries: `project(h [S, hidden])`
    gives pre-RoPE queries `[S, Hq, D]` through the model's own projection (vLLM's CPU
    build repacks the weights, so the layer is called, not its weight read), bias and q norm
    included."""

    layer_index: int
    owner: Any  # the attention module (qkv_proj, rotary_emb, q_norm)
    num_q_heads: int
    head_size: int
    scale: float
    paged_layers: Any  # its `gathering` flag keeps the statistics hook off our own call

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        width = self.num_q_heads * self.head_size
        self.paged_layers.gathering = False
        try:
            projected = self.owner.qkv_proj(hidden.to(self.paged_layers.dtype))
        finally:
            self.paged_layers.gathering = True
        if isinstance(projected, tuple):  # vLLM's linear layers return (output, bias)
            projected = projected[0]
        query = projected[:, :width].float().reshape(-1, self.num_q_heads, self.head_size)
        q_norm = getattr(self.owner, "q_norm", None)
        if q_norm is not None:
            query = q_norm(query.to(q_norm.weight.dtype)).float()
        return query

    def rotate_future(self, query: torch.Tensor, first_position: int, count: int) -> torch.Tensor:
        """RoPE at the average cos/sin of positions `first_position .. + count - 1`, in the
        layer's own style (NeoX or GPT-J, partial rotary)."""
        return vllm_hooks.rope_at_average(self.owner.rotary_emb, query, first_position, count)

    def vote(self, config: KVPolicyConfig, policy: GVotePolicy, last_query: torch.Tensor, keys: torch.Tensor,
             hidden_sum: torch.Tensor, hidden_sumsq: torch.Tensor, count: int) -> np.ndarray:
        """The layer's keep mask `[H, P]`: `last_query [Hq, D]` post-RoPE, `keys [H, P, D]`."""
        mean = hidden_sum / count
        variance = (hidden_sumsq - count * mean * mean) / max(count - 1, 1)
        std = variance.clamp(min=0).sqrt()
        generator = policy.layer_generator(config.gvote_seed, self.layer_index)
        hidden = policy.synthetic_hidden(mean, std, config.gvote_samples, generator)
        synthetic = self.rotate_future(self.project(hidden), keys.shape[1], config.gvote_future)
        budgets = policy.step_budgets(last_query, keys, self.scale, config.gvote_p)
        return policy.keep_mask(synthetic, keys, budgets, self.scale).cpu().numpy()


def gather_hidden(worker, layer_index: int, layer_name: str, hidden: torch.Tensor) -> None:
    """Pre-hook body on a layer's query projection: add this step's prompt tokens to each
    request's statistics (`HiddenRows` of the step's plan), in the head-page map the vote
    reads them from; `worker` is the runner's `WorkerKVState`."""
    paged_layers = worker.tables
    if not paged_layers.gathering:
        return
    metadata = vllm_hooks.layer_metadata(layer_name)
    plan = getattr(metadata, "kvprune_plan", None)
    if plan is None or not plan.hidden_rows:
        return
    started = time.perf_counter()
    for rows in plan.hidden_rows:
        pages = rows.state.map
        if pages.hidden_sum is None:
            shape = (paged_layers.num_layers, hidden.shape[-1])
            # Sums beside the hidden states (a GPU's), the count on the host (read by the vote).
            pages.hidden_sum = torch.zeros(shape, dtype=torch.float64, device=hidden.device)
            pages.hidden_sumsq = torch.zeros(shape, dtype=torch.float64, device=hidden.device)
            pages.hidden_count = torch.zeros(paged_layers.num_layers, dtype=torch.int64)
        part_sum, part_sumsq = _sums(hidden[rows.start: rows.stop])
        pages.hidden_sum[layer_index] += part_sum
        pages.hidden_sumsq[layer_index] += part_sumsq
        pages.hidden_count[layer_index] += rows.stop - rows.start
    worker.score_seconds += time.perf_counter() - started  # part of the vote's cost


def _sums(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum and sum of squares of `part [N, hidden]`, accumulated in float64. A
    16-bit float squared is exact in float32 (8 or 11 significant bits, doubled, fit in 24),
    so half-precision rows are squared in float32, about 5x faster than in float64 and with the
    same result; float32 rows are squared in float64."""
    if part.dtype in (torch.bfloat16, torch.float16):
        wide = part.float()
    else:
        wide = part.double()
    return wide.sum(dim=0, dtype=torch.float64), (wide * wide).sum(dim=0, dtype=torch.float64)
