"""The host's planning of a decode step, alone: `WorkerKVState.plan` for a batch past its prompts.

A GPU waits for this Python every step (`bench gpu-steps`: most of what `streaming` and
`paged_eviction` add to a step there), and it is the same code on every host, so it is timed
here without a model, kernels or a GPU: `gpu-steps`' shapes (SmolLM2-135M's 30 layers x 3 KV
heads, batch 32, prompts of 2048 tokens, budget 512, 16-token blocks), each request's map
driven through its prompt and then `--steps` decode steps, one token each. What the kernels
would write is stood in for: `paged_eviction`'s block scores stay zero (it evicts by position;
the work per step is the same), `h2o`'s attention mass is random, fixed, and its prompt is
pruned per head from it as its impl would (the maps only). `h2o`'s plan includes its victim
search (the C++ op on the CPU, over the whole step's evicting rows).

`--against REV` times the same steps on git revision REV too (a temporary worktree using this
tree's C++ extension), alternating child processes `--rounds` times, so that one run gives the
ratio on one machine at one time (this 2-core VM's speed drifts by up to 1.5x between minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

NAME = "plan-steps"
POLICIES = ("streaming", "paged_eviction", "h2o")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--steps", type=int, default=150, help="decode steps timed per policy and round")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per tree and policy")
    parser.add_argument("--against", default=None, help="a git revision to time beside this tree")
    parser.add_argument("--out", default="results/plan_steps.json")


def measure(policy: str, steps: int, kept: bool = False) -> list[float] | tuple[list[float], list[int]]:
    """Planning ms of each decode step (the prompt's step and the first 5 decode steps, which
    warm caches, left out); with `kept`, also the tokens each request holds at the end.
    It runs inside the tree being timed (`--against`), so it uses only what revisions older
    than this file have: hence its own block table, as `gpu_steps.PolicySteps` builds one. The
    shapes and settings are that tree's `benchmarks.gpu_steps`, or this tree's where it has none
    (a revision from before the benchmarks left the package: `_child` puts this tree after it)."""
    from benchmarks.gpu_steps import FULL as shapes
    from benchmarks.gpu_steps import policy_settings
    from vllm_kvprune import vllm_hooks
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.worker.state import StepRows, WorkerKVState

    try:  # a tree from before 0760fea: its worker state is process-wide and its all-reduce vLLM's
        from vllm_kvprune.worker import runtime
    except ImportError:  # since: passed in (one process's reducer, the identity, is the default)
        runtime = None

    blocks_per_request = -(-(shapes.prompt + steps + 64) // shapes.block_size)
    num_blocks = shapes.batch * blocks_per_request + 1
    block_rows = np.random.default_rng(0).permutation(np.arange(1, num_blocks)).reshape(shapes.batch, -1)
    state = WorkerKVState(KVPolicyConfig.from_dict(policy_settings(policy, shapes)))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(shapes.layers)]
    state.bind_cache(layers, num_blocks, shapes.block_size, shapes.kv_heads, shapes.kv_heads, device="cpu")
    tables = _tables(state)
    if policy == "h2o":  # attention mass as if attended (random: the victim search's work is the same)
        tables.by_slot.uniform_(generator=torch.Generator().manual_seed(0))
    batch, names = shapes.batch, [f"r{i}" for i in range(shapes.batch)]
    timings = []
    all_reduce = vllm_hooks.tp_all_reduce
    if runtime is not None:  # the older tree's globals: restored after
        vllm_hooks.tp_all_reduce = lambda tensor: tensor
        runtime.install(state)
    try:
        for step in range(steps + 6):
            num_new = np.full(batch, shapes.prompt if step == 0 else 1)
            computed = np.full(batch, 0 if step == 0 else shapes.prompt + step - 1, np.int64)
            state.rows = StepRows(names, computed, np.full(batch, shapes.prompt), block_rows.astype(np.int32),
                                  [None] * batch)
            started = time.perf_counter()
            plan = state.plan(np.concatenate([[0], np.cumsum(num_new)]), shapes.block_size)
            timings.append(1e3 * (time.perf_counter() - started))
            if getattr(plan, "head_slot_mapping", None) is not None:  # h2o (a HeadPlan)
                _prune_prompts_per_head(state, plan)
    finally:
        if runtime is not None:
            runtime.install(None)
            vllm_hooks.tp_all_reduce = all_reduce
    failed = [request_id for request_id, request in state.requests.items() if request.failure is not None]
    if failed:
        raise RuntimeError(f"plan-steps: {policy}: requests failed: {failed[:3]}")
    if kept:
        return timings[6:], [state.requests[name].kept_tokens()[1] for name in names]
    return timings[6:]


def _tables(state):
    """The worker's per-slot tables (`scores` in trees from before 0760fea)."""
    return state.tables if hasattr(state, "tables") else state.scores


