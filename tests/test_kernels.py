"""Slot ops on vLLM's CPU paged KV cache: C++ vs torch reference vs vLLM's own cache writer.

vLLM's ``cpu_attn_reshape_and_cache`` is the independent oracle wherever one is possible: the
expected caches below are built by vLLM writing known tokens, never by our layout code, so a
wrong index map or kernel cannot agree with itself. Comparisons are bit-exact (integer views).
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

vllm_ops = pytest.importorskip("vllm._custom_ops")

from vllm_kvprune import kernels  # noqa: E402
from vllm_kvprune.kernels import reference  # noqa: E402
from vllm_kvprune.kernels.layout import default_isa, probe_layout  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
BLOCK_SIZES = (32, 64, 128)
HEAD_SIZES = (32, 64, 128)
HEAD_COUNTS = (1, 2, 3, 8)
MACHINE_HAS_AMX = torch.cpu._is_amx_tile_supported()


@pytest.fixture(autouse=True)
def single_thread():
    """One torch thread for the small cases: on a shared machine every parallel region can
    stall for a scheduler tick. The parallel paths have their own test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


needs_extension = pytest.mark.skipif(
    not kernels.HAS_EXTENSION and os.environ.get("KVPRUNE_NO_EXT") == "1",
    reason="built with KVPRUNE_NO_EXT=1",
)


def _make_configs(seed: int = 1234) -> list[tuple[torch.dtype, int, int, int, int]]:
    """(dtype, block_size, head_size, num_heads, num_tokens): every dtype x bs x D once, heads
    cycling over HEAD_COUNTS in shuffled order, T random up to 300 (edge sizes included)."""
    rng = random.Random(seed)
    combos = list(itertools.product(DTYPES, BLOCK_SIZES, HEAD_SIZES))
    heads = [HEAD_COUNTS[i % len(HEAD_COUNTS)] for i in range(len(combos))]
    rng.shuffle(heads)
    token_counts = [1, 300] + [rng.randint(2, 299) for _ in range(len(combos) - 2)]
    rng.shuffle(token_counts)
    return [(dt, bs, d, h, t) for (dt, bs, d), h, t in zip(combos, heads, token_counts)]


CONFIGS = _make_configs()


def _config_id(config: tuple) -> str:
    dtype, block_size, head_size, num_heads, num_tokens = config
    return f"{str(dtype)[6:]}-bs{block_size}-D{head_size}-H{num_heads}-T{num_tokens}"


def _seed(config: tuple) -> int:
    """Stable across processes (str hashes are salted)."""
    return zlib.crc32(_config_id(config).encode())


def _isas(dtype: torch.dtype, block_size: int, head_size: int) -> list[str]:
    """The ISA vLLM picks here, plus `vec` (what machines without AMX pick) if different."""
    picked = default_isa(dtype, block_size, head_size)
    return [picked] if picked == "vec" else [picked, "vec"]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view, so comparisons are bit-exact (-0.0 vs 0.0, NaN payloads)."""
    return tensor.view(torch.int32 if tensor.element_size() == 4 else torch.int16)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    mismatched = (_bits(actual) != _bits(expected)).sum().item()
    assert mismatched == 0, f"{mismatched} of {actual.numel()} elements differ"


def _random_cache(num_blocks: int, num_heads: int, block_size: int, head_size: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random (not zero) background, so a stray write of any value is visible."""
    return torch.randn(num_blocks, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)


def _random_tokens(num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    return key, value


def _vllm_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """vLLM's own cache update, exactly as CPUAttentionBackendImpl.do_kv_cache_update calls it."""
    num_blocks, num_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, num_heads, 2 * block_size, -1).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def _vllm_write_per_head(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, per_head_slots: torch.Tensor, isa: str) -> None:
    """Oracle for [T, H] slots: for each head, let vLLM write all heads at that head's slots
    into a scratch copy and keep only that head's pages."""
    for head in range(kv_cache.shape[1]):
        scratch = kv_cache.clone()
        _vllm_write(key, value, scratch, per_head_slots[:, head].contiguous(), isa)
        kv_cache[:, head] = scratch[:, head]


