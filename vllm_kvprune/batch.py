"""`python -m vllm_kvprune.batch`: offline batch inference with a KV policy, scaled out with Ray.

Ray Data reads the prompts (a JSONL or Parquet file, or a folder of them: a `prompt` column of
text, or `prompt_token_ids`), hands batches of rows to `--actors` Ray actors that each hold one
vLLM engine (`LLM`) with the policy, and writes every row back with its output and its KV
statistics (blocks the request held at the end against those it would hold without the
policy, tokens kept). The policy reaches each engine through vLLM's own config
(`additional_config`), and the plugin loads in each Ray worker from its installed entry point:
nothing travels in environment variables.

Why `map_batches` with our own actor class rather than Ray's `ray.data.llm` vLLM processor: that
processor asks each engine replica for a GPU bundle by default (`{"GPU": 1, "CPU": 1}`, Ray 2.60's
`ray/llm/_internal/batch/stages/vllm_engine_stage.py`), which a CPU cluster never grants, and it
does not return per-request KV statistics. On GPU clusters it can take the same
`additional_config`; that path is not tried here.

Where: on one machine, a local Ray cluster is started for the job (`--ray-address` unset); on
a cluster, `ray start --head` on one node, `ray start --address HEAD:6379` on the others (each
with this package and vLLM installed), then this command with `--ray-address auto` on any of
them. On a CPU, each actor's engine is pinned to its own `--cpus-per-actor` cores of its node.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Every actor's output row: the input columns, then these.
OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_prompt_tokens", "num_generated_tokens", "kv_policy",
                  "kv_blocks_held", "kv_blocks_without_policy", "kv_kept_tokens_mean", "kv_kept_tokens_max", "actor",
                  "actor_busy_seconds")
# How long Ray Data may take to start every actor's engine (model load included) before the
# first batch is handed out; past it the job fails naming the cause (too few resources).
ACTORS_START_TIMEOUT_S = 3600


def build_parser() -> argparse.ArgumentParser:
    from vllm_kvprune.plugin import _add_kv_flags

    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvprune.batch",
        description="Batch inference with a KV policy on Ray: Ray Data reads the prompts, --actors Ray actors "
                    "each run one vLLM engine with the policy, and every row is written back with its output "
                    "and KV statistics. Starts a local Ray cluster unless --ray-address names one.",
        epilog="Multi-node: `ray start --head` on one node, `ray start --address HEAD:6379` on the others, "
               "then this command with --ray-address auto. See the README, 'Scaling out'.")
    parser.add_argument("--model", required=True, help="model name or folder (as for `vllm serve`)")
    parser.add_argument("--input", required=True, help="JSONL or Parquet file (or folder): a `prompt` or "
                                                       "`prompt_token_ids` column")
    parser.add_argument("--output", required=True, help="folder to write the rows to (created)")
    parser.add_argument("--output-format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--actors", type=int, default=1, help="Ray actors, one engine each (default 1)")
    parser.add_argument("--cpus-per-actor", type=int, default=1,
                        help="CPU cores each actor's engine gets (Ray's num_cpus; pinned on a CPU)")
    parser.add_argument("--gpus-per-actor", type=float, default=0.0, help="GPUs each actor gets (Ray's num_gpus)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per batch handed to an actor")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per row")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool of each engine, in bytes")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--ray-address", default=None, help="a running Ray cluster ('auto', or HEAD:PORT); "
                                                            "default: start a local one for the job")
    parser.add_argument("--summary", default=None, help="write the run's summary JSON here (default: OUTPUT/../"
                                                        "OUTPUT_NAME.summary.json)")
    _add_kv_flags(parser)
    return parser


def policy_dict(args: argparse.Namespace) -> dict[str, Any] | None:
    """The validated KV policy of the flags (None: no policy), as vLLM's additional_config holds it.
    A bad flag exits 2 naming it (before Ray starts)."""
    from vllm_kvprune.config import KVConfigError
    from vllm_kvprune.plugin import policy_from_args

    try:
        policy = policy_from_args(args)
    except KVConfigError as error:
        print(f"vllm-kvprune batch: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return None if policy is None else {key: value for key, value in policy.to_dict().items() if value is not None}


def engine_options(args: argparse.Namespace, policy: dict[str, Any] | None) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": args.dtype, "enforce_eager": args.enforce_eager, "seed": 0}
    for name in ("max_model_len", "block_size", "kv_cache_memory_bytes"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if policy is not None:
        options["additional_config"] = {"kv_policy": policy}
    return options


class CoreSlot:
    """One of a node's `--cpus-per-actor`-core slices, held for the actor's life through a lock
    file, so that engines of actors on one node do not share cores (vLLM's CPU backend pins its
    threads to whatever `VLLM_CPU_OMP_THREADS_BIND` names)."""

    def __init__(self, cores_per_slot: int, folder: str = "/tmp/vllm_kvprune_batch_slots") -> None:
        allowed = sorted(os.sched_getaffinity(0))
        Path(folder).mkdir(parents=True, exist_ok=True)
        for slot in range(max(1, len(allowed) // cores_per_slot)):
            handle = open(Path(folder) / f"slot{slot}.lock", "w")  # noqa: SIM115 (held while the actor lives)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self._handle = handle
            self.cores = allowed[slot * cores_per_slot:(slot + 1) * cores_per_slot] or allowed
            return
        raise RuntimeError(f"every {cores_per_slot}-core slice of this node's {len(allowed)} cores is taken by "
                           "another actor: lower --actors or --cpus-per-actor")


class EngineActor:
    """A Ray Data callable class: one vLLM engine with the policy per actor, built once."""

    def __init__(self, model: str, options: dict[str, Any], sampling: dict[str, Any], cpus: int) -> None:
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            self.slot = CoreSlot(cpus)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(core) for core in self.slot.cores)
        self.llm = LLM(model=model, **options)
        self.params = SamplingParams(**sampling, extra_args={"kv_report": True})
        self.name = f"{os.uname().nodename}:{os.getpid()}"
        self.busy_seconds = 0.0  # time inside generate, so far (engine start-up excluded)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        if "prompt_token_ids" in batch:
            prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in batch["prompt_token_ids"]]
        else:
            prompts = [str(text) for text in batch["prompt"]]
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        self.busy_seconds += time.perf_counter() - started
        rows: dict[str, list] = {column: [] for column in OUTPUT_COLUMNS}
        for output in outputs:
            completion = output.outputs[0]
            report = (output.kv_transfer_params or {}).get("kvprune") or {}
            values = (completion.text, list(completion.token_ids), len(output.prompt_token_ids or []),
                      len(completion.token_ids), report.get("policy", "none"), report.get("blocks_held"),
                      report.get("blocks_without_policy"), report.get("kept_tokens_mean"),
                      report.get("kept_tokens_max"), self.name, round(self.busy_seconds, 3))
            for column, value in zip(OUTPUT_COLUMNS, values):
                rows[column].append(value)
        return {**{key: list(value) for key, value in batch.items()}, **rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The job; returns its summary (also written as JSON)."""
    import ray
    import ray.data

    policy = policy_dict(args)
    if args.actors < 1 or args.cpus_per_actor < 1 or args.batch_size < 1:
        print("vllm-kvprune batch: error: --actors, --cpus-per-actor and --batch-size must be >= 1", file=sys.stderr)
        raise SystemExit(2)
    if not Path(args.input).exists():
        print(f"vllm-kvprune batch: error: --input: not found: {args.input}", file=sys.stderr)
        raise SystemExit(2)
    started = time.perf_counter()
    if not ray.is_initialized():
        # A local cluster's workers inherit this environment (HF_HUB_OFFLINE and the like). Its
        # logical CPUs leave one beside the actors' for Ray Data's read and write tasks, which
        # would otherwise wait for an actor's CPU forever.
        local_cpus = max(os.cpu_count() or 1, args.actors * args.cpus_per_actor + 1)
        ray.init(address=args.ray_address, num_cpus=None if args.ray_address else local_cpus,
                 include_dashboard=False, log_to_driver=True)
    # Batches are handed out only once every actor's engine is up: Ray Data's default starts
    # the pool lazily, so the first engine to come up queues several batches at once and on a
    # short input leaves the others nothing.
    ray.data.DataContext.get_current().wait_for_min_actors_s = ACTORS_START_TIMEOUT_S
    data = read(args.input)
    options = engine_options(args, policy)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    results = data.map_batches(EngineActor, batch_size=args.batch_size, concurrency=args.actors,
                               num_cpus=args.cpus_per_actor, num_gpus=args.gpus_per_actor or None,
                               fn_constructor_kwargs={"model": args.model, "options": options, "sampling": sampling,
                                                      "cpus": args.cpus_per_actor})
    output = Path(args.output)
    (results.write_json if args.output_format == "jsonl" else results.write_parquet)(str(output.resolve()))
    wall = time.perf_counter() - started
    rows = [json.loads(line) for path in sorted(output.glob("*.json")) for line in path.read_text().splitlines()] \
        if args.output_format == "jsonl" else read_parquet_rows(output)
    summary = summarize(rows, policy, args, wall)
    summary_path = Path(args.summary) if args.summary else output.parent / f"{output.name}.summary.json"
    summary_path.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def read(path: str):
    import ray.data

    source = Path(path)
    files = sorted(source.iterdir()) if source.is_dir() else [source]
    if all(file.suffix == ".parquet" for file in files):
        return ray.data.read_parquet(str(source.resolve()))
    return ray.data.read_json(str(source.resolve()))  # JSON lines


