"""Imported first by the Triton kernel tests: they run on CUDA where there is a GPU, else in
Triton's interpreter on CPU. They use no conftest fixture and never import vLLM, so on a GPU
machine without vLLM they run as `pytest -m triton --noconftest tests/`."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated and launched
