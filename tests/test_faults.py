"""Fault containment in the worker's planning, without an engine: a request whose policy fails
is quarantined into its own first slots, the other rows are planned exactly as without the
failure, and the step report names the request and the policy (engines: test_server.py and
test_offline_errors.py)."""

import numpy as np
import pytest

from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.worker import faults
from vllm_kvprune.worker.layouts.tokens import TokenPlanner
from vllm_kvprune.worker.state import StepRows, WorkerKVState

BLOCK = 32
CONFIG = {"name": "streaming", "budget": 64, "sinks": 4}


def _worker() -> WorkerKVState:
    worker = WorkerKVState(KVPolicyConfig.from_dict(CONFIG))
    worker.bind_cache(["layer.0"], num_blocks=64, block_size=BLOCK, total_kv_heads=1)
    return worker


def _step(worker: WorkerKVState, computed: list[int], new: list[int], prompt: list[int]):
    """Plan one step of requests a, b, c (each owns 4 blocks of its own)."""
    query_start = np.concatenate([[0], np.cumsum(new)])
    worker.rows = StepRows(req_ids=["a", "b", "c"], num_computed=np.array(computed), num_prompt=np.array(prompt),
                           block_rows=np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]),
                           extra_args=[None, None, None])
    try:
        return worker.plan(query_start, BLOCK)
    finally:
        worker.rows = None


def _run(monkeypatch, fault: str | None):
    """Prompts of 100 tokens, then 20 decode steps; returns every step's plan."""
    if fault is not None:
        monkeypatch.setenv(faults.FAULT_ENV, fault)
    worker = _worker()
    plans = [_step(worker, [0, 0, 0], [100, 100, 100], [100, 100, 100])]
    for step in range(20):
        plans.append(_step(worker, [100 + step] * 3, [1, 1, 1], [100, 100, 100]))
    return worker, plans


def _row_slots(plan, row: int, new: list[int]) -> list[int]:
    start = sum(new[:row])
    return plan.slot_mapping[start:start + new[row]].tolist()


def test_a_failed_plan_quarantines_the_request_in_its_own_slots(monkeypatch):
    _, clean = _run(monkeypatch, None)
    worker, failing = _run(monkeypatch, "plan:^b$")
    for plan, reference in zip(failing, clean):
        new = [100] * 3 if len(plan.slot_mapping) == 300 else [1] * 3
        for row in (0, 2):  # the others: exactly as without the failure
            assert _row_slots(plan, row, new) == _row_slots(reference, row, new)
            assert int(plan.seq_lens[row]) == int(reference.seq_lens[row])
        own_first_slots = set(range(5 * BLOCK, 5 * BLOCK + new[1]))
        assert set(_row_slots(plan, 1, new)) <= own_first_slots
        assert int(plan.seq_lens[1]) == new[1]
    report = worker.step_report(with_metrics=True)
    assert list(report["failed"]) == ["b"]
    assert report["failed"]["b"].startswith("kvprune streaming: plan failed: InjectedFault")
    assert "b" not in report["kept"] and set(report["kept"]) == {"a", "c"}
    worker.drop("b")
    assert worker.step_report()["failed"] == {}


def test_a_row_that_fails_half_way_leaves_no_trace(monkeypatch):
    """The planner's lists are rolled back to before the failing row."""
    worker = _worker()
    _step(worker, [0, 0, 0], [100, 100, 100], [100, 100, 100])
    original = TokenPlanner._plan_sinks

    def fail_for_b(self, row, kept_before_new):  # after the row's slots were appended
        if row.state.request_id == "b" and row.num_computed > 0:
            raise ValueError("broken map")
        return original(self, row, kept_before_new)

    monkeypatch.setattr(TokenPlanner, "_plan_sinks", fail_for_b)
    plan = _step(worker, [100] * 3, [1, 1, 1], [100] * 3)
    assert len(plan.slot_mapping) == 3 and len(plan.seq_lens) == 3
    assert plan.slot_mapping[1] == 5 * BLOCK and int(plan.seq_lens[1]) == 1
    assert worker.requests["b"].failure == "kvprune streaming: plan failed: ValueError: broken map"


def test_the_fault_variable_is_checked(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "vote:x")
    with pytest.raises(ValueError, match="PHASE:REGEX"):
        faults.inject("plan", "x")
