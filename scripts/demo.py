"""The main job: batch-generate with the real model (SmolLM2-135M-Instruct) under a KV policy
and under `none`, and print the KV memory each used.

    .venv/bin/python scripts/demo.py [--policy streaming] [--budget 256] [--requests 8] [--tokens 512]

Memory is read from vLLM's own block pool after every engine step (peak blocks held x
bytes per block), so it is what the engine really reserved, not a theoretical ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `tools` (the assets)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read the scheduler in-process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

BLOCK_SIZE = 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="streaming")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512, help="tokens generated per request")
    return parser.parse_args()


def essay_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    from tools import assets

    words = assets.essays_text().split()
    prompts = []
    for i in range(count):
        text = " ".join(words[i * 700:(i + 1) * 700])
        ids = tokenizer(text)["input_ids"][:length - 12]
        prompts.append(ids + tokenizer(" In short, the essay argues that")["input_ids"])
    return prompts


def run(model: str, policy: dict | None, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    config = {"kv_policy": policy} if policy else {}
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=8192,
              max_num_seqs=len(prompts), kv_cache_memory_bytes=1 << 30, additional_config=config)
    core = llm.llm_engine
    scheduler = core.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    spec = scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    page_bytes = spec.page_size_bytes * len(scheduler.kv_cache_config.kv_cache_groups[0].layer_names)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), {"prompt_token_ids": prompt}, params)
    peak_blocks, texts, start = 0, {}, time.perf_counter()
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                texts[output.request_id] = output.outputs[0].text
        peak_blocks = max(peak_blocks, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
    seconds = time.perf_counter() - start
    core.engine_core.shutdown()
    return {"peak_blocks": peak_blocks, "peak_bytes": peak_blocks * page_bytes, "seconds": seconds,
            "tokens_per_s": len(prompts) * max_tokens / seconds, "sample": texts["0"]}


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from tools import assets
    from vllm_kvprune.config import KVPolicyConfig

    policy = KVPolicyConfig.from_dict({"name": args.policy, "budget": args.budget, "sinks": args.sinks})
    model = str(assets.real_model_dir())
    prompts = essay_prompts(AutoTokenizer.from_pretrained(model), args.requests, args.prompt_tokens)
    print(f"\n{args.requests} requests x ({args.prompt_tokens} prompt + {args.tokens} generated) tokens, "
          f"SmolLM2-135M-Instruct, bf16, block size {BLOCK_SIZE}")
    results = {"none": run(model, None, prompts, args.tokens),
               args.policy: run(model, policy.to_dict(), prompts, args.tokens)}
    none = results["none"]
    print(f"\n{'policy':<12}{'peak KV blocks':>16}{'peak KV MiB':>14}{'vs none':>10}{'tokens/s':>11}")
    for name, result in results.items():
        print(f"{name:<12}{result['peak_blocks']:>16}{result['peak_bytes'] / 2**20:>14.1f}"
              f"{result['peak_bytes'] / none['peak_bytes']:>10.2f}{result['tokens_per_s']:>11.1f}")
    saved = 1 - results[args.policy]["peak_bytes"] / none["peak_bytes"]
    print(f"\n{args.policy} (budget {args.budget}) used {saved:.0%} less KV memory than none.")
    print(f"\nRequest 0 under {args.policy}:\n  ...{results[args.policy]['sample'][-300:]!r}")
    print(f"Request 0 under none:\n  ...{none['sample'][-300:]!r}\n")


if __name__ == "__main__":
    main()
