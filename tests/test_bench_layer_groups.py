"""`bench layer-groups` on the tiny model, as a user runs it: vLLM forms one KV-cache group per
layer from our per-layer spec, the groups share one pool (a block is one layer's page, so the
pool counts `layers` times the blocks), and the greedy tokens equal the single table's; `gvote`
with a group per layer keeps the tokens it has with one table and holds no more blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import common


def test_one_group_per_layer_shares_the_pool_and_keeps_the_tokens(tmp_path):
    from transformers import AutoConfig

    from tools import assets

    out = tmp_path / "layer_groups.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "layer-groups", "--tiny", "--enforce-eager", "--repeats",
                           "1", "--batch", "4", "--prompt-tokens", "64", "--tokens", "4", "--pool-gib", "0.25",
                           "--modes", "per_layer", "gvote_per_layer", "--out", str(out)], env=common.child_env({**os.environ, **common.ENGINE_ENV}),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["results"]}
    layers = AutoConfig.from_pretrained(assets.tiny_model_dir()).num_hidden_layers
    assert rows["single"]["groups"] == 1 and rows["per_layer"]["groups"] == layers
    single, per_layer = rows["single"]["pool_blocks"], rows["per_layer"]["pool_blocks"]
    assert layers * single <= per_layer < layers * (single + 1)
    assert rows["per_layer"]["tokens_equal_baseline"]
    assert rows["gvote_one_table"]["groups"] == 1 and rows["gvote_per_layer"]["groups"] == layers
    assert rows["gvote_per_layer"]["tokens_equal_baseline"] and rows["gvote_per_layer"]["baseline"] == "gvote_one_table"
    assert 0 < rows["gvote_per_layer"]["request_blocks"] <= rows["gvote_one_table"]["request_blocks"]
    assert out.with_suffix(".png").is_file()