SLOT_PATTERNS = ("scattered", "runs")


def _geometry(config: tuple, gen: torch.Generator, pattern: str = "scattered") -> tuple[int, torch.Tensor]:
    """num_blocks with spare room, and T distinct slots.

    scattered: a random subset in random order, about 1 in 8 set to -1 (per-token paths).
    runs: consecutive slots in segments of 1..80 tokens, segments shuffled, 1 in 50 set to -1:
    what EQUIP ring updates and prefill chunks look like, and what the register-transpose
    paths of the C++ ops need (>= 16 consecutive slots in one tile).
    """
    _, block_size, _, _, num_tokens = config
    num_blocks = -(-num_tokens // block_size) + 2
    num_slots = num_blocks * block_size
    if pattern == "scattered":
        slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
        slots[torch.rand(num_tokens, generator=gen) < 0.125] = -1
        return num_blocks, slots
    start = int(torch.randint(num_slots, (1,), generator=gen))
    ring = (start + torch.arange(num_tokens)) % num_slots
    lengths = torch.randint(1, 81, (num_tokens,), generator=gen).tolist()
    segments, first = [], 0
    for length in lengths:
        if first >= num_tokens:
            break
        segments.append(ring[first : first + length])
        first += length
    order = torch.randperm(len(segments), generator=gen).tolist()
    slots = torch.cat([segments[i] for i in order])
    slots[torch.rand(num_tokens, generator=gen) < 0.02] = -1
    return num_blocks, slots


def _per_head_slots(num_tokens: int, num_heads: int, num_slots: int, gen: torch.Generator, skip_fraction: float = 0.125) -> torch.Tensor:
    """Distinct slots within each head (duplicates are unspecified), different across heads."""
    columns = [torch.randperm(num_slots, generator=gen)[:num_tokens] for _ in range(num_heads)]
    slots = torch.stack(columns, dim=1)
    slots[torch.rand(num_tokens, num_heads, generator=gen) < skip_fraction] = -1
    return slots


@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_write_slots_matches_vllm_writer(config: tuple, pattern: str) -> None:
    """Pins our layout to vLLM's: same cache bytes as cpu_attn_reshape_and_cache, for the
    ISA vLLM selects on this machine and for `vec`; torch path and C++ path alike."""
    dtype, block_size, head_size, num_heads, num_tokens = config
    gen = torch.Generator().manual_seed(_seed(config))
    num_blocks, slots = _geometry(config, gen, pattern)
    key, value = _random_tokens(num_tokens, num_heads, head_size, dtype, gen)
    background = _random_cache(num_blocks, num_heads, block_size, head_size, dtype, gen)
    for isa in _isas(dtype, block_size, head_size):
        layout = probe_layout(dtype, block_size, head_size, isa)
        expected = background.clone()
        _vllm_write(key, value, expected, slots, isa)
        via_reference = background.clone()
        reference.write_slots(key, value, via_reference, slots, layout)
        assert_bits_equal(via_reference, expected)
        via_api = background.clone()
        kernels.write_slots(key, value, via_api, slots, layout)
        assert_bits_equal(via_api, expected)


@needs_extension
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_extension_equals_reference(config: tuple, pattern: str) -> None:
    """Every C++ op, shared and per-head slots, against the torch reference, bit for bit."""
    assert kernels.HAS_EXTENSION, "vllm_kvprune._C failed to import (see the log warning)"
    dtype, block_size, head_size, num_heads, num_tokens = config
    gen = torch.Generator().manual_seed(_seed(config) + 1)
    num_blocks, slots = _geometry(config, gen, pattern)
    if pattern == "runs":  # each head its own ring segment order
        head_slots = torch.stack([slots[torch.randperm(num_tokens, generator=gen)] if h % 2 else slots for h in range(num_heads)], dim=1)
    else:
        head_slots = _per_head_slots(num_tokens, num_heads, num_blocks * block_size, gen)
    key, value = _random_tokens(num_tokens, num_heads, head_size, dtype, gen)
    background = _random_cache(num_blocks, num_heads, block_size, head_size, dtype, gen)
    for isa in _isas(dtype, block_size, head_size):
        layout = probe_layout(dtype, block_size, head_size, isa)
        assert layout.tiling is not None, f"{isa} layout no longer tiled: fast path unused"
        # The index-map path ([] tiling) treats runs like any slots: scattered ones suffice.
        tilings = (layout.tiling_list, []) if pattern == "scattered" else (layout.tiling_list,)
        for tiling in tilings:
            _compare_extension_ops(layout, tiling, key, value, background, slots, head_slots, gen)


@needs_extension
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extension_parallel_paths(dtype: torch.dtype) -> None:
    """Enough tokens for at::parallel_for to split the work over every thread: same bytes as
    the reference, for shared and per-head slots, runs and scattered."""
    torch.set_num_threads(max(2, torch.get_num_threads()))
    config = (dtype, 128, 128, 8, 2048)
    gen = torch.Generator().manual_seed(99)
    num_blocks, run_slots = _geometry(config, gen, "runs")
    scattered = _per_head_slots(2048, 8, num_blocks * 128, gen)
    key, value = _random_tokens(2048, 8, 128, dtype, gen)
    background = _random_cache(num_blocks, 8, 128, 128, dtype, gen)
    for isa in _isas(dtype, 128, 128):
        layout = probe_layout(dtype, 128, 128, isa)
        _compare_extension_ops(layout, layout.tiling_list, key, value, background, run_slots, scattered, gen)


def _compare_extension_ops(
    layout, tiling: list[int], key: torch.Tensor, value: torch.Tensor, background: torch.Tensor,
    slots: torch.Tensor, head_slots: torch.Tensor, gen: torch.Generator,
) -> None:
    """write/read with shared and per-head slots, then an overlapping per-head copy."""
    ops = torch.ops.kvprune
    maps = (layout.key_offsets, layout.value_offsets, tiling)
    for write_to in (slots, head_slots):
        via_cpp, via_torch = background.clone(), background.clone()
        ops.write_slots(key, value, via_cpp, write_to, *maps)
        reference.write_slots(key, value, via_torch, write_to, layout)
        assert_bits_equal(via_cpp, via_torch)
        read_cpp = ops.read_slots(via_cpp, write_to, *maps)
        read_torch = reference.read_slots(via_torch, write_to, layout)
        for got, want in zip(read_cpp, read_torch):
            assert_bits_equal(got, want)
    num_tokens, num_heads = head_slots.shape
    num_slots = background.shape[0] * layout.block_size
    src = _per_head_slots(num_tokens, num_heads, num_slots, gen, skip_fraction=0.0)
    dst = torch.roll(src, shifts=1, dims=0)  # overlapping: every dst is some other src
    dst[::5] = -1
    via_cpp, via_torch = background.clone(), background.clone()
    ops.copy_slots(via_cpp, src, dst, *maps)
    reference.copy_slots(via_torch, src, dst, layout)
    assert_bits_equal(via_cpp, via_torch)


@pytest.mark.parametrize("config", CONFIGS[::3], ids=_config_id)
def test_per_head_write_touches_only_its_slots(config: tuple) -> None:
    """Each head lands in its own slot; the whole rest of the cache is unchanged."""
    dtype, block_size, head_size, num_heads, num_tokens = config
    gen = torch.Generator().manual_seed(7)
    num_blocks, _ = _geometry(config, gen)
    head_slots = _per_head_slots(num_tokens, num_heads, num_blocks * block_size, gen)
    key, value = _random_tokens(num_tokens, num_heads, head_size, dtype, gen)
    background = _random_cache(num_blocks, num_heads, block_size, head_size, dtype, gen)
    for isa in _isas(dtype, block_size, head_size):
        layout = probe_layout(dtype, block_size, head_size, isa)
        expected = background.clone()
        _vllm_write_per_head(key, value, expected, head_slots, isa)
        actual = background.clone()
        kernels.write_slots(key, value, actual, head_slots, layout)
        assert_bits_equal(actual, expected)
        changed = int((_bits(actual) != _bits(background)).sum())
        assert changed <= 2 * head_size * int((head_slots >= 0).sum())


@pytest.mark.parametrize("per_head", [False, True], ids=["shared-slots", "per-head-slots"])
@pytest.mark.parametrize("config", CONFIGS[1::3], ids=_config_id)
def test_copy_slots_overlapping_compaction(config: tuple, per_head: bool) -> None:
    """Compaction and shifts with src/dst overlap, against caches vLLM wrote from scratch."""
    dtype, block_size, head_size, num_heads, _ = config
    num_blocks = 4
    num_slots = num_blocks * block_size
    gen = torch.Generator().manual_seed(11)
    isa = default_isa(dtype, block_size, head_size)
    layout = probe_layout(dtype, block_size, head_size, isa)
    # Logical contents: token k_all[s, h] is what slot s holds for head h.
    k_all, v_all = _random_tokens(num_slots, num_heads, head_size, dtype, gen)
    all_slots = torch.arange(num_slots)
    cache = torch.empty(num_blocks, num_heads, block_size, 2 * head_size, dtype=dtype)
    _vllm_write(k_all, v_all, cache, all_slots, isa)

    if per_head:  # each head keeps a different random subset, packed to the front
        src = torch.stack([torch.sort(torch.randperm(num_slots, generator=gen)[: num_slots // 2]).values for _ in range(num_heads)], dim=1)
        dst = all_slots[: num_slots // 2].unsqueeze(1).expand(-1, num_heads).contiguous()
    else:  # shift right by 5 slots: a naive in-order copy would read already-overwritten slots
        src = all_slots[: num_slots - 5]
        dst = src + 5
    kernels.copy_slots(cache, src, dst, layout)

    head_src = src if per_head else src.unsqueeze(1).expand(-1, num_heads)
    head_dst = dst if per_head else dst.unsqueeze(1).expand(-1, num_heads)
    k_want, v_want = k_all.clone(), v_all.clone()
    heads = torch.arange(num_heads).expand_as(head_src)
    k_want[head_dst, heads] = k_all[head_src, heads]
    v_want[head_dst, heads] = v_all[head_src, heads]
    expected = torch.empty_like(cache)
    _vllm_write(k_want, v_want, expected, all_slots, isa)
    assert_bits_equal(cache, expected)


@pytest.mark.parametrize("config", CONFIGS[2::3], ids=_config_id)
def test_read_slots_round_trip(config: tuple) -> None:
    """What vLLM wrote is read back exactly; -1 reads as zeros; per-head slots read per head."""
    dtype, block_size, head_size, num_heads, num_tokens = config
    gen = torch.Generator().manual_seed(3)
    num_blocks, slots = _geometry(config, gen)
    key, value = _random_tokens(num_tokens, num_heads, head_size, dtype, gen)
    for isa in _isas(dtype, block_size, head_size):
        layout = probe_layout(dtype, block_size, head_size, isa)
        cache = _random_cache(num_blocks, num_heads, block_size, head_size, dtype, gen)
        _vllm_write(key, value, cache, slots, isa)
        got_key, got_value = kernels.read_slots(cache, slots, layout)
        valid = slots >= 0
        assert_bits_equal(got_key[valid], key[valid])
        assert_bits_equal(got_value[valid], value[valid])
        assert not got_key[~valid].any() and not got_value[~valid].any()
        # Per-head: head h of row i reads the token written at slot of row perm[i], head h.
        perm = torch.stack([torch.randperm(num_tokens, generator=gen) for _ in range(num_heads)], dim=1)
        head_slots = torch.gather(slots.unsqueeze(1).expand(-1, num_heads), 0, perm)
        got_key, got_value = kernels.read_slots(cache, head_slots, layout)
        heads = torch.arange(num_heads).expand_as(perm)
        valid = head_slots >= 0
        assert_bits_equal(got_key[valid], key[perm, heads][valid])
        assert_bits_equal(got_value[valid], value[perm, heads][valid])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_skipped_slots_change_nothing(dtype: torch.dtype) -> None:
    layout = probe_layout(dtype, 32, 64, default_isa(dtype, 32, 64))
    gen = torch.Generator().manual_seed(5)
    cache = _random_cache(3, 2, 32, 64, dtype, gen)
    before = cache.clone()
    key, value = _random_tokens(40, 2, 64, dtype, gen)
    kernels.write_slots(key, value, cache, torch.full((40,), -1), layout)
    kernels.write_slots(key, value, cache, torch.full((40, 2), -1), layout)
    kernels.copy_slots(cache, torch.arange(10), torch.full((10,), -1), layout)
    assert_bits_equal(cache, before)


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_probed_vec_layout_is_transposed_key(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    """VLLM_NOTES D2: per page, K as [D, bs] (transposed), then V as [bs, D]."""
    layout = probe_layout(dtype, block_size, head_size, "vec")
    token = torch.arange(block_size).unsqueeze(1)
    dim = torch.arange(head_size).unsqueeze(0)
    assert torch.equal(layout.key_offsets, dim * block_size + token)
    assert torch.equal(layout.value_offsets, block_size * head_size + token * head_size + dim)
    assert layout.is_vec_layout and layout.tiling == (block_size, 1, head_size, 1)


@pytest.mark.skipif(not MACHINE_HAS_AMX, reason="vLLM picks the amx ISA only on AMX CPUs")
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_probed_amx_layout_is_vnni_tiled(block_size: int, head_size: int) -> None:
    """Found by probing vLLM 0.32 (bf16, amx): K in 16-token tiles of [D/2, 16, 2] (pairs of
    dims per token); V in 16-dim column strips of [bs/2, 16, 2] (pairs of tokens per dim)."""
    assert default_isa(torch.bfloat16, block_size, head_size) == "amx"
    layout = probe_layout(torch.bfloat16, block_size, head_size, "amx")
    token = torch.arange(block_size).unsqueeze(1)
    dim = torch.arange(head_size).unsqueeze(0)
    key_offsets = (token // 16) * 16 * head_size + (dim // 2) * 32 + (token % 16) * 2 + dim % 2
    value_offsets = block_size * head_size + (dim // 16) * 16 * block_size + (token // 2) * 32 + (dim % 16) * 2 + token % 2
    assert torch.equal(layout.key_offsets, key_offsets)
    assert torch.equal(layout.value_offsets, value_offsets)
    assert layout.tiling == (16, 2, 16, 2) and not layout.is_vec_layout


@needs_extension
def test_extension_rejects_bad_input_clearly() -> None:
    layout = probe_layout(torch.float32, 32, 32, "vec")
    cache = torch.zeros(2, 2, 32, 64)
    key = torch.zeros(3, 2, 32)
    with pytest.raises(RuntimeError, match="holds slot 64"):
        kernels.write_slots(key, key, cache, torch.tensor([0, 64, 1]), layout)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.write_slots(key.bfloat16(), key.bfloat16(), cache, torch.tensor([0, 1, 2]), layout)
    with pytest.raises(RuntimeError, match="num_kv_heads=2"):
        kernels.write_slots(key[:, :1], key[:, :1], cache, torch.tensor([0, 1, 2]), layout)
    with pytest.raises(RuntimeError, match="source -1"):
        kernels.copy_slots(cache, torch.tensor([-1]), torch.tensor([3]), layout)


def test_missing_extension_falls_back_with_one_warning() -> None:
    """Without _C the package still works (torch path) and says so exactly once."""
    script = textwrap.dedent(
        """
        import logging, sys, torch
        sys.modules["vllm_kvprune._C"] = None  # makes `import vllm_kvprune._C` fail
        records = []
        handler = logging.Handler(); handler.emit = records.append
        logging.getLogger("vllm_kvprune").addHandler(handler)
        from vllm_kvprune import kernels
        layout = kernels.vec_layout(torch.float32, 32, 32)
        cache = torch.zeros(1, 1, 32, 64)
        key = torch.ones(1, 1, 32)
        kernels.write_slots(key, key, cache, torch.tensor([3]), layout)
        warnings = [r for r in records if r.levelno == logging.WARNING]
        assert not kernels.HAS_EXTENSION
        assert len(warnings) == 1 and "fall back" in warnings[0].getMessage(), warnings
        assert cache[0, 0].view(-1)[layout.key_offsets[3]].eq(1).all()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
