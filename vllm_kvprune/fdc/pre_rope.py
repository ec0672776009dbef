"""The pre-RoPE ablation (Palu-style keys): the same per-head ranks as FDC, but each key cut
before RoPE instead of after.

Palu stores a low-rank latent of each key *before* RoPE and, at attention time, reconstructs
the full key and rotates it; FDC cuts the key *after* RoPE, so attention runs in the reduced
width with no reconstruction (FDC §3). What the move past RoPE costs or buys in accuracy is
what this measures, on the reference:
- per layer and KV head, a rotation ``P`` from the SVD of the head's pre-RoPE keys (their Gram
  matrix over the calibration tokens, as FDC's fit does for post-RoPE queries and keys);
- each new key is cached as its first ``k_h`` rotated dims and used as ``RoPE(k P_k P_kᵀ)``
  (``P_k`` the first ``k_h`` columns), with ``k_h`` FDC's rank of that head at the same removal
  rate, so the two cache the same number of values per token; queries stay whole;
- values exactly as FDC (its V rotation and ranks), so only where the keys are cut differs.

Our choices (Palu leaves them open for this comparison): the subspace comes from the keys the
calibration tokens produce, not from an SVD of ``W_k`` (Palu's), so both methods fit the same
data; and no query-side projection, since a pre-RoPE subspace does not survive RoPE.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from vllm_kvprune.fdc.calibration import FdcCalibration, _descending_eigh, captures
from vllm_kvprune.reference.fdc import FdcTransform


@dataclasses.dataclass(frozen=True)
class PreRopeKeys:
    """Per layer and KV head: the pre-RoPE keys' rotation ``[L, H, d, d]`` (fp32, columns in
    decreasing order of ``singular`` ``[L, H, d]``)."""

    rotation: torch.Tensor
    singular: torch.Tensor


def fit_pre_rope_keys(model: torch.nn.Module, sequences: Iterable[list[int]]) -> PreRopeKeys:
    """The pre-RoPE key rotations of a loaded Hugging Face model over ``sequences``."""
    gram: torch.Tensor | None = None
    for capture in captures(model, sequences):
        keys = torch.stack(capture["key_pre_rope"]).double()  # [L, H, n, d]
        step = keys.transpose(-1, -2) @ keys
        gram = step if gram is None else gram + step
    if gram is None:
        raise ValueError("no tokens to fit the pre-RoPE keys on")
    singular, rotation = _descending_eigh(gram)
    return PreRopeKeys(rotation.float(), singular.float())


class PreRopeTransform(FdcTransform):
    """Keys cut to FDC's ranks before RoPE (and restored to full width for it), values as FDC,
    queries whole."""

    def __init__(self, calibration: FdcCalibration, keys: PreRopeKeys, device: torch.device | str = "cpu") -> None:
        if calibration.settings.get("layers") is not None:
            raise ValueError("the pre-RoPE ablation needs a calibration of every layer (not a hybrid model's "
                             "full-attention layers)")
        super().__init__(calibration, device)
        rotation = keys.rotation.to(device=device, dtype=torch.float32)
        # [L, H, d, d]: the projector onto each head's first k_h pre-RoPE dimensions.
        self.key_projector = (rotation * self.qk_mask[:, :, None, :]) @ rotation.transpose(-1, -2)

    def project_pre_rope(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        return (k.float() @ self.key_projector[layer]).to(k.dtype)

    def project(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return q, k, (v.float() @ self.v_rotation[layer]) * self.v_mask[layer][:, None, :]
