"""`python -m benchmarks accuracy` and `results` end to end on a small grid, checked
against what can be computed without them: real engines and kvpress in its venv, on the tiny
random Llama (`--tiny`: the real model's pipeline at a fraction of its cost; its scores mean
nothing). One budgeted policy (streaming) and the budget-free one (gvote): the others go through the same
code (h2o against kvpress: test_kvpress_agreement)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

PPL_TOKENS = 300
# The small run's cases and settings (a run that resumes it must have the same).
SMALL_GRID = ["--gvote-p", "0.95", "--gvote-samples", "8", "--budgets", "128", "--ppl-segments", "1", "--ppl-tokens",
              str(PPL_TOKENS), "--needle-contexts", "1024", "--needle-depths", "0", "100", "--needle-budgets", "256",
              "--kv-cases", "2", "--arith-cases", "2", "--kvpress-cases", "1", "--tiny",
              # float32 and eager: bf16 matmuls are emulated, and slow, on CPUs without bf16
              # instructions, and compiling each engine costs minutes there
              "--dtype", "float32", "--enforce-eager"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, kvpress_venv):
    out = tmp_path_factory.mktemp("accuracy")
    command = [sys.executable, "-m", "benchmarks", "accuracy", "--policies", "streaming", "gvote", *SMALL_GRID,
               "--out-dir", str(out)]
    finished = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=1500)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return out


def load(out: Path, task: str) -> dict:
    return json.loads((out / f"accuracy_{task}.json").read_text())


@pytest.mark.slow
def test_every_method_answers_every_case(small_run):
    for task, budgets, cases in (("needle", [256], 2), ("kv_retrieval", [128], 2), ("arithmetic", [128], 2)):
        document = load(small_run, task)
        records = [r for r in document["results"] if r["method"] != "gvote"]  # budget-free: its own test
        ours = {(r["method"], r["budget"]) for r in records if r["system"] == "vllm-kvprune"}
        assert ours == {("none", None), *(("streaming", b) for b in budgets)}
        for key in ours:
            assert sum((r["method"], r["budget"]) == key for r in records if r["system"] == "vllm-kvprune") == cases
        presses = {(r["method"], r["budget"]) for r in records if r["system"] == "kvpress"}
        assert presses == {("none", None), *(("StreamingLLMPress", b) for b in budgets)}
        for record in records:
            if record["system"] == "kvpress" and record["budget"] is not None and "kv_kept" in record:
                assert record["kv_kept"] == record["budget"] - 1
        assert document["side_by_side"]["rows"] and (small_run / f"accuracy_{task}.png").stat().st_size > 0
        assert (small_run / f"accuracy_{task}_kvpress_memory.png").stat().st_size > 0
    assert (small_run / "accuracy_needle_heatmap.png").stat().st_size > 0


@pytest.mark.slow
def test_kv_memory_is_read_from_the_block_pool(small_run):
    """Every answer's `kv_blocks` (mean blocks held while answering): exactly the cap for a
    budgeted policy whose prompt passed it, the prompt and answer's blocks under `none`, and
    for `gvote` what its kept lengths need, never more than `none` (one block of decode
    lookahead aside) and at least the per-layer mean. (How much the vote gives back is the real
    model's to show, on the results page; the blocks it holds for its kept lengths are
    test_gvote_engine's.)"""
    for task, budget in (("needle", 256), ("kv_retrieval", 128), ("arithmetic", 128)):
        cap = math.ceil((budget + 1) / 32)  # prune interval 1
        records = [r for r in load(small_run, task)["results"] if r["system"] == "vllm-kvprune"]
        none = {r["case_id"]: r for r in records if r["method"] == "none"}
        for case_id, record in none.items():
            prompt = record["prompt_tokens"]
            assert math.ceil((prompt + 1) / 32) <= record["kv_blocks"] <= math.ceil((prompt + 32) / 32), case_id
        for record in records:
            if record["method"] == "streaming":
                if record["prompt_tokens"] >= cap * 32:
                    assert record["kv_blocks"] == cap, (task, record["case_id"])
                assert record["kv_blocks"] <= cap
        voted = [r for r in records if r["method"] == "gvote"]
        assert len(voted) == len(none) and all((r["gvote_p"], r["gvote_samples"]) == (0.95, 8) for r in voted)
        for record in voted:
            full = none[record["case_id"]]["kv_blocks"]
            assert record["kv_blocks_per_layer"] <= record["kv_blocks"] <= full + 1, (task, record["case_id"])
        assert (small_run / f"accuracy_{task}_memory.png").stat().st_size > 0
    assert not any(r["method"] == "gvote" for r in load(small_run, "perplexity")["results"])
    assert (small_run / "accuracy_gvote_sweeps.png").stat().st_size > 0


@pytest.mark.slow
def test_full_cache_perplexity_matches_hugging_face(small_run):
    """The teacher-forced decode of `none` scores each token as one causal forward pass does."""
    import torch
    from transformers import AutoModelForCausalLM

    from tools import assets

    document = load(small_run, "perplexity")
    (full,) = [r for r in document["results"] if r["method"] == "none"]
    start, tokens = full["facts"]["start"], full["facts"]["tokens"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets.tiny_model_dir()))
    from benchmarks.accuracy.task import essay_token_ids

    ids = torch.tensor([essay_token_ids(tokenizer)[start:start + tokens]])
    model = AutoModelForCausalLM.from_pretrained(str(assets.tiny_model_dir()), dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    reference = -logprobs.gather(1, ids[0, 1:, None]).sum().item()
    assert full["scored_tokens"] == PPL_TOKENS - 1
    # float32 engine against a float32 forward: within 0.5% in perplexity
    assert math.exp(full["nll_sum"] / full["scored_tokens"]) == pytest.approx(math.exp(reference / (tokens - 1)),
                                                                              rel=0.005)
    pruned = [r for r in document["results"] if r["budget"] == 128]
    assert {r["method"] for r in pruned} == {"streaming"}
    assert all(r["nll_sum"] != full["nll_sum"] for r in pruned)  # evicting inside the text changed the scores


@pytest.mark.slow
def test_results_page_renders_every_table(small_run, tmp_path):
    from benchmarks import results_page

    repo_results = Path(__file__).resolve().parents[1] / "results"
    for path in repo_results.glob("*.json"):
        if not path.name.startswith("accuracy_"):
            (small_run / path.name).write_bytes(path.read_bytes())
            if path.with_suffix(".png").exists():
                (small_run / path.with_suffix(".png").name).write_bytes(path.with_suffix(".png").read_bytes())
    page_path = tmp_path / "docs" / "RESULTS.md"
    page = results_page.render(small_run, page_path)
    for task in results_page.ACCURACY_TASKS:
        table = load(small_run, task)["table"]
        assert "| " + " | ".join(table["rows"][0]) + " |" in page
    assert "## Throughput" in page and "## KV update" in page and "kvpress 0.5.5" in page
    assert page.count("A smoke run on the tiny random model") == len(results_page.ACCURACY_TASKS)
    from benchmarks.accuracy import memory
    from benchmarks.accuracy.needle import Needle

    found = memory.points(Needle(), load(small_run, "needle")["results"])
    _, (row,) = memory.equal_memory_table(Needle(), found)
    assert "| " + " | ".join(row) + " |" in page and "### gvote's sweeps over p and S" in page
    for link in [line.split("](")[1].rstrip(")") for line in page.splitlines() if line.startswith("![")]:
        assert (page_path.parent / link).resolve().is_file(), link


@pytest.mark.slow
def test_resume_runs_only_the_methods_missing(small_run, tmp_path):
    """`--resume` on a copy of the small run, with one policy more: the earlier methods' records
    are taken as they were (ours and kvpress's, marked `resumed`), the new policy and its press
    are run, a new gvote setting runs alone, a press's budget that keeps the whole prompt gets
    the taken full-cache answers, and a run whose cases differ is refused naming the setting."""
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(small_run, out)
    command = [sys.executable, "-m", "benchmarks", "accuracy", "--tasks", "kv_retrieval", "--policies", "streaming",
               "h2o", *SMALL_GRID, "--out-dir", str(out), "--resume"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    before, after = load(small_run, "kv_retrieval"), load(out, "kv_retrieval")
    assert set(after["settings"]["resumed"]) == {"vllm-kvprune:none", "vllm-kvprune:streaming", "kvpress:none",
                                                  "kvpress:StreamingLLMPress"}
    for system, method in (("vllm-kvprune", "streaming"), ("kvpress", "StreamingLLMPress")):
        was = [r for r in before["results"] if (r["system"], r["method"]) == (system, method)]
        now = [{k: v for k, v in r.items() if k != "resumed"} for r in after["results"]
               if (r["system"], r["method"]) == (system, method)]
        assert now == was
    ran = {(r["system"], r["method"]) for r in after["results"] if not r.get("resumed")}
    assert ran == {("vllm-kvprune", "h2o"), ("kvpress", "ObservedAttentionPress")}
    # A gvote setting more, on a copy of the small run (gvote at p 0.95): gvote runs the new
    # setting alone; its earlier setting's records and every other method's are reused.
    swept_out = tmp_path / "swept"
    shutil.copytree(small_run, swept_out)
    swept = [*command[:command.index("--policies") + 1], "streaming", "gvote",
             *command[command.index("h2o") + 1:command.index("--out-dir") + 1], str(swept_out), "--resume"]
    swept[swept.index("--gvote-p") + 1:swept.index("--gvote-p") + 2] = ["0.9", "0.95"]
    finished = subprocess.run(swept, env=env, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    again = load(swept_out, "kv_retrieval")
    # The sweeps' table and plot cover the folder's every task, not only the one this run ran.
    assert all(f"{name}: {metric} (held / per layer" in finished.stdout
               for name, metric in (("needle", "hit rate"), ("kv_retrieval", "accuracy"), ("arithmetic", "accuracy")))
    assert {(r["method"], r["gvote_p"]) for r in again["results"] if r["method"] == "gvote"} == {
        ("gvote", 0.9), ("gvote", 0.95)}
    assert {r["gvote_p"] for r in again["results"] if r["method"] == "gvote" and not r.get("resumed")} == {0.9}
    assert [m for m in again["settings"]["resumed"] if "gvote" in m] == ["vllm-kvprune:gvote p=0.95 S=8"]
    assert all(r.get("resumed") for r in again["results"] if r["method"] != "gvote" or r["gvote_p"] == 0.95)
    assert [r for r in again["results"] if r["method"] == "gvote" and r["gvote_p"] == 0.95] == [
        {**r, "resumed": True} for r in before["results"] if r["method"] == "gvote"]
    # A budget that keeps the whole prompt (1024 > kv_retrieval's ~780 tokens): streaming runs
    # again, kvpress never runs such a budget, so its press's records there are the taken
    # full-cache answers, as a run of the press makes them.
    wide_out = tmp_path / "wide"
    shutil.copytree(small_run, wide_out)
    wide = [sys.executable, "-m", "benchmarks", "accuracy", "--tasks", "kv_retrieval", "--policies", "streaming",
            *SMALL_GRID, "--out-dir", str(wide_out), "--resume"]
    wide[wide.index("--budgets") + 1:wide.index("--budgets") + 2] = ["128", "1024"]
    finished = subprocess.run(wide, env=env, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    widened = load(wide_out, "kv_retrieval")["results"]
    full_cache = {r["case_id"]: r["answer"] for r in before["results"]
                  if (r["system"], r["method"]) == ("kvpress", "none")}
    whole = {r["case_id"]: r["answer"] for r in widened
             if (r["system"], r["method"], r["budget"]) == ("kvpress", "StreamingLLMPress", 1024)}
    assert max(r["prompt_tokens"] for r in widened) < 1023 and whole == full_cache and full_cache
    assert {r["budget"] for r in widened if r["method"] == "streaming" and not r.get("resumed")} == {128, 1024}
    refused = subprocess.run([*command[:-1], "--seed", "1", "--resume"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "--resume" in refused.stderr and "seed" in refused.stderr
