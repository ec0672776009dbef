"""Imported first by the Triton kernel tests: they run on CUDA where there is a GPU, else in
Triton's interpreter on CPU. They use no conftest fixture and never import vLLM, so on a GPU
machine without vLLM they run as `pytest -m triton --noconftest tests/`.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated (at import, also its own library
functions such as ``tl.zeros``, decorated when ``triton.language`` is first imported) and again
at its first launch. So conftest imports this module before anything imports Triton (vLLM
does); it takes the variable away again after collection and sets it around each
``triton``-marked test only, so the engines other tests start never see it."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET_SET_HERE = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
if INTERPRET_SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"
if DEVICE == "cpu":
    # Triton's own library functions (`tl.max`, `tl.sum`, ...) are decorated when
    # `triton.language` is first imported: now, under the interpreter, whichever test imports
    # Triton first. Else a test that imports vLLM (which imports Triton) before the first
    # Triton test would leave them compiled-mode functions, which an interpreted kernel cannot
    # call ("Cannot call @triton.jit'd outside of the scope of a kernel").
    import triton.language  # noqa: E402,F401

if os.environ.get("KVPRUNE_RECORD_TRITON") or os.environ.get("KVPRUNE_TRITON_TARGET"):
    # The compile check (tools/triton_targets.py) records the launches, chosen as on its target.
    from tools.triton_targets import install_from_environment

    install_from_environment()
