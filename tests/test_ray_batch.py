"""Ray, for real: `python -m vllm_kvprune.batch` (Ray Data, one vLLM engine with a KV policy per
Ray actor) through its example, on a local Ray cluster the job starts on this machine with two
actors, one core each; and its command line (help names Ray, a bad flag exits 2 naming it).

The policy reaches each actor's engine through vLLM's `additional_config` and the plugin loads
there from its entry point: the example's rows carry the policy's KV statistics, which only the
plugin's scheduler writes, and the two actors answer the same prompt with the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install vllm-kvprune[ray])")

ROOT = Path(__file__).resolve().parents[1]


def _batch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_kvprune.batch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_names_ray() -> None:
    result = _batch("--help")
    assert result.returncode == 0, result.stderr
    assert "Ray" in result.stdout and "--actors" in result.stdout and "--kv-policy" in result.stdout


def test_bad_flags_exit_2_naming_the_flag(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    common = ["--model", "m", "--input", str(prompts), "--output", str(tmp_path / "out")]
    result = _batch(*common, "--kv-policy", "bogus")
    assert result.returncode == 2
    assert "--kv-policy" in result.stderr and "bogus" in result.stderr
    result = _batch(*common, "--kv-policy", "streaming", "--kv-budget", "lots")
    assert result.returncode == 2 and "--kv-budget" in result.stderr
    result = _batch("--model", "m", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o"))
    assert result.returncode == 2 and "--input" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_example_two_actors_on_a_local_ray_cluster(tiny_model: str, tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    result = subprocess.run([sys.executable, "examples/ray_batch.py", "--model", tiny_model, "--workdir",
                             str(tmp_path), "--actors", "2"], capture_output=True, text=True, timeout=900,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = [json.loads(line) for path in sorted((tmp_path / "out").glob("*.json")) for line in path.read_text().splitlines()]
    inputs = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == sorted(row["id"] for row in inputs)
    assert len({row["actor"] for row in rows}) == 2, "both actors took rows"
    by_id = {row["id"]: row for row in rows}
    for row in rows:
        assert row["num_generated_tokens"] == 40 and row["kv_policy"] == "streaming"
        total = row["num_prompt_tokens"] + 39  # tokens cached at the end
        assert row["kv_blocks_without_policy"] == -(-total // 32)
        # streaming at budget 96: the request never holds more than its cap of 3 blocks
        # (+1 while the next token's block is being filled).
        assert row["kv_blocks_held"] <= min(row["kv_blocks_without_policy"], 4)
        assert row["kv_kept_tokens_max"] == min(total, 96)
        twin = by_id[row["id"].split("-")[0] + "-" + str(1 - int(row["id"].split("-")[1]))]
        assert twin["generated_token_ids"] == row["generated_token_ids"]
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["rows"] == len(inputs) and summary["generated_tokens"] == 40 * len(inputs)
    assert "rows by 2 actors" in result.stdout


def test_parquet_and_jsonl_inputs_read_with_ray_data(tmp_path: Path) -> None:
    import pyarrow
    import pyarrow.parquet

    from vllm_kvprune import batch

    pyarrow.parquet.write_table(pyarrow.table({"prompt": ["a", "b", "c"]}), tmp_path / "prompts.parquet")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [3]}\n')
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        parquet = batch.read(str(tmp_path / "prompts.parquet"))
        assert parquet.columns() == ["prompt"] and parquet.count() == 3
        jsonl = batch.read(str(tmp_path / "prompts.jsonl"))
        assert sorted(len(row["prompt_token_ids"]) for row in jsonl.take_all()) == [1, 2]
    finally:
        ray.shutdown()
