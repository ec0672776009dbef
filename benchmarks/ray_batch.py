"""`python -m benchmarks ray-batch`: the Ray batch job (`python -m vllm_kvprune.batch`)
with 1 and then 2 actors on the same prompts and policy, on a local Ray cluster: throughput
(generated tokens over the busiest actor's generating time, and over the wall time with the
engines' start-up) and each request's KV blocks held at the end against those it would hold
without the policy. On a machine of N cores, each actor gets `--cpus-per-actor` of them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from vllm_kvprune import machine

NAME = "ray-batch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="model folder (default: the tiny random Llama)")
    add("--rows", type=int, default=32, help="prompts in the job")
    add("--prompt-tokens", type=int, default=400)
    add("--max-tokens", type=int, default=128)
    add("--actors", type=int, nargs="+", default=[1, 2], help="actor counts to run, in order")
    add("--cpus-per-actor", type=int, default=1)
    add("--policy", nargs="+", default=["--kv-policy", "streaming", "--kv-budget", "128"],
        help="the --kv-* flags of the job")
    add("--out", default="results/ray_batch", help="writes STEM.json and STEM.png")


def run(args: argparse.Namespace) -> int:
    import ray

    from tools import assets
    from vllm_kvprune import batch

    model = args.model or str(assets.tiny_model_dir())
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        prompts = Path(scratch) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [5 + (13 * i + 7 * t) % 900 for t in
                                                                            range(args.prompt_tokens)]}) + "\n"
                                   for i in range(args.rows)))
        for actors in args.actors:
            job = batch.build_parser().parse_args([
                "--model", model, "--input", str(prompts), "--output", str(Path(scratch) / f"out{actors}"),
                "--actors", str(actors), "--cpus-per-actor", str(args.cpus_per_actor), "--batch-size", "4",
                "--max-tokens", str(args.max_tokens), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
                "--max-model-len", str(args.prompt_tokens + args.max_tokens + 32),
                "--kv-cache-memory-bytes", str(256 << 20), *args.policy])
            summary = batch.run(job)
            ray.shutdown()  # each run starts its own local cluster
            runs.append(summary)
    base = runs[0]
    for summary in runs:
        summary["speedup_busy"] = summary["generated_tokens_per_busy_second"] / base["generated_tokens_per_busy_second"]
        summary["speedup_wall"] = summary["generated_tokens_per_second"] / base["generated_tokens_per_second"]
    document = {"benchmark": NAME, "model": model, "rows": args.rows, "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens, "policy": args.policy, "machine": machine.machine_info(), "runs": runs}
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1))
    _print_and_plot(document, stem.with_suffix(".png"))
    return 0


def _print_and_plot(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"{'actors':>6}  {'tok/s busy':>10}  {'x':>5}  {'tok/s wall':>10}  {'x':>5}  {'KV blocks held':>14}  "
          f"{'without policy':>14}")
    for run in document["runs"]:
        print(f"{run['actors']:>6}  {run['generated_tokens_per_busy_second']:>10.1f}  {run['speedup_busy']:>5.2f}  "
              f"{run['generated_tokens_per_second']:>10.1f}  {run['speedup_wall']:>5.2f}  "
              f"{run['kv_blocks_held_mean']:>14.1f}  {run['kv_blocks_without_policy_mean']:>14.1f}")
    figure, axes = plt.subplots(figsize=(5, 3))
    labels = [str(run["actors"]) for run in document["runs"]]
    axes.bar(labels, [run["generated_tokens_per_busy_second"] for run in document["runs"]])
    axes.set_xlabel("Ray actors (one engine each)")
    axes.set_ylabel("generated tokens / s (busiest actor)")
    axes.set_title(f"batch job, {document['rows']} rows, {document['machine']['usable_cores']} cores", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
