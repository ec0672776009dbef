"""Helper for test_none_parity: greedy tokens and logprobs of the real model as JSON.

    python none_parity_run.py MODEL MODE[,MODE...] OUT.json     # MODE: absent (no kv_policy) or none

Several modes run one after another in this process (one engine at a time), written as
{mode: {...}}.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n",
]


def generate(model: str, mode: str) -> dict:
    from vllm import LLM, SamplingParams

    extra = {"additional_config": {"kv_policy": {"name": "none"}}} if mode == "none" else {}
    # float32: bf16 is emulated, and several times slower, on CPUs without AVX-512 (CI's);
    # the identity with stock vLLM does not depend on the dtype.
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, **extra)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    results = []
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        results.append({
            "token_ids": list(completion.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs],
            "prompt_logprobs": [None if step is None else {str(k): v.logprob for k, v in step.items()}
                                for step in output.prompt_logprobs],
        })
    llm.llm_engine.engine_core.shutdown()
    # Read after the first mode, it says whether the plugin's worker came in with no policy asked.
    loaded = bool([name for name in sys.modules if name.startswith("vllm_kvprune.worker")])
    return {"results": results, "plugin_worker_loaded": loaded}


if __name__ == "__main__":
    model, modes, out = sys.argv[1:4]
    found = {mode: generate(model, mode) for mode in modes.split(",")}
    with open(out, "w") as handle:
        json.dump(found, handle)
