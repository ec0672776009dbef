"""`python -m benchmarks layer-groups`: what one KV-cache group per layer costs on stock vLLM,
against the one group that serves every layer (issue 42's per-layer allocation).

A request holds one block table for all layers today, so its memory is its largest layer's
need. vLLM's hybrid-model machinery can give every layer its own group instead: a spec per
layer that refuses to merge with another layer's makes `get_kv_cache_groups` form one group
per layer; the groups alias one tensor, so each layer's blocks come from one shared pool (a
block is then one layer's page, and the pool counts `layers` times as many), and each group
has its own block table, manager and attention metadata. This bench measures that machinery
alone, with nothing pruned (vLLM's own full-attention manager in both modes): the greedy
tokens of the two modes (they must be equal), the decode step at `--batch` requests (median of
the timed steps, the modes taking turns `--repeats` times in child processes), the
scheduler's time per step (admission and allocation over the groups), and start-up time.

Two more modes measure the same with our planners: `gvote` as it runs (a group per layer,
`gvote_per_layer`) against `gvote` kept to one table for every layer (`KVPRUNE_ONE_TABLE=1`,
`gvote_one_table`), the same votes and tokens, and what each holds (blocks of the whole
model per request after the timed steps, read from vLLM's pool).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

# mode -> (policy, the mode whose step and tokens it is compared with)
MODES = {"single": (None, "single"), "per_layer": (None, "single"),
         "gvote_one_table": ("gvote", "gvote_one_table"), "gvote_per_layer": ("gvote", "gvote_one_table")}
BLOCK_SIZE = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batch", type=int, default=32, help="requests decoding together")
    add("--prompt-tokens", type=int, default=512, help="essay tokens per request")
    add("--tokens", type=int, default=64, help="timed decode steps")
    add("--repeats", type=int, default=3, help="rounds, the modes taking turns in each")
    add("--pool-gib", type=float, default=1.0)
    add("--dtype", default="float32", choices=("bfloat16", "float32"))
    add("--enforce-eager", action="store_true", help="skip vLLM's compilation (compiled by default)")
    add("--tiny", action="store_true", help="the tiny random model (a smoke run)")
    add("--modes", nargs="+", default=list(MODES), choices=list(MODES),
        help="single / per_layer: nothing pruned, vLLM's manager; gvote_one_table / gvote_per_layer: gvote "
             "with one table for every layer, and as it runs (a group per layer)")
    add("--out", type=Path, default=Path("results/layer_groups.json"))
    add("--child", default=None, choices=list(MODES), help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.child is not None:
        common.print_child_result(measure(args, args.child))
        return 0
    started = time.time()
    needed = set(args.modes) | {MODES[mode][1] for mode in args.modes}  # with their baselines
    modes = [mode for mode in MODES if mode in needed]
    rounds = common.child_rounds("layer-groups", modes, child_flags(args), args.repeats,
                                 switches=lambda mode: {"KVPRUNE_ONE_TABLE": "1"} if mode == "gvote_one_table" else {})
    # Every round's greedy tokens, against the baseline's first round's.
    tokens = {mode: [entry.pop("token_ids") for entry in found] for mode, found in rounds.items()}
    rows = []
    for mode, found in rounds.items():  # the round with the median decode step, every round's kept
        middle, rounds_ms = common.median_round(found, "median_step_ms")
        rows.append({"mode": mode, "policy": MODES[mode][0] or "none", "baseline": MODES[mode][1], **middle,
                     "rounds_ms": rounds_ms})
    by_mode = {row["mode"]: row for row in rows}
    for row in rows:
        baseline = row["baseline"]
        row["step_vs_baseline"] = row["median_step_ms"] / by_mode[baseline]["median_step_ms"]
        row["tokens_equal_baseline"] = all(found == tokens[baseline][0] for found in tokens[row["mode"]])
    common.print_table(*table(rows))
    settings = {key: getattr(args, key) for key in ("batch", "prompt_tokens", "tokens", "repeats", "pool_gib", "dtype",
                                                    "enforce_eager")}
    settings.update(model="tiny" if args.tiny else "smollm2-135m-instruct", block_size=BLOCK_SIZE,
                    run_s=round(time.time() - started, 1))
    common.write_json(args.out, "layer-groups", settings, rows)
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    if not all(row["tokens_equal_baseline"] for row in rows):
        print("layer-groups: the per-layer groups changed the greedy tokens", file=sys.stderr)
        return 1
    return 0


def child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--batch", str(args.batch), "--prompt-tokens", str(args.prompt_tokens), "--tokens", str(args.tokens),
             "--pool-gib", str(args.pool_gib), "--dtype", args.dtype]
    return flags + ["--tiny"] * args.tiny + ["--enforce-eager"] * args.enforce_eager


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["mode", "policy", "groups", "pool blocks", "decode step (ms)", "rounds (ms)", "vs baseline",
               "schedule / step (ms)", "blocks / request", "start-up (s)", "tokens = baseline"]
    # Runs before the gvote modes compared with `single` only (`step_vs_single`, `tokens_equal_single`).
    def vs(row: dict[str, Any], what: str) -> Any:
        return row.get(f"{what}_baseline", row.get(f"{what}_single"))

    return headers, [[row["mode"], row.get("policy", "none"), str(row["groups"]), str(row["pool_blocks"]),
                      f"{row['median_step_ms']:.1f}", " / ".join(f"{ms:.1f}" for ms in row["rounds_ms"]),
                      f"{vs(row, 'step_vs'):.3f}x ({row.get('baseline', 'single')})", f"{row['schedule_ms_per_step']:.2f}",
                      f"{row['request_blocks']:.1f}" if row.get("request_blocks") is not None else "-",
                      f"{row['start_s']:.1f}", "yes" if vs(row, "tokens_equal") else "NO"] for row in rows]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axes = common.new_figure(4.5, 3.2)
    names = [f"{row['mode']}\n({row['groups']} groups)" for row in rows]
    axes.bar(names, [row["median_step_ms"] for row in rows], color="tab:blue")
    for index, row in enumerate(rows):
        axes.plot([index] * len(row["rounds_ms"]), row["rounds_ms"], "k.", markersize=4)
    axes.set_ylabel("decode step (ms)")
    axes.set_title("one KV-cache group per layer (dots: rounds)")
    common.save_figure(figure, path)


# ---- a child: one engine -------------------------------------------------------------
def install_layer_specs() -> None:
    """Every full-attention layer's spec made its own (a `layer` field; merging two layers'
    raises), in this process's CPU model runner, before the engine is built."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from vllm_kvprune.engine.spec import OwnGroupPerLayer

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class LayerSpec(OwnGroupPerLayer, FullAttentionSpec):
        layer: int = 0

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(LayerSpec, FullAttentionManager, uniform_type_base_spec=LayerSpec)
    model_specs = CPUModelRunner.get_kv_cache_spec

    def layer_specs(runner: Any) -> dict:
        specs = {}
        for index, (name, spec) in enumerate(model_specs(runner).items()):
            fields = {field.name: getattr(spec, field.name) for field in dataclasses.fields(spec)}
            specs[name] = LayerSpec(**fields, layer=index) if type(spec) is FullAttentionSpec else spec
        return specs

    CPUModelRunner.get_kv_cache_spec = layer_specs


