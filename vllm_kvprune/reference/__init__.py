"""Plain PyTorch reference implementations (oracles) of the KV policies, on a Hugging Face model
with a contiguous per-layer cache.  See DESIGN.md section 7.

* :mod:`.model`: shared plumbing (contiguous cache, manual forward).
* :mod:`.budgeted`: the generation driver (step rule, position modes, prefill modes).
* :mod:`.streaming`: StreamingLLM (``python -m vllm_kvprune.reference.streaming --help``).
* :mod:`.paged_eviction`: PagedEviction (token pruning at prefill, block eviction at decode).
* :mod:`.h2o`: H2O (heavy hitters by attention mass, per KV head, with eager attention).
* :mod:`.gvote`: GVote (per-head keep sets voted by synthetic Gaussian queries, no budget).
* :mod:`.fdc`: FDC (post-RoPE rotations, attention in each head's reduced dimensions).
"""

from .budgeted import BudgetedReference, ReferenceOutput, lowest_scores_first
from .model import ContiguousKVCache, StepOutput, compute_logits, forward_step, load_reference_model

__all__ = [
    "BudgetedReference",
    "ContiguousKVCache",
    "FdcReference",
    "GVoteReference",
    "H2OReference",
    "PagedEvictionReference",
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
    if name == "H2OReference":
        from .h2o import H2OReference

        return H2OReference
    if name == "GVoteReference":
        from .gvote import GVoteReference

        return GVoteReference
    if name == "FdcReference":
        from .fdc import FdcReference

        return FdcReference
    if name == "PagedEvictionReference":
        from .paged_eviction import PagedEvictionReference

        return PagedEvictionReference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
