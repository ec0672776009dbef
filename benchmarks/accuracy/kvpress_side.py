"""kvpress's side: the presses that match our policies, on the same model, prompts and budgets.

kvpress prunes a prompt's cache once, after its prefill, and then decodes without evicting.
A budget B of ours keeps B - 1 prompt tokens after the prefill (the next query is the B-th),
so kvpress is asked to keep exactly B - 1 of a P-token prompt. Budgets that keep the whole
prompt are kvpress's full-cache run, reused rather than run again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks.accuracy.report import KVPRESS
from benchmarks.accuracy.task import Answer, Case, Task
from benchmarks.accuracy.variants import VARIANTS
from benchmarks.kvpress_runner import run_kvpress



def compression_ratio(prompt_tokens: int, kept: int) -> float:
    """The ratio for which kvpress keeps exactly `kept` tokens: it keeps int(P * (1 - ratio)),
    so aim half a token above `kept` to stay clear of float rounding."""
    return 1.0 - (kept + 0.5) / prompt_tokens


def press_ratio(spec: dict[str, Any], prompt_tokens: int, kept: int) -> float:
    """The ratio at which `spec`'s press keeps `kept` tokens of the prompt per layer and KV head
    on average, window included. Most keep `int(P (1 - ratio))`; PyramidKVPress keeps `P (1 -
    ratio)` per layer on average, each layer's count rounded (`round`, half to even; its
    `get_layer_budget`), so it is aimed a quarter token above, not half."""
    if spec["name"] == "PyramidKVPress":
        return 1.0 - (kept + 0.25) / prompt_tokens
    return compression_ratio(prompt_tokens, kept)


def full_attention_layers(model: str) -> set[int]:
    """The layers of `model` (a Hugging Face folder) with full attention: all of them unless its
    config names each layer's kind (`layer_types`, as hybrid models such as Gemma-3 do)."""
    config = json.loads((Path(model) / "config.json").read_text())
    kinds = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return {layer for layer, kind in enumerate(kinds) if kind == "full_attention"}


def prunes(case: Case, budget: int) -> bool:
    """Whether keeping budget - 1 tokens drops any of the case's prompt."""
    return budget - 1 < len(case.prompt_ids)


def matched_runs(cases: Sequence[Case], budgets: Sequence[int] | None) -> list[tuple[Case, int | None]]:
    """(case, budget) pairs kvpress runs: every case under the full cache (`budgets` None), else
    the budgets that prune the prompt (the others are the full-cache run again)."""
    if budgets is None:
        return [(case, None) for case in cases]
    return [(case, b) for b in budgets for case in cases if prunes(case, b)]


def press_specs(policies: Sequence[str], sinks: int) -> dict[str, dict[str, Any]]:
    """Our policy -> the kvpress press that keeps tokens by the same (or the nearest) rule, with
    its settings matching ours at `sinks` (each policy's `kvpress` trait and `kvpress_settings`).
    An ablation of ours that runs kvpress beside it (`ours.VARIANTS`) gets its policy's press at
    its settings, labelled with them (`label`: the method its records carry)."""
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.policies import REGISTRY

    specs = {}
    for name in policies:
        variant = VARIANTS.get(name)
        if variant is not None and not variant.kvpress:
            continue
        policy = REGISTRY.get(variant.policy if variant else name)
        if policy is None or policy.kvpress is None:
            continue  # a policy kvpress has nothing for
        settings = {"name": policy.name, "budget": 1024} if policy.budgeted else {"name": policy.name}
        if policy.reads("sinks"):
            settings["sinks"] = sinks
        press = press_of(KVPolicyConfig.from_dict(settings))
        if variant is not None:
            own = {**variant.engine, **{key.removeprefix("kv_"): value for key, value in variant.settings.items()}}
            default, press = press, press_of(KVPolicyConfig.from_dict({**settings, **own}))
            changed = ", ".join(f"{key}={value}" for key, value in press.items()
                                if default.get(key) != value and key not in ("name", "press"))
            press["label"] = f"{press['name']}({changed})" if changed else press["name"]
        specs[name] = press
    return specs