def measure(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from benchmarks.decode_steps import time_decode_steps
    from benchmarks.ttft import essay_tokens
    from tools import assets

    from vllm_kvprune.engine.scheduler import held_model_blocks

    if mode == "per_layer":
        install_layer_specs()
    policy = MODES[mode][0]
    model = str(assets.tiny_model_dir() if args.tiny else assets.real_model_dir())
    tokens = essay_tokens(model, args.tiny, args.prompt_tokens * args.batch)
    prompts = [tokens[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.batch)]
    context = args.prompt_tokens + args.tokens + 64 * args.batch
    began = time.perf_counter()
    llm = LLM(model=model, dtype=args.dtype, block_size=BLOCK_SIZE, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False, seed=0, max_model_len=context, max_num_seqs=args.batch,
              kv_cache_memory_bytes=int(args.pool_gib * 2**30),
              **({"additional_config": {"kv_policy": {"name": policy}}} if policy else {}))
    start_s = time.perf_counter() - began
    scheduler = common.engine_scheduler(llm)
    schedule, spent, held = scheduler.schedule, [0.0, 0], []

    def timed_schedule(*positional: Any, **named: Any) -> Any:
        began = time.perf_counter()
        try:
            return schedule(*positional, **named)
        finally:
            spent[0] += time.perf_counter() - began
            spent[1] += 1

    try:
        outputs = llm.generate([{"prompt_token_ids": list(prompt)} for prompt in prompts],
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        scheduler.schedule = timed_schedule
        found = time_decode_steps(llm, prompts, args.tokens, name=mode, before_abort=lambda ids: held.extend(
            held_model_blocks(scheduler, request_id) for request_id in ids))
        config = scheduler.kv_cache_config
        found.update(groups=len(config.kv_cache_groups), pool_blocks=config.num_blocks, start_s=start_s,
                     request_blocks=sum(held) / len(held) if held else None,
                     schedule_ms_per_step=1000 * spent[0] / max(spent[1], 1),
                     token_ids=[list(output.outputs[0].token_ids) for output in outputs])
        return found
    finally:
        common.shutdown(llm)


def section(path: Path, doc_dir: Path) -> str:
    """The results page's section of a run."""
    from benchmarks import results_sections as sections

    document = sections.load(path)
    settings = document.get("settings", {})
    setup = (f"{settings.get('model')} {settings.get('dtype')}, {'eager' if settings.get('enforce_eager') else 'compiled'}"
             f"; `single` / `per_layer`: nothing pruned (vLLM's own full-attention manager); `gvote_one_table` / "
             "`gvote_per_layer`: gvote (eager, as it runs) with one block table for every layer "
             "(`KVPRUNE_ONE_TABLE=1`) and as it runs, with a group per layer; `blocks / request`: blocks of the "
             f"whole model each request holds after the timed steps; {settings.get('batch')} requests of "
             f"{settings.get('prompt_tokens')} essay tokens decoding together, {settings.get('tokens')} timed steps; "
             f"each mode in an engine of its own, the modes taking turns {settings.get('repeats')} times (the median "
             "round shown, every round listed). `per_layer`: one KV-cache group per layer over one shared pool "
             "(the machinery of issue 42's per-layer allocation); `schedule / step`: vLLM's scheduler per step, "
             "admission and allocation over the groups.")
    return sections.file_section(f"One KV-cache group per layer (`{path.name}`)", document, setup,
                                 sections.markdown_table(*table(document.get("results", []))), [], path, doc_dir)
