"""FDC (fast KV dimensionality compression): narrower KV heads.

:mod:`.calibration` is the offline stage (rotations and per-head ranks, a safetensors file);
:mod:`.cli` is `vllm-kvprune calibrate fdc`. The plain-PyTorch reference is
:mod:`vllm_kvprune.reference.fdc`.
"""