def press_of(config: Any) -> dict[str, Any]:
    """The press spec of a config: its policy's `kvpress` trait and `kvpress_settings` (which may
    name another press where a setting selects one: `allocation`)."""
    policy = config.policy
    return {"name": policy.kvpress, **policy.kvpress_settings(config)}


def run_press(model: str, spec: dict[str, Any], work: Sequence[tuple[Task, list[Case]]],
              tokenizer: Any, threads: int, full_cache: dict[tuple[str, str], Answer],
              timeout: float, dtype: str = "bfloat16") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Records and timings of one press (`spec`: its name and settings; `none`: full cache) on
    the tasks kvpress can run. `full_cache` maps (task, case id) to kvpress's full-cache answer;
    `none` fills it."""
    press = spec.get("label", spec["name"])
    constructor = {key: value for key, value in spec.items() if key != "label"}
    records, timings = [], []
    full = full_attention_layers(model)
    for task, cases in work:
        runs = matched_runs(cases, None if press == "none" else task.budgets)
        job = {"model": model, "prompts": [case.prompt_ids for case, _ in runs], "max_new_tokens": max(
            (case.max_tokens for case, _ in runs), default=1), "dtype": dtype, "threads": threads,
            "stop_at_eos": True, "press": constructor,
            "compression_ratios": [None if b is None else press_ratio(constructor, len(c.prompt_ids), b - 1)
                                   for c, b in runs]}
        print(f"[{KVPRESS} {press}] {task.name}: {len(runs)} runs", flush=True)
        started = time.perf_counter()
        result = run_kvpress(job, timeout) if runs else {"results": []}
        seconds = sum(r["seconds"] for r in result["results"])
        timings.append({"system": KVPRESS, "method": press, "task": task.name, "seconds": seconds, "runs": len(runs),
                        "wall_seconds": time.perf_counter() - started, "versions": result.get("versions"),
                        "cases": "kvpress"})
        for (case, budget), generated in zip(runs, result["results"]):
            # The budget binds the full-attention layers; a hybrid model's sliding layers hold at
            # most their window, whatever the press keeps of it.
            attended = [n for layer, n in enumerate(generated.get("kv_attended_per_layer")
                                                    or generated["kv_kept_per_layer"]) if layer in full]
            kept = sum(attended) / len(attended)  # per full-attention layer and KV head, on average
            if budget is not None and (abs(kept - (budget - 1)) > 1 if constructor["name"] == "PyramidKVPress"
                                       else min(attended) != max(attended) or kept != budget - 1):
                raise RuntimeError(f"kvpress {press} kept {attended} tokens per layer, not {budget - 1}")
            ids = generated["token_ids"][:case.max_tokens]
            answer = Answer(ids, tokenizer.decode(ids, skip_special_tokens=True))
            if press == "none":
                full_cache[(task.name, case.case_id)] = answer
            stored = generated["kv_kept_per_layer"]
            stored_full = [n for layer, n in enumerate(stored) if layer in full]
            # kv_kept: what the next query attends to; kv_stored: what the cache holds (a masking
            # press holds the whole prompt), both per layer and KV head on average; kv_stored_full:
            # the same over the full-attention layers (all of them but a hybrid model's sliding ones).
            records.append({**task.record(case, KVPRESS, press, budget, answer), "kv_kept": kept,
                            "kv_stored": sum(stored) / len(stored),
                            "kv_stored_full": sum(stored_full) / len(stored_full)})
        if press != "none":
            records += whole_prompt_records(task, cases, press, full_cache)
    return records, timings


def whole_prompt_records(task: Task, cases: Sequence[Case], press: str,
                         full_cache: dict[tuple[str, str], Answer]) -> list[dict[str, Any]]:
    """A press's records at the budgets that keep the whole prompt, which kvpress does not run:
    the full-cache answer of each case (`full_cache`, filled by `none`)."""
    return [task.record(case, KVPRESS, press, budget, full_cache[(task.name, case.case_id)])
            for budget in task.budgets for case in cases
            if not prunes(case, budget) and (task.name, case.case_id) in full_cache]
