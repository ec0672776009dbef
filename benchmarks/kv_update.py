"""`python -m benchmarks kv-update`: one KV-cache update step, in place vs shift-and-append.

StreamingLLM-style eviction keeps `sinks` first tokens and a window of recent ones; every step
drops the E oldest window tokens and adds E new ones. Two ways to do that, per layer:

* shift-and-append (how Hugging Face StreamingLLM implementations update a contiguous cache):
  K and V are `[batch, heads, cache_tokens, head_dim]`; a step builds
  `cat([k[:, :, :sinks], k[:, :, sinks + E:], new_k], dim=2)` (same for V), i.e. copies the
  whole cache into fresh tensors. `shift_prealloc` is the same copy into preallocated
  tensors: it separates the data movement from the allocator and page-fault cost.
* in place (EQUIP): vLLM's paged cache `[num_blocks, heads, block_size, 2 * head_dim]` holds
  the same tokens; a step writes the E new tokens of every request into the slots of its E
  victims (ring positions) with `write_slots`, moving E tokens instead of the whole cache.
  Reported for the C++ op and for the pure-torch reference.

`--policy paged_eviction` times PagedEviction's decode event instead: each request drops one
whole block (E = block size) and gains one token. Shift-and-append gathers the cache around
the dropped block and appends the token; in place writes the token into the dropped block's
first slot and nothing else moves (the block becomes the request's tail in that layer's order).

`--policy h2o` times the H2O (heavy-hitter) decode update in the EQUIP paper's Table 6 setting
(its own grid: batch 1/8/32, 64/128 KV heads, head_dim 64/128, evict 64; `--sinks` does not
apply). H2O evicts per KV head: every (request, head) drops its own E tokens, the ones with the
least attention mass, so the victims differ from head to head. Gather-and-append (how H2O
implementations update a contiguous cache) builds the index of each (request, head)'s kept
tokens, `torch.gather`s K and V along the token dim into new tensors and `cat`s the E new
tokens (`gather_prealloc`: gather into preallocated tensors, then copy the new tokens after
them). In place writes the E new tokens of every request into that request's per-head victim
slots, `write_slots` with slots `[batch * E, heads]`. Besides the in-place check below, one
step of each method on a batch of at most 2 from the same tokens must leave every (request,
head) with the same tokens (`same_tokens` in the JSON).

Victim slots for every step are computed before timing (the worker's slot bookkeeping is not
part of the cache update), and they advance around the ring from step to step as in a real run.
For h2o the victims are distinct random positions per (request, head), drawn anew for each of a
few precomputed steps as if chosen by attention mass; the gather index of the kept tokens is
precomputed from them too, so only the data movement is timed on either side.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common
from vllm_kvprune import machine

NAME = "kv-update"
DEFAULT_OUT = "results/kv_update.json"
TARGET_SPEEDUP = 20.0  # at batch 32, evict 64 (the EQUIP paper reports 26-50x on a Xeon)

FULL_GRID = {"batch": (1, 8, 32), "kv_heads": (8, 32), "head_dim": (64, 128), "evict": (1, 64)}
QUICK_GRID = {"batch": (1, 32), "kv_heads": (8, 32), "head_dim": (128,), "evict": (1, 64)}
# The EQUIP paper's Table 6 setting (cache 1024 tokens, evict 64 per KV head): h2o's grid, and
# streaming's with --paper-grid.
H2O_FULL_GRID = {"batch": (1, 8, 32), "kv_heads": (64, 128), "head_dim": (64, 128), "evict": (64,)}
H2O_QUICK_GRID = {"batch": (1, 32), "kv_heads": (64,), "head_dim": (128,), "evict": (64,)}
H2O_STEPS = 4  # distinct precomputed victim sets, cycled (the gather indices are cache-sized)

# What in place is compared with, per policy: the timing key of the baseline.
BASELINE = {"streaming": "shift", "paged_eviction": "shift", "h2o": "gather"}
BASELINE_LABEL = {"shift": "shift-and-append", "gather": "gather-and-append"}


@dataclass(frozen=True)
class Config:
    dtype: str
    batch: int
    kv_heads: int
    head_dim: int
    evict: int
    cache_tokens: int
    sinks: int
    block_size: int
    policy: str = "streaming"

    @property
    def new_tokens(self) -> int:
        """Tokens each request gains in one step: E for streaming, 1 for a block eviction."""
        return 1 if self.policy == "paged_eviction" else self.evict

    @property
    def drop_start(self) -> int:
        """First cache index the shift drops: the oldest window token, or the second block."""
        return self.block_size if self.policy == "paged_eviction" else self.sinks

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        return f"B{self.batch} H{self.kv_heads} D{self.head_dim} E{self.evict}"


def contiguous_kv(config: Config, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random K, V `[batch, heads, cache_tokens, head_dim]` and the step's new K, V."""
    shape = (config.batch, config.kv_heads, config.cache_tokens, config.head_dim)
    new_shape = (config.batch, config.kv_heads, config.new_tokens, config.head_dim)
    return tuple(torch.randn(size, generator=gen).to(config.torch_dtype)
                 for size in (shape, shape, new_shape, new_shape))


