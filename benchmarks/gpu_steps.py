"""`python -m benchmarks gpu-steps`: what the GPU wrapper's own work costs per decode step.

A batch decodes after its prompts, each policy's step carried out as the GPU wrapper does it
(`PolicyAttentionImpl` with `TritonKernels`): the step planned on the host and its tensors
copied to the device, then in every layer the moves, the write into planned slots, the
attention (h2o: attention and mass in our one kernel), the scores, and the host's choice of
victims from the scores copied back. Timed per decode step, the GPU synchronised at its end
(vLLM syncs each step to sample). `none` is the same loop with no policy: every token written
in order, attention over the whole sequence.

What stands in for vLLM (the GPU machine has no vLLM): vLLM's cache write is our
`write_slots` and vLLM's attention is our attention kernel without the mass (`attention_mass`
with output only), in every row alike, and there is no model: a step here is the attention
layers' KV work only, so the ratios are of that work, not of a served step.

Without a GPU the kernels run in Triton's interpreter (``--tiny``, ``TRITON_INTERPRET=1``): that
checks the script, not speed. Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_kernels import gpu_slug, machine
from benchmarks.gpu_timing import bench_device
from vllm_kvprune.worker.policy_attention import PolicyAttentionImpl

NAME = "gpu-steps"
POLICIES = ("none", "streaming", "h2o", "paged_eviction")


@dataclass(frozen=True)
class Shapes:
    batch: int
    layers: int
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    prompt: int
    budget: int
    decode_steps: int


FULL = Shapes(32, 30, 3, 3, 64, 16, 2048, 512, 16)  # SmolLM2-135M's attention layers
TINY = Shapes(2, 1, 2, 2, 32, 16, 56, 40, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--tiny", action="store_true", help="small shapes (the interpreter run of the tests)")
    add("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    add("--out", default=None, help="writes STEM.json and STEM.png (default: results/gpu/steps_<gpu>)")


def policy_settings(name: str, shapes: Shapes) -> dict | None:
    if name == "none":
        return None
    settings = {"name": name, "budget": shapes.budget, "sinks": 4, "prune_interval": 1}
    return {**settings, "prefill": "full"} if name == "streaming" else settings


class CacheWrite:
    """Stands in for vLLM's impl: its cache write (the op that writes the slot mapping's slots
    and skips -1) with the kernel set's own write, its attention with our attention kernel
    without the mass, over `StandInMetadata` (every row's keys up to its own, causally)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.kernels.write_slots(layer, key[: len(slot_mapping)], value[: len(slot_mapping)], kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        self.kernels.attention_mass(layer, query, kv_cache, attn_metadata.block_table, attn_metadata.rows,
                                    attn_metadata.key_counts, self.scale, None, output, 0.0)
        return output


@dataclasses.dataclass
class StandInMetadata:
    """What the stand-in attention and the plans read of a step's metadata."""

    block_table: torch.Tensor
    rows: torch.Tensor  # [T] each token's row
    key_counts: torch.Tensor  # [T] physical keys each token attends to
    num_actual_tokens: int


