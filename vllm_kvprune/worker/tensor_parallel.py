"""What tensor-parallel ranks must agree on.

vLLM splits a layer's KV heads over the ranks (rank r holds heads ``[r * H / N, (r + 1) * H /
N)``, each rank one head replicated when ``H < N``); every rank plans the same requests from the
same scheduler output, over the same block-table rows. So:

- **layer-uniform and block policies** (``streaming``, ``paged_eviction``) must choose the same
  tokens on every rank: positions alone decide ``streaming``; ``paged_eviction`` adds its block
  scores over the ranks' heads (``state._sum_over_ranks``) before choosing;
- **per-head policies** (``h2o``, ``gvote``) decide each head on the rank that holds it, as one
  process would: nothing to agree on, except what the scheduler reads;
- **what the scheduler reads** comes from the first rank's output only, so the step report is
  merged here first: a head-page request needs as many blocks as its widest rank lays out
  (each rank packs its own heads' kept tokens into the same blocks), a request failed on any
  rank fails, kept tokens average over the ranks' heads;
- **fdc** narrows each rank's own heads with their own rotations; a layer's pages are as wide
  as that layer's widest rank's, so every rank sizes the same pool.
"""

from __future__ import annotations

from vllm_kvprune import vllm_hooks


def kv_head_range(total_kv_heads: int, rank: int, world_size: int) -> range:
    """The global KV heads rank ``rank`` of ``world_size`` holds (vLLM's split)."""
    if total_kv_heads >= world_size:
        if total_kv_heads % world_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over {world_size} tensor-parallel ranks")
        per_rank = total_kv_heads // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if world_size % total_kv_heads:
        raise ValueError(f"{total_kv_heads} KV heads cannot be replicated over {world_size} tensor-parallel ranks")
    head = rank // (world_size // total_kv_heads)
    return range(head, head + 1)


def merged_report(report: dict) -> dict:
    """This step's report as the scheduler must read it: every rank's, merged (see the module
    docstring). At one rank, ``report`` itself. A collective: every rank calls it each step."""
    reports = vllm_hooks.tp_all_gather_object(report)
    if len(reports) == 1:
        return report
    merged = dict(report)
    merged["failed"] = {request_id: why for each in reports for request_id, why in (each.get("failed") or {}).items()}
    if "kept" in report:
        merged["kept"] = {request_id: (sum(each["kept"][request_id][0] for each in reports) / len(reports),
                                       max(each["kept"][request_id][1] for each in reports))
                          for request_id in report["kept"] if all(request_id in each.get("kept", {}) for each in reports)}
    merged["seconds"] = {phase: max(each["seconds"][phase] for each in reports) for phase in report["seconds"]}
    if "footprints" in report:
        merged["footprints"] = {}
        for each in reports:
            for request_id, blocks in each.get("footprints", {}).items():  # per group: the most any rank needs
                found = merged["footprints"].get(request_id, blocks)
                merged["footprints"][request_id] = [max(a, b) for a, b in zip(blocks, found)]
    return merged
