"""The cache layouts a policy's requests are planned in, one module each (`base.py` says what
a layout is). A policy's `layout` trait names its planner here; the `full` layout (FDC alone:
every token kept, vLLM's own block tables) has no planner: its steps run `base.StepPlan`,
vLLM's own step through FDC's narrow cache."""

from __future__ import annotations

from vllm_kvprune.worker.layouts.base import LayerCall, PlanningError, PrefillCompaction, Row, RowPlanner, StepPlan
from vllm_kvprune.worker.layouts.blocks import BlockPlan, BlockPlanner
from vllm_kvprune.worker.layouts.head_pages import HeadPagePlan, HeadPagePlanner
from vllm_kvprune.worker.layouts.heads import HeadPlan, HeadPlanner
from vllm_kvprune.worker.layouts.tokens import TokenPlan, TokenPlanner

PLANNERS: dict[str, type[RowPlanner]] = {
    "tokens": TokenPlanner,
    "heads": HeadPlanner,
    "blocks": BlockPlanner,
    "head_pages": HeadPagePlanner,
}

__all__ = ["PLANNERS", "BlockPlan", "HeadPagePlan", "HeadPlan", "LayerCall", "PlanningError", "PrefillCompaction",
           "Row", "RowPlanner", "StepPlan", "TokenPlan"]