class StepImpl(PolicyAttentionImpl, CacheWrite):
    """The shared impl's work with `kernels`, outside vLLM (`policy_attention` imports none): a
    plan's `LayerCall` reaches vLLM's write and attention through it (`CacheWrite`)."""

    def __init__(self, kernels, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        self.kernels = kernels
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale, self.logits_soft_cap = head_size ** -0.5, 0

    def layer_step(self, plan, layer, kv_cache, query, key, value, slot_mapping, metadata: StandInMetadata):
        """One layer's work under `plan`, as the impl does it in vLLM: the write, the attention
        (the plan's, or vLLM's stood in for), the work after it; returns the attention output."""
        from vllm_kvprune.worker.layouts import LayerCall

        call = LayerCall(self, layer, kv_cache, plan.worker)
        plan.write(call, key, value, slot_mapping)
        output = plan.attend(call, query, key, value, metadata, torch.empty_like(query))
        plan.after_attention(call, query, metadata)
        return output


class PolicySteps:
    """A batch of requests over their own blocks, stepped through every layer's impl work."""

    def __init__(self, policy: dict | None, shapes: Shapes, kernels, device: str, dtype: torch.dtype,
                 layer_names: list[str] | None = None) -> None:
        from vllm_kvprune.config import KVPolicyConfig
        from vllm_kvprune.worker.state import WorkerKVState

        self.shapes, self.device, self.dtype = shapes, device, dtype
        self.layer_names = layer_names or [f"model.layers.{i}.self_attn.attn" for i in range(shapes.layers)]
        blocks_per_request = -(-(shapes.prompt + shapes.decode_steps + 64) // shapes.block_size)
        num_blocks = shapes.batch * blocks_per_request + 1
        permutation = np.random.default_rng(0).permutation(np.arange(1, num_blocks))  # scattered, as in a pool
        self.block_rows = permutation.reshape(shapes.batch, blocks_per_request).astype(np.int32)
        self.block_table = torch.from_numpy(self.block_rows).to(device)
        self.caches = [torch.zeros(num_blocks, shapes.kv_heads, shapes.block_size, 2 * shapes.head_dim, dtype=dtype,
                                   device=device) for _ in self.layer_names]
        self.layers = [SimpleNamespace(layer_name=name) for name in self.layer_names]
        self.impl = StepImpl(kernels, shapes.kv_heads * shapes.group, shapes.kv_heads, shapes.head_dim)
        self.state = None
        if policy is not None:
            self.state = WorkerKVState(KVPolicyConfig.from_dict(policy))
            self.state.bind_cache(self.layer_names, num_blocks, shapes.block_size, shapes.kv_heads, shapes.kv_heads,
                                  device=device)
        self.outputs: list[torch.Tensor] = []

    def inputs(self, num_tokens: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer: q [n, Hq, D], k and v [n, H, D] (random, on the device)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        shapes, out = self.shapes, []
        for _ in self.layer_names:
            q = torch.randn(num_tokens, shapes.kv_heads * shapes.group, shapes.head_dim, generator=generator,
                            device=self.device, dtype=self.dtype)
            kv = torch.randn(2, num_tokens, shapes.kv_heads, shapes.head_dim, generator=generator, device=self.device,
                             dtype=self.dtype)
            out.append((q, kv[0], kv[1]))
        return out

    def step(self, num_computed: np.ndarray, num_new: np.ndarray, inputs) -> float:
        """One step of every row; returns the host's planning time (s)."""
        from vllm_kvprune.worker.state import StepRows

        started = time.perf_counter()
        ends = np.cumsum(num_new)
        query_start_loc = np.concatenate([[0], ends])
        rows = np.repeat(np.arange(len(num_new)), num_new)
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(num_computed, num_new)])
        plan = None
        if self.state is None:  # none: token j of a row in slot j, every key attended
            slots = torch.from_numpy(self.block_rows[rows, positions // self.shapes.block_size].astype(np.int64)
                                     * self.shapes.block_size + positions % self.shapes.block_size)
            seq_lens = num_computed + num_new
        else:
            batch = len(num_new)
            self.state.rows = StepRows([f"r{i}" for i in range(batch)], num_computed,
                                       np.full(batch, self.shapes.prompt), self.block_rows, [None] * batch)
            plan = self.state.plan(query_start_loc, self.shapes.block_size).to_device(self.device)
            slots, seq_lens = plan.slot_mapping, plan.seq_lens.numpy()
        # Causal: a row's token t sees the row's physical keys up to its own.
        key_counts = seq_lens[rows] - (ends[rows] - 1 - np.arange(len(rows)))
        metadata = StandInMetadata(self.block_table, torch.from_numpy(rows).to(self.device),
                                   torch.from_numpy(key_counts).to(self.device), len(rows))
        if plan is not None:
            plan.prepare(None, metadata)  # paged_eviction: each layer's block table
        slot_mapping = slots.to(self.device)  # vLLM's own tensor, on the device
        planned = time.perf_counter() - started
        self._layers(plan, slot_mapping, metadata, inputs)
        return planned

    def _layers(self, plan, slot_mapping: torch.Tensor, metadata: StandInMetadata, inputs) -> None:
        for layer, cache, (query, key, value) in zip(self.layers, self.caches, inputs):
            if plan is None:  # vLLM's own write and attention, stood in for
                CacheWrite.do_kv_cache_update(self.impl, layer, key, value, cache, slot_mapping)
                CacheWrite.forward(self.impl, layer, query, key, value, cache, metadata, torch.empty_like(query))
            else:
                self.impl.layer_step(plan, layer, cache, query, key, value, slot_mapping, metadata)


def measure(name: str, shapes: Shapes, dtype: torch.dtype, device: str) -> dict[str, Any]:
    from vllm_kvprune.worker.kernel_sets import TritonKernels

    steps = PolicySteps(policy_settings(name, shapes), shapes, TritonKernels(), device, dtype)
    batch = shapes.batch
    steps.step(np.zeros(batch, np.int64), np.full(batch, shapes.prompt), steps.inputs(batch * shapes.prompt, 0))
    decode_inputs = [steps.inputs(batch, 1 + i) for i in range(shapes.decode_steps)]
    step_ms, plan_ms = [], []
    for i, inputs in enumerate(decode_inputs):
        computed = np.full(batch, shapes.prompt + i, np.int64)
        _synchronize(device)
        started = time.perf_counter()
        planned = steps.step(computed, np.ones(batch, np.int64), inputs)
        _synchronize(device)
        step_ms.append(1e3 * (time.perf_counter() - started))
        plan_ms.append(1e3 * planned)
    warm = slice(2, None) if len(step_ms) > 4 else slice(None)  # the first steps compile and warm caches
    kept = shapes.prompt + shapes.decode_steps if name == "none" else None
    if steps.state is not None:
        failed = {rid: state.failure for rid, state in steps.state.requests.items() if state.failure is not None}
        if failed:  # a quarantined request would time another step than the policy's
            raise RuntimeError(f"gpu-steps: {name}: requests failed: {failed}")
        kind, choice = steps.state.requests["r0"].kept_choices()
        kept = len(choice) if kind == "slots" else len(choice[0][0]) if kind == "heads" else len(choice[0])
    return {"policy": name, "step_ms": statistics.median(step_ms[warm]), "plan_ms": statistics.median(plan_ms[warm]),
            "kept_tokens": kept, "steps_timed": len(step_ms[warm])}


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    device = bench_device()
    shapes = TINY if args.tiny or device == "cpu" else FULL
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32
    # One process, no tensor parallelism: the worker state's reducer is its default, the identity.
    rows = []
    for name in args.policies:
        rows.append(measure(name, shapes, dtype, device))
        print(f"{name}: {rows[-1]}", flush=True)
    none = next((row for row in rows if row["policy"] == "none"), None)
    for row in rows:
        row["vs_none"] = none["step_ms"] / row["step_ms"] if none else None
    _print_table(rows)
    stem = Path(args.out) if args.out else Path("results/gpu") / f"steps_{gpu_slug(device)}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    info = machine(device, module="benchmarks.gpu_steps", name=NAME)
    document = {"benchmark": NAME, "machine": info, "dtype": str(dtype).removeprefix("torch."),
                "shapes": dataclasses.asdict(shapes), "results": rows}
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1))
    _plot(rows, stem.with_suffix(".png"), info)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'policy':<16}{'ms/step':>10}{'plan ms':>10}{'kept':>8}{'vs none':>10}")
    for row in rows:
        ratio = f"{row['vs_none']:.2f}x" if row["vs_none"] else ""
        print(f"{row['policy']:<16}{row['step_ms']:>10.3f}{row['plan_ms']:>10.3f}{row['kept_tokens']:>8}{ratio:>10}")


def _plot(rows: list[dict[str, Any]], path: Path, info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.0, 3.0))
    names = [row["policy"] for row in rows]
    axes.bar(names, [row["step_ms"] for row in rows], label="whole step")
    axes.bar(names, [row["plan_ms"] for row in rows], label="host planning")
    axes.set_ylabel("ms per decode step (KV work of every layer)")
    axes.set_title(info.get("gpu", "Triton interpreter (not a timing)"), fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