def _prune_prompts_per_head(state, plan) -> None:
    """What h2o's impl does to its maps once a prompt has been attended (the K/V moves aside):
    every layer's heads keep their own tokens, chosen by the policy from the mass."""
    tables = _tables(state)
    for compaction in plan.prefill_compactions:
        request = compaction.state
        heads = request.map if hasattr(request, "map") else request.heads
        for layer in range(tables.num_layers):
            kept = request.policy.prefill_survivors(tables.by_slot[layer], compaction.prompt_slots,
                                                    compaction.keep, request.config)
            heads.set_layer_survivors(layer, kept.numpy())


def _tree_at(revision: str, workdir: str) -> Path:
    """A worktree of `revision` with this tree's built C++ extension beside its sources."""
    from benchmarks import common  # here, not at the top: `measure` also runs on older packages

    tree = Path(workdir) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), revision], check=True, capture_output=True)
    for built in (common.REPO_ROOT / "vllm_kvprune").glob("_C*.so"):
        (tree / "vllm_kvprune" / built.name).write_bytes(built.read_bytes())
    return tree


def _child(tree: Path, policy: str, steps: int) -> list[float]:
    """`measure` (this file's, so a revision from before it can be timed) in a fresh process
    that imports `vllm_kvprune` from `tree`."""
    from benchmarks import common

    env = common.child_env({key: value for key, value in os.environ.items() if key != "PYTHONPATH"}, tree)
    code = (f"import json, runpy; measure = runpy.run_path({str(Path(__file__).resolve())!r})['measure']; "
            f"import vllm_kvprune; assert vllm_kvprune.__file__.startswith({str(tree)!r}), vllm_kvprune.__file__; "
            f"print(json.dumps(measure({policy!r}, {steps})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    from benchmarks import common

    with tempfile.TemporaryDirectory() as workdir:
        trees = {"this tree": common.REPO_ROOT}
        if args.against:
            trees[args.against] = _tree_at(args.against, workdir)
        try:
            timings = {(tree, policy): [] for tree in trees for policy in args.policies}
            for round_index in range(args.rounds):  # alternate, so drift hits every tree alike
                order = list(trees.items())[:: -1 if round_index % 2 else 1]  # and neither always goes first
                for policy in args.policies:
                    for label, tree in order:
                        timings[label, policy] += _child(tree, policy, args.steps)
        finally:
            if args.against:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[args.against])], capture_output=True)
    rows = [{"tree": label, "policy": policy, "median_ms": statistics.median(found),
             "p10_ms": statistics.quantiles(found, n=10)[0], "steps": len(found)}
            for (label, policy), found in timings.items()]
    for row in rows:
        base = next((other for other in rows if other["policy"] == row["policy"] and other["tree"] == args.against), None)
        row["vs_against"] = base["median_ms"] / row["median_ms"] if base else None
        # Drift only ever slows a step down, so the fast tail is the steadier comparison.
        row["vs_against_p10"] = base["p10_ms"] / row["p10_ms"] if base else None
    _print(rows)
    _write(rows, args, Path(args.out))
    return 0


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"{'tree':<14}{'policy':<16}{'median ms':>10}{'p10 ms':>9}{'speed-up (median, p10)':>24}")
    for row in rows:
        ratio = f"{row['vs_against']:.2f}x, {row['vs_against_p10']:.2f}x" if row["vs_against"] else "-"
        print(f"{row['tree']:<14}{row['policy']:<16}{row['median_ms']:>10.3f}{row['p10_ms']:>9.3f}{ratio:>24}")


def _own_arguments() -> list[str]:
    # The arguments after the subcommand (`bench plan-steps ...`) or the module (`-m ...plan_steps`).
    return sys.argv[sys.argv.index(NAME) + 1:] if NAME in sys.argv else sys.argv[1:]


def _write(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import platform

    import matplotlib

    from benchmarks.gpu_steps import FULL

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = {"python": platform.python_version(), "cpu_count": os.cpu_count(), "head": head,
               "command": ["python", "-m", "benchmarks", NAME, *_own_arguments()],
               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    document = {"benchmark": NAME, "machine": machine, "against": args.against, "rounds": args.rounds,
                "shapes": {"batch": FULL.batch, "layers": FULL.layers, "kv_heads": FULL.kv_heads,
                           "prompt": FULL.prompt, "budget": FULL.budget, "block_size": FULL.block_size},
                "results": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    figure, axes = plt.subplots(figsize=(6.0, 3.0))
    labels = [f"{row['policy']}\n{row['tree']}" for row in rows]
    axes.bar(labels, [row["median_ms"] for row in rows])
    axes.set_ylabel("ms of host planning per decode step")
    axes.set_title(f"batch {FULL.batch}, {FULL.layers} layers x {FULL.kv_heads} KV heads", fontsize=9)
    axes.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    figure.savefig(path.with_suffix(".png"), dpi=120)
    plt.close(figure)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def main() -> int:
    """`python3 -m benchmarks.plan_steps`: where vLLM (which the bench menu imports) is
    missing, as on the GPU machine (`scripts/gpu_check.sh plan`)."""
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.plan_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
