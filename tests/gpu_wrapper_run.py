"""Helper for test_gpu_wrapper: vLLM engines on this CPU running a GPU wrapper (TRITON_ATTN:
vLLM's Triton kernels and ours, in Triton's interpreter; FLASH_ATTN: vLLM's FlashAttention
builder and impl over torch references of FA's ops, ours interpreted), one after another in
this process (support/gpu_on_cpu.py installs the wrapper before the first engine); greedy
tokens and logprobs as JSON, and which attention impl the layers ran.

    TRITON_INTERPRET=1 KVPRUNE_TRITON_ON_CPU=1 python gpu_wrapper_run.py CASES.json OUT.json
    TRITON_INTERPRET=1 KVPRUNE_TRITON_ON_CPU=FLASH_ATTN python gpu_wrapper_run.py CASES.json OUT.json

CASES: a list of {"model", "policy", "requests": [{"prompt": token ids, "extra_args": {...}}],
"max_tokens", "block_size", "kv_blocks"} and optionally "split_keys_decode": false (vLLM's 2D
kernel for every decode batch). OUT: a list of {"results", "impls", "hnd",
"fdc_keys_by_token", "seconds"} or
{"error"} (the start-up refusal of a case).
"""

import gc
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("KVPRUNE_CHECK", "1")


def without_split_keys_decode(runner) -> None:
    """vLLM's TRITON_ATTN decodes a batch of few sequences with its split-keys (3D) kernel: 16
    programs for each (sequence, KV head) where its 2D kernel runs one, and the interpreter pays
    for each program. A threshold of 0 sends every batch to the 2D kernel, which reads the same
    block tables and lengths (the metadata is ours either way)."""
    from vllm_kvprune import vllm_hooks

    for group in range(len(runner.attn_groups)):
        for builder in vllm_hooks.metadata_builders(runner, group):
            if hasattr(builder, "seq_threshold_3D"):  # TRITON_ATTN's builder; FLASH_ATTN has none
                builder.seq_threshold_3D = 0


def run_case(case: dict) -> dict:
    from conftest import engine, runner_of
    from vllm import SamplingParams

    from vllm_kvprune import vllm_hooks

    started = time.perf_counter()
    requests = case["requests"]
    params = [SamplingParams(temperature=0, max_tokens=case["max_tokens"], ignore_eos=True, logprobs=0,
                             extra_args=request.get("extra_args")) for request in requests]
    try:
        # Few batched tokens: vLLM's start-up profiling runs a batch that large through the
        # (interpreted) kernels.
        with engine(case["model"], case["policy"], kv_blocks=case["kv_blocks"], block_size=case["block_size"],
                    max_num_seqs=8, max_num_batched_tokens=256) as llm:
            runner = runner_of(llm)
            if not case.get("split_keys_decode", True):
                without_split_keys_decode(runner)
            outputs = llm.generate([{"prompt_token_ids": request["prompt"]} for request in requests], params,
                                   use_tqdm=False)
            layers = vllm_hooks.attention_layers(runner.vllm_config).values()
            impls = sorted({type(layer.impl).__name__ for layer in layers})
            # Whether each layer's cache has a block's heads outermost (HND: head-pages are a view).
            caches = [cache for cache in runner.kv_caches if cache.numel()]
            hnd = all(cache.stride(1) == cache.shape[2] * cache.stride(2) for cache in caches)
            fdc = runner.kv_state.fdc
            keys_by_token = fdc.layers[0].heads.keys_by_token if fdc is not None else None
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        gc.collect()
    results = []
    for output in outputs:
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        results.append({"token_ids": token_ids,
                        "logprobs": [completion.logprobs[i][t].logprob for i, t in enumerate(token_ids)]})
    return {"results": results, "impls": impls, "hnd": hnd, "fdc_keys_by_token": keys_by_token,
            "seconds": time.perf_counter() - started}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    from support import gpu_on_cpu

    if gpu_on_cpu.install_from_environment() is None:
        raise SystemExit(f"set {gpu_on_cpu.VARIABLE} (1 or FLASH_ATTN): the GPU wrapper to run on this CPU")
    cases = json.loads(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as handle:
        json.dump([run_case(case) for case in cases], handle)