class ShiftAppendCache:
    """One layer's contiguous K/V, updated the Hugging Face StreamingLLM way."""

    def __init__(self, config: Config, gen: torch.Generator) -> None:
        self.key, self.value, self.new_key, self.new_value = contiguous_kv(config, gen)
        self.drop_start, self.evict = config.drop_start, config.evict
        out_shape = (config.batch, config.kv_heads, config.cache_tokens - config.evict + config.new_tokens,
                     config.head_dim)
        self.key_out = torch.empty(out_shape, dtype=config.torch_dtype)
        self.value_out = torch.empty(out_shape, dtype=config.torch_dtype)

    def _parts(self, cache: torch.Tensor, new: torch.Tensor) -> list[torch.Tensor]:
        return [cache[:, :, : self.drop_start], cache[:, :, self.drop_start + self.evict :], new]

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New tensors, as a contiguous cache must; the old ones are freed by the caller."""
        key = torch.cat(self._parts(self.key, self.new_key), dim=2)
        value = torch.cat(self._parts(self.value, self.new_value), dim=2)
        return key, value

    def step_preallocated(self) -> None:
        torch.cat(self._parts(self.key, self.new_key), dim=2, out=self.key_out)
        torch.cat(self._parts(self.value, self.new_value), dim=2, out=self.value_out)


class GatherAppendCache:
    """One layer's contiguous K/V, updated the way H2O implementations do: per (request, head)
    gather the kept tokens, then append the new ones."""

    def __init__(self, config: Config, gen: torch.Generator, victim_positions: list[torch.Tensor]) -> None:
        self.key, self.value, self.new_key, self.new_value = contiguous_kv(config, gen)
        # [batch, heads, kept, head_dim] views of [batch, heads, kept] (expanded, as H2O code does).
        self.keep_schedule = [keep_index(victims, config.cache_tokens).unsqueeze(-1).expand(-1, -1, -1, config.head_dim)
                              for victims in victim_positions]
        self.kept = config.cache_tokens - config.evict
        self.key_out = torch.empty(self.key.shape, dtype=config.torch_dtype)
        self.value_out = torch.empty(self.key.shape, dtype=config.torch_dtype)
        # One step counter per variant, so each cycles through every victim set.
        self._step_index = {"new": itertools.count(), "prealloc": itertools.count()}

    def next_keep(self, variant: str) -> torch.Tensor:
        return self.keep_schedule[next(self._step_index[variant]) % len(self.keep_schedule)]

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New tensors, as a contiguous cache must; the old ones are freed by the caller."""
        keep = self.next_keep("new")
        key = torch.cat([torch.gather(self.key, 2, keep), self.new_key], dim=2)
        value = torch.cat([torch.gather(self.value, 2, keep), self.new_value], dim=2)
        return key, value

    def step_preallocated(self) -> tuple[torch.Tensor, torch.Tensor]:
        keep = self.next_keep("prealloc")
        torch.gather(self.key, 2, keep, out=self.key_out[:, :, : self.kept])
        self.key_out[:, :, self.kept :].copy_(self.new_key)
        torch.gather(self.value, 2, keep, out=self.value_out[:, :, : self.kept])
        self.value_out[:, :, self.kept :].copy_(self.new_value)
        return self.key_out, self.value_out


def h2o_victim_positions(config: Config, gen: torch.Generator, steps: int = H2O_STEPS) -> list[torch.Tensor]:
    """Victim positions `[batch, heads, E]` of successive H2O steps: distinct per (request, head)
    and different from head to head, as the least attention mass would pick them."""
    shape = (config.batch, config.kv_heads, config.cache_tokens)
    return [torch.rand(shape, generator=gen).argsort(dim=-1)[..., : config.evict].contiguous() for _ in range(steps)]