def read_parquet_rows(folder: Path) -> list[dict]:
    import pyarrow.parquet

    return [row for path in sorted(folder.glob("*.parquet")) for row in pyarrow.parquet.read_table(path).to_pylist()]


def summarize(rows: list[dict], policy: dict | None, args: argparse.Namespace, wall: float) -> dict[str, Any]:
    """Rows, tokens, wall time (engine start-up included), the time the busiest actor spent
    generating (the job's steady throughput: generated tokens over it) and the policy's KV saving."""
    generated = sum(row["num_generated_tokens"] for row in rows)
    busy: dict[str, float] = {}
    for row in rows:
        busy[row["actor"]] = max(busy.get(row["actor"], 0.0), row["actor_busy_seconds"])
    busiest = max(busy.values(), default=0.0)
    held = [row["kv_blocks_held"] for row in rows if row.get("kv_blocks_held") is not None]
    without = [row["kv_blocks_without_policy"] for row in rows if row.get("kv_blocks_without_policy") is not None]
    return {"rows": len(rows), "actors": args.actors, "cpus_per_actor": args.cpus_per_actor, "policy": policy,
            "generated_tokens": generated, "prompt_tokens": sum(row["num_prompt_tokens"] for row in rows),
            "wall_seconds": round(wall, 2), "generated_tokens_per_second": round(generated / wall, 2) if wall else None,
            "actors_seen": sorted(busy), "actor_busy_seconds": busy,
            "busiest_actor_seconds": round(busiest, 2),
            "generated_tokens_per_busy_second": round(generated / busiest, 2) if busiest else None,
            "kv_blocks_held_mean": sum(held) / len(held) if held else None,
            "kv_blocks_without_policy_mean": sum(without) / len(without) if without else None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
