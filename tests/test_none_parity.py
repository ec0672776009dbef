"""`none` (and no policy at all) leaves vLLM untouched: identical greedy tokens and logprobs
to stock vLLM with the plugin excluded through VLLM_PLUGINS, on the real model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("none_parity_run.py")


def run(model: str, modes: str, plugins: str | None, out: Path) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    subprocess.run([sys.executable, str(RUNNER), model, modes, str(out)], check=True, env=env,
                   capture_output=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_none_is_identical_to_stock_vllm(real_model, tmp_path):
    stock = run(real_model, "absent", "", tmp_path / "stock.json")["absent"]  # no plugin loaded at all
    # With the plugin: no policy, then `none` (one process: the plugin loads once either way).
    with_plugin = run(real_model, "absent,none", None, tmp_path / "plugin.json")
    absent, none = with_plugin["absent"], with_plugin["none"]
    assert not stock["plugin_worker_loaded"]
    assert absent["plugin_worker_loaded"], "the plugin should be installed and loaded here"
    assert stock["results"] == absent["results"]
    assert stock["results"] == none["results"]
    assert all(len(r["token_ids"]) == 64 for r in stock["results"])
