"""Batch inference with a KV policy on a local Ray cluster: two actors, one vLLM engine each.

    python examples/ray_batch.py --model MODEL --workdir /tmp/ray_batch [--actors 2]

Writes WORKDIR/prompts.jsonl (long and short prompts, each twice), runs them through
`python -m vllm_kvprune.batch` with `--kv-policy streaming --kv-budget 96` and prints, per row,
the blocks the request held at the end against those it would hold without the policy.
On a cluster, start Ray on every node first and add `--ray-address auto` (README, "Scaling out").
"""

import argparse
import json
from pathlib import Path

from vllm_kvprune import batch


def write_prompts(path: Path) -> None:
    """Token-id prompts (any tokenizer): four lengths, each twice, so the two actors' answers
    to the same prompt can be compared."""
    rows = [{"id": f"{length}-{copy}", "prompt_token_ids": [5 + (7 * i + length) % 900 for i in range(length)]}
            for copy in range(2) for length in (40, 120, 200, 300)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    write_prompts(workdir / "prompts.jsonl")
    summary = batch.run(batch.build_parser().parse_args([
        "--model", args.model, "--input", str(workdir / "prompts.jsonl"), "--output", str(workdir / "out"),
        "--actors", str(args.actors), "--batch-size", "2", "--max-tokens", "40", "--dtype", "float32",
        "--enforce-eager", "--block-size", "32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20),
        "--kv-policy", "streaming", "--kv-budget", "96"]))
    for path in sorted((workdir / "out").glob("*.json")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            print(f"{row['id']:>6}: {row['num_prompt_tokens']} + {row['num_generated_tokens']} tokens, "
                  f"{row['kv_blocks_held']} KV blocks held (without the policy {row['kv_blocks_without_policy']}), "
                  f"actor {row['actor']}")
    print(f"{summary['rows']} rows by {len(summary['actors_seen'])} actors in {summary['wall_seconds']} s")


if __name__ == "__main__":
    main()
