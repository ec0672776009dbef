"""`bench plan-steps`: the host's planning timed without a model, here and at a git revision
in a worktree it removes again (its timings mean little on a busy test machine)."""

import argparse
import json
import subprocess

from benchmarks import plan_steps


def _worktrees() -> list[str]:
    return subprocess.run(["git", "worktree", "list"], capture_output=True, text=True, check=True).stdout.splitlines()


def test_every_policy_is_timed_here_and_at_the_revision(tmp_path):
    before = _worktrees()
    parser = argparse.ArgumentParser()
    plan_steps.add_arguments(parser)
    args = parser.parse_args(["--steps", "6", "--rounds", "1", "--against", "HEAD", "--out", str(tmp_path / "plan.json")])
    assert plan_steps.run(args) == 0
    document = json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "plan.png").stat().st_size > 0
    rows = {(row["tree"], row["policy"]): row for row in document["results"]}
    assert set(rows) == {(tree, policy) for tree in ("this tree", "HEAD") for policy in plan_steps.POLICIES}
    for (tree, _), row in rows.items():
        assert row["steps"] == 6 and 0 < row["p10_ms"] <= row["median_ms"]
        assert (row["vs_against"] == 1.0 and row["vs_against_p10"] == 1.0) == (tree == "HEAD")
    assert _worktrees() == before


def test_the_planned_requests_hold_their_budget():
    from benchmarks.gpu_steps import FULL
    from vllm_kvprune import vllm_hooks

    all_reduce = vllm_hooks.tp_all_reduce
    for policy in plan_steps.POLICIES:
        timings, kept = plan_steps.measure(policy, 4, kept=True)
        # Within a block of the budget (paged_eviction evicts whole blocks), every request alike.
        assert len(timings) == 4 and len(set(kept)) == 1, policy
        assert FULL.budget - FULL.block_size < kept[0] <= FULL.budget, (policy, kept[0])
    assert vllm_hooks.tp_all_reduce is all_reduce  # put back: other tests in this process use it
