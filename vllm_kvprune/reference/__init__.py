"""Plain PyTorch reference implementations (oracles) of the KV policies, on a Hugging Face model
with a contiguous per-layer cache.  See DESIGN.md section 7.

* :mod:`.model`: shared plumbing (contiguous cache, manual forward, generation driver).
* :mod:`.streaming`: StreamingLLM (``python -m vllm_kvprune.reference.streaming --help``).
"""

from .model import (
    BudgetedReference,
    ContiguousKVCache,
    ReferenceOutput,
    StepOutput,
    compute_logits,
    forward_step,
    load_reference_model,
    lowest_scores_first,
)

__all__ = [
    "BudgetedReference",
    "ContiguousKVCache",
    "ReferenceOutput",
    "StepOutput",
    "StreamingLLMReference",
    "compute_logits",
    "forward_step",
    "load_reference_model",
    "lowest_scores_first",
]


def __getattr__(name: str):
    # Imported lazily so that `python -m vllm_kvprune.reference.streaming` runs cleanly.
    if name == "StreamingLLMReference":
        from .streaming import StreamingLLMReference

        return StreamingLLMReference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