def keep_index(victims: torch.Tensor, cache_tokens: int) -> torch.Tensor:
    """Positions `[batch, heads, cache_tokens - E]` of the tokens each (request, head) keeps,
    in cache order."""
    batch, heads, evict = victims.shape
    keep = torch.ones(batch, heads, cache_tokens, dtype=torch.bool)
    keep.scatter_(-1, victims, False)
    return keep.nonzero()[:, -1].view(batch, heads, cache_tokens - evict)


class InPlaceCache:
    """One layer's paged cache holding the same tokens; a step overwrites the victims' slots."""

    def __init__(self, config: Config, gen: torch.Generator, layout,
                 victim_positions: list[torch.Tensor] | None = None) -> None:
        blocks_per_request = math.ceil(config.cache_tokens / config.block_size)
        num_blocks = config.batch * blocks_per_request
        shape = (num_blocks, config.kv_heads, config.block_size, 2 * config.head_dim)
        self.kv_cache = torch.randn(shape, generator=gen).to(config.torch_dtype)
        tokens = config.batch * config.new_tokens
        self.new_key = torch.randn(tokens, config.kv_heads, config.head_dim, generator=gen).to(config.torch_dtype)
        self.new_value = torch.randn(tokens, config.kv_heads, config.head_dim, generator=gen).to(config.torch_dtype)
        # vLLM hands out blocks from a free list: requests do not own neighbouring blocks.
        self.block_table = torch.randperm(num_blocks, generator=gen).view(config.batch, blocks_per_request)
        self.victim_schedule = victim_slot_schedule(config, self.block_table, victim_positions)
        self.layout = layout
        self._step_index = itertools.count()

    def next_victims(self) -> torch.Tensor:
        return self.victim_schedule[next(self._step_index) % len(self.victim_schedule)]

    def step_with(self, write_slots: Callable[..., None]) -> None:
        write_slots(self.new_key, self.new_value, self.kv_cache, self.next_victims(), self.layout)


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of logical `positions` `[batch, ...]` of each request."""
    batch = block_table.shape[0]
    blocks = block_table.gather(1, (positions // block_size).reshape(batch, -1)).view(positions.shape)
    return blocks * block_size + positions % block_size


def victim_slot_schedule(config: Config, block_table: torch.Tensor,
                         victim_positions: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Victim slots `[batch * evict]` of successive steps: the E oldest window tokens, which
    walk around the ring of `cache_tokens - sinks` window positions (for a block eviction:
    the first slot of a dropped block, never the first or the last block). For h2o, the slots
    `[batch * evict, heads]` of `victim_positions` (`[batch, heads, E]` per step): token
    `b * E + e` goes to (request b, head h)'s e-th victim."""
    if config.policy == "h2o":
        if victim_positions is None:
            raise ValueError("h2o needs the victim positions of every step")
        return [slots_of(block_table, victims, config.block_size).transpose(1, 2).reshape(-1, config.kv_heads)
                .contiguous() for victims in victim_positions]
    if config.policy == "paged_eviction":
        middle_blocks = block_table.shape[1] - 2
        return [block_table[:, 1 + step % middle_blocks] * config.block_size for step in range(min(middle_blocks, 64))]
    window = config.cache_tokens - config.sinks
    steps = window // math.gcd(window, config.evict)  # until the ring pointer comes back
    schedule = []
    for step in range(min(steps, 64)):
        ring = (step * config.evict + torch.arange(config.evict)) % window
        positions = config.sinks + ring  # [E] logical positions in each request
        blocks = block_table[:, positions // config.block_size]  # [batch, E]
        schedule.append((blocks * config.block_size + positions % config.block_size).reshape(-1))
    return schedule


def check_in_place(cache: InPlaceCache) -> bool:
    """After a step the victims' slots hold exactly the new tokens (guards the timing against
    an op that got faster by doing less)."""
    from vllm_kvprune import kernels

    victims = cache.victim_schedule[0]
    kernels.write_slots(cache.new_key, cache.new_value, cache.kv_cache, victims, cache.layout)
    key, value = kernels.read_slots(cache.kv_cache, victims, cache.layout)
    return bool(torch.equal(key, cache.new_key) and torch.equal(value, cache.new_value))


def check_same_tokens(config: Config, layout, write_slots: Callable[..., None]) -> bool:
    """H2O: one gather-and-append step (both variants) and one in-place step, from the same
    tokens and victims, leave every (request, head) with the same tokens: the kept ones where
    they were (in cache order) and the new ones in the victims' places. Built with the timed
    classes at batch <= 2 (the full batch would double the memory of the largest configs)."""
    from vllm_kvprune import kernels

    small = dataclasses.replace(config, batch=min(config.batch, 2))
    gen = torch.Generator().manual_seed(1)
    victims = h2o_victim_positions(small, gen, steps=1)
    gather_cache = GatherAppendCache(small, gen, victims)
    paged = InPlaceCache(small, gen, layout, victims)
    batch, heads, tokens, dim = gather_cache.key.shape
    # The paged cache holds the contiguous cache's tokens; the new tokens are the same too.
    positions = torch.arange(tokens).expand(batch, tokens)
    all_slots = slots_of(paged.block_table, positions, small.block_size).reshape(-1)
    key, value = (t.transpose(1, 2).reshape(batch * tokens, heads, dim) for t in (gather_cache.key, gather_cache.value))
    write_slots(key, value, paged.kv_cache, all_slots, layout)
    paged.new_key, paged.new_value = (t.transpose(1, 2).reshape(batch * small.evict, heads, dim).contiguous()
                                      for t in (gather_cache.new_key, gather_cache.new_value))
    gathered = [tuple(t.clone() for t in gather_cache.step()), gather_cache.step_preallocated()]
    paged.step_with(write_slots)
    # Every position of every request, read back per head: [batch, heads, tokens, dim].
    key, value = (t.view(batch, tokens, heads, dim).transpose(1, 2)
                  for t in kernels.read_slots(paged.kv_cache, all_slots, layout))
    keep = keep_index(victims[0], tokens).unsqueeze(-1).expand(-1, -1, -1, dim)
    victim = victims[0].unsqueeze(-1).expand(-1, -1, -1, dim)
    kept = tokens - small.evict
    return all(torch.equal(torch.gather(paged_t, 2, keep), out[:, :, :kept])
               and torch.equal(torch.gather(paged_t, 2, victim), out[:, :, kept:])
               for out_key, out_value in gathered for paged_t, out in ((key, out_key), (value, out_value)))


def measure(config: Config, warmup: int, repeats: int, isa: str | None) -> dict[str, Any]:
    """Times every update path for one configuration; returns one result row."""
    from vllm_kvprune import kernels
    from vllm_kvprune.kernels import reference

    layout = kernels.probe_layout(config.torch_dtype, config.block_size, config.head_dim,
                                  isa or kernels.default_isa(config.torch_dtype, config.block_size, config.head_dim))
    gen = torch.Generator().manual_seed(0)
    baseline = BASELINE[config.policy]
    if config.policy == "h2o":
        victims = h2o_victim_positions(config, gen)
        baseline_cache: ShiftAppendCache | GatherAppendCache = GatherAppendCache(config, gen, victims)
        paged_cache = InPlaceCache(config, gen, layout, victims)
        # The same new tokens on both sides, token-major for write_slots.
        paged_cache.new_key, paged_cache.new_value = (
            t.transpose(1, 2).reshape(config.batch * config.evict, config.kv_heads, config.head_dim).contiguous()
            for t in (baseline_cache.new_key, baseline_cache.new_value))
    else:
        baseline_cache = ShiftAppendCache(config, gen)
        paged_cache = InPlaceCache(config, gen, layout)
    candidates: dict[str, Callable[[], object]] = {
        baseline: baseline_cache.step,
        f"{baseline}_prealloc": baseline_cache.step_preallocated,
        "inplace_torch": lambda: paged_cache.step_with(reference.write_slots),
    }
    if kernels.HAS_EXTENSION:
        candidates["inplace_cpp"] = lambda: paged_cache.step_with(kernels.write_slots)
    timings = common.time_round_robin(candidates, warmup, adaptive_repeats(candidates, repeats))
    row: dict[str, Any] = dataclasses.asdict(config)
    row.update({
        "baseline": baseline,
        "layout": layout.describe(),
        "tokens_written": config.batch * config.new_tokens,
        "cache_bytes_per_tensor": config.batch * config.kv_heads * config.cache_tokens * config.head_dim
        * baseline_cache.key.element_size(),
        "timings_us": timings,
        "correct": check_in_place(paged_cache),
    })
    del baseline_cache, paged_cache, candidates  # free the big tensors before the next check
    if config.policy == "h2o":
        row["same_tokens"] = check_same_tokens(config, layout, kernels.write_slots) and (
            not kernels.HAS_EXTENSION or check_same_tokens(config, layout, reference.write_slots))
        row["correct"] = row["correct"] and row["same_tokens"]
    baseline_us, prealloc_us = timings[baseline]["median"], timings[f"{baseline}_prealloc"]["median"]
    for path in ("inplace_cpp", "inplace_torch"):
        row[f"speedup_{path.removeprefix('inplace_')}"] = (baseline_us / timings[path]["median"] if path in timings
                                                            else None)
    # Against the copy alone (no allocation, no page faults): the data-movement part of the win.
    cpp = timings.get("inplace_cpp")
    row["speedup_cpp_vs_prealloc"] = prealloc_us / cpp["median"] if cpp else None
    return row


def adaptive_repeats(candidates: dict[str, Callable[[], object]], minimum: int) -> int:
    """At least `minimum` rounds; more (up to 200) when a round is short, so microsecond-scale
    configurations get a stable median for about half a second of work."""
    started = time.perf_counter()
    for step in candidates.values():
        step()
    round_s = time.perf_counter() - started
    return max(minimum, min(200, int(0.5 / max(round_s, 1e-6))))


def call_overhead_us(repeats: int = 2000) -> float | None:
    """Median wall time of a write_slots call that moves nothing: the Python + dispatch floor
    under every in-place step."""
    from vllm_kvprune import kernels

    if not kernels.HAS_EXTENSION:
        return None
    layout = kernels.vec_layout(torch.bfloat16, 128, 128)
    kv_cache = torch.zeros(1, 1, 128, 256, dtype=torch.bfloat16)
    empty = torch.zeros(0, 1, 128, dtype=torch.bfloat16)
    slots = torch.zeros(0, dtype=torch.int64)
    timings = common.time_round_robin({"empty": lambda: kernels.write_slots(empty, empty, kv_cache, slots, layout)},
                                      warmup=100, repeats=repeats)
    return timings["empty"]["median"]


def grid_for(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    if args.policy == "h2o" or args.paper_grid:
        return H2O_QUICK_GRID if args.quick else H2O_FULL_GRID
    return QUICK_GRID if args.quick else FULL_GRID


def build_configs(args: argparse.Namespace) -> list[Config]:
    grid = grid_for(args)
    dtypes = ["bfloat16", "float32"] if args.fp32 else ["bfloat16"]
    evicts = (args.block_size,) if args.policy == "paged_eviction" else grid["evict"]
    sinks = 0 if args.policy == "h2o" else args.sinks  # H2O keeps whatever has the mass
    return [
        Config(dtype, batch, heads, dim, evict, args.cache_tokens, sinks, args.block_size, args.policy)
        for dtype in dtypes
        for batch, heads, dim, evict in itertools.product(grid["batch"], grid["kv_heads"], grid["head_dim"], evicts)
    ]


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    baseline = rows[0]["baseline"] if rows else "shift"  # one policy per run
    headers = ["dtype", "batch", "heads", "dim", "evict", f"{baseline} us", f"{baseline}(prealloc) us",
               "in-place C++ us", "in-place torch us", "speed-up C++", "speed-up torch",
               "C++ vs prealloc"]

    def cell(row: dict[str, Any], path: str) -> str:
        timing = row["timings_us"].get(path)
        return f"{timing['median']:.1f}" if timing else "-"

    def ratio(value: float | None) -> str:
        return f"{value:.1f}x" if value is not None else "-"

    body = [
        [row["dtype"], str(row["batch"]), str(row["kv_heads"]), str(row["head_dim"]), str(row["evict"]),
         cell(row, row["baseline"]), cell(row, f"{row['baseline']}_prealloc"), cell(row, "inplace_cpp"),
         cell(row, "inplace_torch"),
         ratio(row["speedup_cpp"]), ratio(row["speedup_torch"]), ratio(row["speedup_cpp_vs_prealloc"])]
        for row in rows
    ]
    return headers, body


def plot_speedups(rows: list[dict[str, Any]], path: Path) -> None:
    figure, axes = common.new_figure(max(9.0, 0.5 * len(rows) + 2), 5.0)
    positions = list(range(len(rows)))
    baseline = rows[0]["baseline"]
    bars = (("speedup_cpp", f"in-place C++ op vs {BASELINE_LABEL[baseline]}"),
            ("speedup_torch", f"in-place torch reference vs {BASELINE_LABEL[baseline]}"),
            ("speedup_cpp_vs_prealloc", f"in-place C++ op vs {baseline} into preallocated tensors"))
    width = 0.8 / len(bars)
    for index, (key, label) in enumerate(bars):
        offset = (index - (len(bars) - 1) / 2) * width
        axes.bar([p + offset for p in positions], [row[key] or 0.0 for row in rows], width, label=label)
    if any(row["policy"] == "streaming" for row in rows):  # the target is StreamingLLM's
        axes.axhline(TARGET_SPEEDUP, color="black", linestyle="--", linewidth=1,
                     label=f"target {TARGET_SPEEDUP:.0f}x (batch 32, evict 64)")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_ylabel("speed-up (median step time)")
    axes.set_xticks(positions)
    dtypes = sorted({row["dtype"] for row in rows})
    axes.set_xticklabels([(f"{row['dtype'][:4]} " if len(dtypes) > 1 else "")
                          + f"B{row['batch']} H{row['kv_heads']} D{row['head_dim']} E{row['evict']}"
                          for row in rows], fontsize=7, rotation=60, ha="right")
    first = rows[0]
    policy = "H2O, victims per head" if first["policy"] == "h2o" else f"{first['policy']}, sinks {first['sinks']}"
    axes.set_title(f"KV-cache update step ({policy}, {'/'.join(dtypes)}, {first['cache_tokens']} cached tokens, "
                   f"{first['layout'].split(':')[0].split('/')[0]} layout, "
                   f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})", fontsize=10)
    axes.legend(fontsize=7)
    common.save_figure(figure, path)


def target_check(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        if row["batch"] == 32 and row["evict"] == 64 and row["policy"] == "streaming" and row["speedup_cpp"] is not None:
            verdict = "meets" if row["speedup_cpp"] >= TARGET_SPEEDUP else "MISSES"
            lines.append(f"{row['dtype']} B32 H{row['kv_heads']} D{row['head_dim']} E64: "
                         f"{row['speedup_cpp']:.1f}x {verdict} the {TARGET_SPEEDUP:.0f}x target")
    return lines


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="cost of one KV-cache update step: EQUIP in place vs shift-and-append",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON results path; the plot goes next to it (.png)")
    parser.add_argument("--quick", action="store_true", help="smaller grid and fewer repetitions")
    parser.add_argument("--fp32", action="store_true", help="also run float32 (default: bfloat16 only)")
    parser.add_argument("--repeats", type=int, default=None, help="minimum timed repetitions (default 10, quick 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    parser.add_argument("--cache-tokens", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4, help="StreamingLLM sink tokens (streaming only)")
    parser.add_argument("--policy", choices=("streaming", "paged_eviction", "h2o"), default="streaming",
                        help="the eviction whose update step is timed (default streaming); h2o has its own grid")
    parser.add_argument("--paper-grid", action="store_true", help="streaming on EQUIP's Table 6 grid (64/128 heads)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--isa", default=None,
                        help="cache layout to probe (vec, amx, ...); default: what vLLM picks on this machine")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    torch.set_num_threads(args.threads or machine.usable_cores())
    repeats = args.repeats or (3 if args.quick else 10)
    configs = build_configs(args)
    load_before = os.getloadavg()
    if torch.get_num_threads() > 1 and load_before[0] > 0.5 * machine.usable_cores():
        print(f"warning: load average {load_before[0]:.1f} on {machine.usable_cores()} cores; with "
              f"{torch.get_num_threads()} threads every parallel region may wait for a busy core, "
              "so timings can be inflated by milliseconds (compare with --threads 1)")
    rows = [measure(config, args.warmup, repeats, args.isa)
            for config in tqdm(configs, desc="kv-update", unit="config")]
    headers, body = table_rows(rows)
    common.print_table(headers, body)
    checks = target_check(rows)
    print("\n".join(checks))
    out = Path(args.out)
    from vllm_kvprune import kernels

    settings = {"grid": grid_for(args), "min_repeats": repeats, "warmup": args.warmup,
                "extension_isa": kernels.extension_isa(),
                "threads": torch.get_num_threads(), "call_overhead_us": call_overhead_us(),
                "load_average_before": list(load_before), "isa": args.isa}
    settings["policy"] = args.policy
    common.write_json(out, NAME, settings, rows, target_check=checks)
    plot_speedups(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(row["correct"] for row in rows) else 1
