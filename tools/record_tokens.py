"""Record every policy's greedy tokens on fixed prompts, to show a refactor changes nothing.

    python -m tools.record_tokens --out results/refactor/tokens_before.json     # before a change
    python -m tools.record_tokens --out /tmp/after.json --compare results/refactor/tokens_before.json

Each case is one engine (fp32, eager, block size 32) on one model: the real model (SmolLM2),
the tiny Llama, and tiny random models of other architectures (`model_zoo`), under every
policy the model serves, with prompts shorter and longer than the budget, per-request
overrides beside the engine's settings, and generations long enough to evict in decode.
`--compare` exits 1 naming the first case and request whose tokens differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import numpy as np

BLOCK_SIZE = 32
TINY_POLICIES = {
    "none": None,
    "streaming": {"name": "streaming", "budget": 64, "sinks": 4},
    "streaming-cache-R8-chunked": {"name": "streaming", "budget": 64, "sinks": 4, "positions": "cache",
                                   "prune_interval": 8, "prefill": "streaming", "prefill_chunk": 48},
    "h2o": {"name": "h2o", "budget": 96, "sinks": 2},
    "h2o-R8-recent16": {"name": "h2o", "budget": 96, "sinks": 2, "prune_interval": 8, "recent": 16},
    "paged_eviction": {"name": "paged_eviction", "budget": 128, "sinks": 4},
    "paged_eviction-R2": {"name": "paged_eviction", "budget": 128, "sinks": 4, "prune_interval": 2},
    "gvote": {"name": "gvote", "gvote_p": 0.6, "gvote_samples": 4},
}
REAL_POLICIES = {
    "none": None,
    "streaming": {"name": "streaming", "budget": 128, "sinks": 4},
    "h2o": {"name": "h2o", "budget": 128, "sinks": 4},
    "paged_eviction": {"name": "paged_eviction", "budget": 128, "sinks": 4},
    "gvote": {"name": "gvote"},
}
ZOO_POLICIES = {k: TINY_POLICIES[k] for k in ("none", "streaming", "h2o", "paged_eviction", "gvote")}
ZOO = ("qwen3", "gemma2", "gemma3")
# Per-request overrides that each policy accepts (None: the engine's settings).
OVERRIDES = {
    "streaming": [None, {"kv_budget": 96}],
    "h2o": [None, {"kv_budget": 64, "kv_recent": 8}],
    "paged_eviction": [None, {"kv_budget": 160}],
    "gvote": [None, {"kv_gvote_p": 0.8}],
}
PROMPT_LENGTHS = (20, 150, 300)
NUM_TOKENS = 200


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 30000, size=n).tolist() for n in lengths]


def fdc_files(tiny_model: str, folder: Path) -> str:
    from vllm_kvprune.fdc import calibration

    path = folder / "fdc_tiny.json"
    if not path.exists():
        calibration.calibrate(tiny_model, tokens=256, seq_len=128, seed=0, rate=0.1).save(path)
    return str(path)


def cases(folder: Path):
    from tools import assets
    from tools.model_zoo import ZOO as ZOO_MODELS, zoo_model_dir

    tiny = str(assets.tiny_model_dir())
    fdc = fdc_files(tiny, folder)
    tiny_policies = dict(TINY_POLICIES)
    tiny_policies["fdc"] = {"name": "fdc", "fdc": fdc}
    tiny_policies["streaming+fdc"] = {"name": "streaming", "budget": 64, "sinks": 4, "fdc": fdc}
    tiny_policies["paged_eviction+fdc"] = {"name": "paged_eviction", "budget": 128, "sinks": 4, "fdc": fdc}
    for label, policy in tiny_policies.items():
        yield "tiny", tiny, label, policy, {}
    for architecture in ZOO:
        for label, policy in ZOO_POLICIES.items():
            yield architecture, str(zoo_model_dir(architecture)), label, policy, dict(ZOO_MODELS[architecture].engine_args)
    real = str(assets.real_model_dir())
    for label, policy in REAL_POLICIES.items():
        yield "real", real, label, policy, {}


def page_bytes(model: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * BLOCK_SIZE * kv_heads * head_dim * 4 * config.num_hidden_layers


def run_case(model: str, policy: dict | None, engine_args: dict) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    options = dict(dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=4096,
                   max_num_seqs=32, enable_prefix_caching=False, kv_cache_memory_bytes=512 * page_bytes(model))
    options.update(engine_args)
    if policy is not None:
        options["additional_config"] = {"kv_policy": policy}
    llm = LLM(model=model, **options)
    try:
        prompt_ids = prompts(PROMPT_LENGTHS)
        overrides = OVERRIDES.get(policy["name"], [None]) if policy is not None and "fdc" not in policy else [None]
        requests, params = [], []
        for override in overrides:
            for prompt in prompt_ids:
                requests.append({"prompt_token_ids": prompt})
                params.append(SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                             extra_args=override))
        outputs = llm.generate(requests, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def compare(recorded: dict, expected: dict) -> int:
    problems = 0
    for key, tokens in expected.items():
        if key not in recorded:
            print(f"missing: {key}")
            problems += 1
            continue
        if isinstance(tokens, str) or isinstance(recorded[key], str):
            if not (isinstance(tokens, str) and isinstance(recorded[key], str)):  # a refusal either way
                print(f"DIFFERENT: {key}: {str(recorded[key])[:200]!r} where {str(tokens)[:200]!r} was recorded")
                problems += 1
            continue
        for index, (got, want) in enumerate(zip(recorded[key], tokens)):
            if got != want:
                step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else -1
                print(f"DIFFERENT: {key} request {index}: first different token at step {step}")
                problems += 1
    print(f"{len(expected)} cases compared, {problems} differences")
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None, help="a recorded JSON to compare against")
    parser.add_argument("--only", default=None, help="substring of the case keys to run")
    args = parser.parse_args(argv)
    folder = Path(args.out).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    recorded = {}
    for model_label, model, label, policy, engine_args in cases(Path("/tmp")):
        key = f"{model_label}/{label}"
        if args.only and args.only not in key:
            continue
        started = time.perf_counter()
        try:
            recorded[key] = run_case(model, policy, engine_args)
        except Exception as error:  # a refusal is recorded as such
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
            recorded[key] = f"refused: {type(error).__name__}: {str(error).splitlines()[-1][:300]}"
        print(f"{key}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps(recorded, indent=0))
    if args.compare:
        expected = json.loads(Path(args.compare).read_text())
        if args.only:
            expected = {k: v for k, v in expected.items() if args.only in k}
        return compare(recorded, expected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
