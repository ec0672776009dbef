"""What the GPU benchmarks share: the shapes they time at, the device they run on, and how a
case times its candidates (`Case`), each checked against torch before it is timed."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Shapes:
    batch: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    seq_len: int  # tokens per request (cache tokens for kv-update)
    evict: tuple[int, ...]  # tokens replaced per request and step (kv-update)
    block_size: int
    samples: int  # GVote's synthetic queries
    prompt: int  # GVote's prompt keys
    layers: int  # PagedEviction's block-means rows


FULL = Shapes(32, 8, 4, 128, 4096, (1, 64), 16, 32, 8192, 30)
TINY = Shapes(2, 2, 2, 32, 64, (1, 4), 16, 4, 64, 2)


def bench_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("gpu-kernels needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 with --tiny to check the script")
    return "cpu"


def time_ms(call: Callable[[], Any], device: str) -> float:
    """Median time of one call: Triton's do_bench (CUDA events, cache flushed) on a GPU."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(call, warmup=10, rep=60, return_mode="median"))
    call()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


class Case:
    """Collects one case's rows: each candidate's time and its deviation from torch."""

    def __init__(self, name: str, device: str, rows: list[dict[str, Any]]) -> None:
        self.name, self.device, self.rows = name, device, rows
        self.baseline_ms: float | None = None

    def time(self, label: str, call: Callable[[], Any], max_error: float | None = None, baseline: bool = False,
             **extra: Any) -> float:
        milliseconds = time_ms(call, self.device)
        if baseline:
            self.baseline_ms = milliseconds
        row = {"case": self.name, "candidate": label, "ms": milliseconds, "max_abs_error": max_error, **extra}
        row["speedup_vs_torch"] = self.baseline_ms / milliseconds if self.baseline_ms else None
        self.rows.append(row)
        error = "" if max_error is None else f", max |error| vs torch {max_error:.2e}"
        print(f"  {self.name}: {label}: {milliseconds:.4f} ms{error}", flush=True)
        return milliseconds


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())
