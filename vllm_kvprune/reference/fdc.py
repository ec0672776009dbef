"""FDC in plain PyTorch on the Hugging Face model: attention in each head's reduced dimensions.

Per layer and KV head ``h`` with rotation ``R_h`` (``[d, d]``) and ranks ``k_h`` (Q/K) and
``k_v,h`` (V), from :mod:`vllm_kvprune.fdc.calibration`:
- post-RoPE keys are cached as ``k R_h[:, :k_h]`` and every query of ``h``'s GQA group is
  projected the same way, so scores are ``(q R_h[:, :k_h]) (k R_h[:, :k_h])ᵀ`` with the model's
  own scale;
- values are cached as ``v R_v,h[:, :k_v,h]``; the attention output of a query head is turned
  back by ``R_v,h[:, :k_v,h]ᵀ`` before ``o_proj``.

The reference keeps the head size and zeroes the dropped dimensions instead of cutting them:
a zero dimension adds nothing to a dot product or a weighted sum, so the result is the reduced
attention's, and every head fits one tensor whatever its rank. With every rank at the head size
the rotations cancel (``R Rᵀ = I``) and FDC is `none` up to fp32 rounding. On a hybrid model
the calibration holds its full-attention layers only (`FdcCalibration.layers`); the
sliding-window layers pass through whole, as they are served.

``FdcReference`` is a :class:`BudgetedReference`, so FDC alone is ``budget=None`` and FDC under
an eviction policy is that policy's reference given the same transform (``positions`` must be
``"original"``: keys are projected after RoPE and can never be rotated again).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_kvprune.fdc.calibration import FdcCalibration, load
from vllm_kvprune.reference.model import HeadTransform
from vllm_kvprune.reference.budgeted import BudgetedReference


class FdcTransform(HeadTransform):
    """The rotations and rank masks of one calibration, on the model's device."""

    def __init__(self, calibration: FdcCalibration, device: torch.device | str = "cpu") -> None:
        dims = torch.arange(calibration.head_dim)
        self.qk_rotation = calibration.qk_rotation.to(device=device, dtype=torch.float32)
        self.v_rotation = calibration.v_rotation.to(device=device, dtype=torch.float32)
        # [L, H, d]: 1 for a kept dimension, 0 for a dropped one.
        self.qk_mask = (dims < calibration.qk_rank[..., None]).to(device=device, dtype=torch.float32)
        self.v_mask = (dims < calibration.v_rank[..., None]).to(device=device, dtype=torch.float32)
        # Model layer -> row; a layer without one (a hybrid model's sliding-window layer) stays whole.
        self.rows = calibration.rows

    def project(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if layer not in self.rows:
            return q, k, v
        layer = self.rows[layer]
        kv_heads = k.shape[0]
        group = q.shape[0] // kv_heads
        rotation, mask = self.qk_rotation[layer], self.qk_mask[layer][:, None, :]  # [H, d, d], [H, 1, d]
        k_reduced = (k.float() @ rotation) * mask
        q_grouped = q.float().reshape(kv_heads, group * q.shape[1], -1)
        q_reduced = ((q_grouped @ rotation) * mask).reshape(q.shape)
        v_reduced = (v.float() @ self.v_rotation[layer]) * self.v_mask[layer][:, None, :]
        return q_reduced, k_reduced, v_reduced

    def restore(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        if layer not in self.rows:
            return o
        layer = self.rows[layer]
        kv_heads = self.v_rotation.shape[1]
        grouped = o.float().reshape(kv_heads, -1, o.shape[-1])
        # The dropped value dimensions are zero already; R_vᵀ maps the kept ones back.
        return (grouped @ self.v_rotation[layer].transpose(-1, -2)).reshape(o.shape)


class FdcReference(BudgetedReference):
    """FDC (no eviction): every token kept, each head at its own reduced width."""

    def __init__(self, model: nn.Module, calibration: FdcCalibration, **kwargs) -> None:
        device = next(model.parameters()).device
        super().__init__(model, budget=None, head_transform=FdcTransform(calibration, device), **kwargs)


def transform_for(model: nn.Module, config) -> FdcTransform | None:
    """FDC's head transform for a config with a calibration (`config.fdc`), None without one."""
    if config.fdc is None:
        return None
    return FdcTransform(load(config.fdc), next(model.parameters()).device)


def from_config(model: nn.Module, config, block_size: int) -> FdcReference:
    """The oracle of a served `fdc` config (`KVPolicyConfig`)."""
    return FdcReference(model, load(config.fdc))
