"""How much FDC costs in accuracy, on the plain-PyTorch reference: perplexity of essay text
through the compressed cache against `none`, over removal rates, with the paper's "without
adaptive rates" ablation (every head at the mean ranks) at each rate's compression."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from vllm_kvprune.fdc.calibration import FdcCalibration


def perplexity(model: torch.nn.Module, token_ids: Sequence[int], calibration: FdcCalibration | None = None) -> float:
    """Perplexity of ``token_ids`` (one sequence, fp32) with the full cache or under FDC."""
    from vllm_kvprune.reference.fdc import FdcReference
    from vllm_kvprune.reference.model import BudgetedReference

    reference = BudgetedReference(model, budget=None) if calibration is None else FdcReference(model, calibration)
    logprobs = reference.generate(list(token_ids), 0, prompt_logprobs=True).prompt_logprobs[1:]
    return math.exp(-sum(logprobs) / len(logprobs))


@dataclasses.dataclass
class SweepPoint:
    rate: float
    kv_fraction: float  # cached elements per token over the full cache's
    perplexity: float
    uniform_perplexity: float  # every head at this rate's mean ranks (same compression, rounded)
    uniform_kv_fraction: float


def sweep(model: torch.nn.Module, calibration: FdcCalibration, token_ids: Sequence[int],
          rates: Sequence[float]) -> tuple[float, list[SweepPoint]]:
    """`none`'s perplexity and, per removal rate, FDC's with adaptive and with uniform ranks."""
    points = []
    for rate in rates:
        adaptive = calibration.with_rate(rate)
        uniform = calibration.with_uniform_ranks(round(float(adaptive.qk_rank.double().mean())),
                                                 round(float(adaptive.v_rank.double().mean())))
        points.append(SweepPoint(rate, adaptive.kv_fraction(), perplexity(model, token_ids, adaptive),
                                 perplexity(model, token_ids, uniform), uniform.kv_fraction()))
    return perplexity(model, token_ids), points
