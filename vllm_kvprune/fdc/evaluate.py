"""How much FDC costs in accuracy, on the plain-PyTorch reference: perplexity of essay text
through the compressed cache against `none`, over removal rates, with the paper's "without
adaptive rates" ablation (every head at the mean ranks) at each rate's compression and, if
asked, the pre-RoPE ablation (keys cut before RoPE at the same ranks, `fdc/pre_rope.py`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from vllm_kvprune.fdc.calibration import FdcCalibration
from vllm_kvprune.fdc.pre_rope import PreRopeKeys, PreRopeTransform


def perplexity(model: torch.nn.Module, token_ids: Sequence[int], calibration: FdcCalibration | None = None,
               pre_rope: PreRopeKeys | None = None) -> float:
    """Perplexity of ``token_ids`` (one sequence, fp32) with the full cache, under FDC, or with
    FDC's ranks cut before RoPE (``pre_rope``)."""
    from vllm_kvprune.reference.fdc import FdcReference
    from vllm_kvprune.reference.budgeted import BudgetedReference

    if calibration is None:
        reference = BudgetedReference(model, budget=None)
    elif pre_rope is not None:
        device = next(model.parameters()).device
        reference = BudgetedReference(model, budget=None, head_transform=PreRopeTransform(calibration, pre_rope, device))
    else:
        reference = FdcReference(model, calibration)
    logprobs = reference.generate(list(token_ids), 0, prompt_logprobs=True).prompt_logprobs[1:]
    return math.exp(-sum(logprobs) / len(logprobs))


@dataclasses.dataclass
class SweepPoint:
    rate: float
    kv_fraction: float  # cached elements per token over the full cache's
    perplexity: float
    uniform_perplexity: float  # every head at this rate's mean ranks (same compression, rounded)
    uniform_kv_fraction: float
    pre_rope_perplexity: float | None = None  # the adaptive ranks, keys cut before RoPE (same KV kept)


def sweep(model: torch.nn.Module, calibration: FdcCalibration, token_ids: Sequence[int],
          rates: Sequence[float], pre_rope: PreRopeKeys | None = None) -> tuple[float, list[SweepPoint]]:
    """`none`'s perplexity and, per removal rate, FDC's with adaptive and with uniform ranks,
    and with the adaptive ranks cut before RoPE if ``pre_rope`` is given."""
    points = []
    for rate in rates:
        adaptive = calibration.with_rate(rate)
        uniform = calibration.with_uniform_ranks_like(adaptive)
        before_rope = None if pre_rope is None else perplexity(model, token_ids, adaptive, pre_rope)
        points.append(SweepPoint(rate, adaptive.kv_fraction(), perplexity(model, token_ids, adaptive),
                                 perplexity(model, token_ids, uniform), uniform.kv_fraction(), before_rope))
    return perplexity(model, token_ids), points


# Removal rates tried in order when a target picks the rate (FDC §5.2 chooses r offline against
# an accuracy constraint and leaves the search open): a log-spaced ladder, then bisection between
# the last rate that met the target and the first that did not.
RATE_LADDER = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
BISECTION_STEPS = 4


@dataclasses.dataclass
class TargetSearch:
    target: float  # most perplexity allowed, as a multiple of `none`'s
    none: float
    tried: list[tuple[float, float, float]]  # (rate, perplexity, KV kept) in the order tried
    rate: float | None  # the largest rate tried that met the target (None: not even the smallest)
    num_tokens: int  # perplexity text length


def rate_for_target(model: torch.nn.Module, calibration: FdcCalibration, token_ids: Sequence[int],
                    target: float) -> TargetSearch:
    """The largest removal rate whose perplexity on ``token_ids`` is at most ``target`` x the
    uncompressed cache's. Assumes perplexity grows with the rate (it does, up to noise, on every
    model measured): the ladder stops at its first miss, then the gap is bisected."""
    none = perplexity(model, token_ids)
    tried: list[tuple[float, float, float]] = []

    def meets(rate: float) -> bool:
        compressed = calibration.with_rate(rate)
        value = perplexity(model, token_ids, compressed)
        tried.append((rate, value, compressed.kv_fraction()))
        return value <= target * none

    best, missed = None, None
    for rate in RATE_LADDER:
        if not meets(rate):
            missed = rate
            break
        best = rate
    if missed is not None:
        low = best if best is not None else 0.0
        for _ in range(BISECTION_STEPS):
            middle = round((low + missed) / 2, 6)
            if meets(middle):
                low = best = middle
            else:
                missed = middle
    return TargetSearch(target, none, tried, best, len(token_ids))
