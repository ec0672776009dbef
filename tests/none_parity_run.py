"""Helper for test_none_parity: greedy tokens and logprobs of the real model as JSON.

    python none_parity_run.py MODEL {absent|none} OUT.json
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

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, mode, out = sys.argv[1:4]
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
    loaded = [name for name in sys.modules if name.startswith("vllm_kvprune.worker")]
    with open(out, "w") as handle:
        json.dump({"results": results, "plugin_worker_loaded": bool(loaded)}, handle)
