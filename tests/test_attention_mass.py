"""attention_mass (H2O heavy-hitter scores): C++ op vs torch reference, reference vs dense.

The torch reference (gather the row's K/V with read_slots, softmax in fp32) is checked once
against plain dense attention on contiguous K/V that were written into the paged cache with
write_slots; the C++ op is then compared with the reference over GQA groups, head sizes,
block sizes, dtypes, the layouts vLLM uses here (vec, amx) and the index-map path.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("vllm._custom_ops")

from vllm_kvprune import kernels  # noqa: E402
from vllm_kvprune.kernels import reference  # noqa: E402
from vllm_kvprune.kernels.layout import default_isa, probe_layout  # noqa: E402

# A missing extension fails these tests (and test_kernels' build check), unless the package was
# built without it on purpose (KVPRUNE_NO_EXT=1): then only the torch path is tested.
needs_extension = pytest.mark.skipif(not kernels.HAS_EXTENSION and os.environ.get("KVPRUNE_NO_EXT") == "1",
                                     reason="built with KVPRUNE_NO_EXT=1")

# (dtype, block_size, head_size, num_kv_heads, group = query heads per KV head)
CONFIGS = [
    (torch.float32, 16, 64, 2, 1),
    (torch.float32, 16, 128, 1, 3),
    (torch.float32, 32, 64, 3, 3),
    (torch.float32, 32, 128, 1, 8),
    (torch.float32, 64, 64, 2, 4),
    (torch.float32, 64, 128, 2, 2),
    (torch.bfloat16, 32, 64, 3, 3),  # the real model's attention shape
    (torch.bfloat16, 32, 128, 1, 8),
    (torch.bfloat16, 64, 64, 4, 1),
    (torch.bfloat16, 64, 128, 2, 2),
    (torch.bfloat16, 32, 64, 2, 4),
]

# Mass and fp32 outputs: same inputs, fp32 arithmetic in another order (and a polynomial exp).
MASS_TOL = dict(rtol=1e-5, atol=1e-6)
OUT_TOL = dict(rtol=1e-5, atol=2e-6)


def _tolerance(base: dict, scale: float, head_size: int) -> dict:
    """A logit's fp32 rounding error grows with scale * sum_d |q_d k_d| (~ scale * D for unit
    normal data) and moves p, and so mass and output, by about as much; peaked softmaxes
    (scale 1, D 128: logits of +-40) need that slack, flat ones keep the base bound."""
    return dict(rtol=base["rtol"], atol=base["atol"] + 2e-7 * scale * head_size)


def _config_id(config: tuple) -> str:
    dtype, block_size, head_size, heads, group = config
    return f"{str(dtype)[6:]}-bs{block_size}-D{head_size}-H{heads}-G{group}"


@pytest.fixture(autouse=True)
def single_thread():
    """One torch thread (the machine is shared); the parallel test sets its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _isas(dtype: torch.dtype, block_size: int, head_size: int) -> list[str]:
    picked = default_isa(dtype, block_size, head_size)
    return [picked] if picked in ("vec", "vec16") else [picked, "vec"]


def _block_table(num_rows: int, blocks_per_row: int, num_blocks: int, gen: torch.Generator, dtype=torch.int32) -> torch.Tensor:
    """Distinct blocks in shuffled order, one spare column (never read) per row."""
    blocks = torch.randperm(num_blocks, generator=gen)[: num_rows * (blocks_per_row + 1)]
    return blocks.view(num_rows, blocks_per_row + 1).to(dtype)


def _queries(block_size: int, max_blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_rows, key_counts): decode rows with 1, bs - 1, bs, a non-multiple and the whole
    table, plus a prefill chunk of 5 causal queries on one row; shuffled so a row's queries
    are not adjacent."""
    capacity = max_blocks * block_size
    odd = int(torch.randint(block_size + 1, capacity - 6, (1,), generator=gen))
    counts = [1, block_size - 1, block_size, odd, capacity]
    rows = list(range(len(counts)))
    chunk_end = int(torch.randint(10, capacity + 1, (1,), generator=gen))
    counts += [chunk_end - 4 + j for j in range(5)]
    rows += [len(rows)] * 5
    order = torch.randperm(len(rows), generator=gen)
    return torch.tensor(rows)[order], torch.tensor(counts)[order]


def _fused_query(num_queries: int, query_heads: int, num_heads: int, head_size: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[N, Hq, D] as a strided view of a fused QKV output, like vLLM hands it over."""
    qkv = torch.randn(num_queries, (query_heads + 2 * num_heads) * head_size, generator=gen).to(dtype)
    return qkv[:, : query_heads * head_size].view(num_queries, query_heads, head_size)


def _run_both(query, cache, layout, tiling, table, rows, counts, scale, mass0, out_dtype):
    """(mass, output) from the C++ op (with `tiling`) and from the reference."""
    ops = torch.ops.kvprune
    mass_cpp, mass_ref = mass0.clone(), mass0.clone()
    out_cpp = torch.full(query.shape, float("nan"), dtype=out_dtype)
    out_ref = torch.zeros(query.shape, dtype=out_dtype)
    ops.attention_mass(query, cache, table, rows, counts, scale, mass_cpp, out_cpp, layout.key_offsets, layout.value_offsets, tiling)
    reference.attention_mass(query, cache, layout, table, rows, counts, scale, mass_ref, out_ref)
    return mass_cpp, out_cpp, mass_ref, out_ref


@needs_extension
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_extension_equals_reference(config: tuple) -> None:
    dtype, block_size, head_size, num_heads, group = config
    gen = torch.Generator().manual_seed(zlib.crc32(_config_id(config).encode()))
    query_heads = num_heads * group
    max_blocks = 5 if block_size <= 32 else 3
    num_blocks = 6 * (max_blocks + 1) + 3
    table = _block_table(6, max_blocks, num_blocks, gen)
    rows, counts = _queries(block_size, max_blocks, gen)
    query = _fused_query(len(rows), query_heads, num_heads, head_size, dtype, gen)
    cache = torch.randn(num_blocks, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    mass0 = torch.rand(num_heads, num_blocks * block_size, generator=gen)  # accumulated into
    for isa in _isas(dtype, block_size, head_size):
        layout = probe_layout(dtype, block_size, head_size, isa)
        assert layout.tiling is not None, f"{isa} layout is no longer tiled: fast path unused"
        for tiling in (layout.tiling_list, []):
            for scale in (head_size**-0.5, 1.0):  # flat and peaked distributions
                mass_cpp, out_cpp, mass_ref, out_ref = _run_both(
                    query, cache, layout, tiling, table, rows, counts, scale, mass0, torch.float32
                )
                where = f"isa={isa} tiling={tiling} scale={scale:.3f}"
                mass_tol, out_tol = (_tolerance(t, scale, head_size) for t in (MASS_TOL, OUT_TOL))
                torch.testing.assert_close(mass_cpp, mass_ref, **mass_tol, msg=lambda m: f"{where}: mass {m}")
                torch.testing.assert_close(out_cpp, out_ref, **out_tol, msg=lambda m: f"{where}: output {m}")
            # The mass gained exactly one unit per (query, query head): p sums to 1.
            gained = (mass_cpp - mass0).sum().item()
            assert abs(gained - len(rows) * query_heads) < 1e-3 * len(rows) * query_heads
            # Without output: the same mass, bit for bit (output is only an extra product).
            mass_only = mass0.clone()
            torch.ops.kvprune.attention_mass(
                query, cache, table, rows, counts, scale, mass_only, None,  # scale of the last run
                layout.key_offsets, layout.value_offsets, tiling,
            )
            assert torch.equal(mass_only, mass_cpp), f"isa={isa} tiling={tiling}: mass differs without output"


@needs_extension
def test_extension_output_dtypes_and_int64_table() -> None:
    """bf16 output (rounded once), fp32 query on a bf16 cache, an int64 block table, a query
    with no keys (zero output, no mass) and the kernels.attention_mass wrapper."""
    gen = torch.Generator().manual_seed(21)
    dtype, block_size, head_size, num_heads, group = torch.bfloat16, 32, 64, 3, 3
    layout = probe_layout(dtype, block_size, head_size, default_isa(dtype, block_size, head_size))
    table = _block_table(6, 5, 40, gen, dtype=torch.int64)
    rows, counts = _queries(block_size, 5, gen)
    counts[0] = 0
    cache = torch.randn(40, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    mass0 = torch.rand(num_heads, 40 * block_size, generator=gen)
    for query_dtype in (torch.bfloat16, torch.float32):
        query = _fused_query(len(rows), num_heads * group, num_heads, head_size, query_dtype, gen)
        mass_ref, out_ref = mass0.clone(), torch.zeros(query.shape)
        reference.attention_mass(query, cache, layout, table, rows, counts, 0.125, mass_ref, out_ref)
        assert not out_ref[0].any()
        mass_api, out_api = mass0.clone(), torch.full(query.shape, float("nan"), dtype=query_dtype)
        kernels.attention_mass(query, cache, layout, table, rows, counts, 0.125, mass_api, out_api)
        torch.testing.assert_close(mass_api, mass_ref, **MASS_TOL)
        assert out_api.dtype == query_dtype and not out_api[0].any()
        torch.testing.assert_close(out_api.float(), out_ref.to(query_dtype).float(), rtol=1e-2, atol=1e-3)


@needs_extension
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("group", (3, 1), ids=("G3", "G1"))
def test_long_prompt_chunk_split_over_threads(dtype: torch.dtype, group: int) -> None:
    """A prompt's later chunk beside one decode row, on two threads: the chunk's queries
    are scored in blocks and split into parts that add their mass through buffers of their
    own (`csrc/cpu/attention_mass.cpp`); mass and output equal the reference's, and the mass
    gained is one unit per query and query head."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(11)
    block_size, head_size, num_heads = 32, 64, 3
    layout = probe_layout(dtype, block_size, head_size, default_isa(dtype, block_size, head_size))
    max_blocks, num_blocks = 26, 3 * 27 + 2
    cache = torch.randn(num_blocks, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    mass0 = torch.rand(num_heads, num_blocks * block_size, generator=gen)
    table = _block_table(3, max_blocks, num_blocks, gen)
    cached, chunk = 201, 611  # a chunk after 201 cached prompt tokens, causal
    rows = torch.tensor([1] + [0] * chunk)
    counts = torch.tensor([700] + [cached + 1 + j for j in range(chunk)])
    query = _fused_query(len(rows), num_heads * group, num_heads, head_size, dtype, gen)
    mass_cpp, out_cpp, mass_ref, out_ref = _run_both(
        query, cache, layout, layout.tiling_list, table, rows, counts, head_size**-0.5, mass0, torch.float32
    )
    torch.testing.assert_close(mass_cpp, mass_ref, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(out_cpp, out_ref, **OUT_TOL)
    gained = (mass_cpp - mass0).sum().item()
    assert abs(gained - len(rows) * num_heads * group) < 1e-4 * len(rows) * num_heads * group


@needs_extension
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_extension_parallel_and_shared_blocks(dtype: torch.dtype) -> None:
    """Two threads over many rows; then rows whose tables share blocks (prefix caching), where
    two rows add to the same mass entries: the kernel must not lose any of those additions."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(5)
    block_size, head_size, num_heads, group = 32, 64, 3, 3
    layout = probe_layout(dtype, block_size, head_size, default_isa(dtype, block_size, head_size))
    num_rows, max_blocks, num_blocks = 24, 8, 24 * 9
    cache = torch.randn(num_blocks, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    mass0 = torch.rand(num_heads, num_blocks * block_size, generator=gen)
    rows = torch.randperm(num_rows, generator=gen)
    counts = torch.randint(200, max_blocks * block_size + 1, (num_rows,), generator=gen)
    query = _fused_query(num_rows, num_heads * group, num_heads, head_size, dtype, gen)
    distinct = _block_table(num_rows, max_blocks, num_blocks, gen)
    shared = distinct.clone()
    shared[:, :3] = distinct[0, :3]  # a common 3-block prefix
    for table in (distinct, shared):
        mass_cpp, out_cpp, mass_ref, out_ref = _run_both(
            query, cache, layout, layout.tiling_list, table, rows, counts, 0.125, mass0, torch.float32
        )
        torch.testing.assert_close(mass_cpp, mass_ref, **MASS_TOL)
        torch.testing.assert_close(out_cpp, out_ref, **OUT_TOL)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_reference_equals_dense_attention(dtype: torch.dtype) -> None:
    """The oracle itself: contiguous per-row K/V written into the paged cache with write_slots
    (through shuffled block tables), against torch.softmax(q @ k.T * scale) per head."""
    gen = torch.Generator().manual_seed(17)
    block_size, head_size, num_heads, group = 32, 64, 2, 3
    query_heads = num_heads * group
    layout = probe_layout(dtype, block_size, head_size, default_isa(dtype, block_size, head_size))
    num_rows, max_blocks, num_blocks = 3, 4, 20
    capacity = max_blocks * block_size
    table = _block_table(num_rows, max_blocks, num_blocks, gen)
    keys = torch.randn(num_rows, capacity, num_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(num_rows, capacity, num_heads, head_size, generator=gen).to(dtype)
    positions = torch.arange(capacity)
    row_slots = table[:, positions // block_size].long() * block_size + positions % block_size  # [rows, capacity]
    cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_size, dtype=dtype)
    kernels.write_slots(keys.flatten(0, 1), values.flatten(0, 1), cache, row_slots.flatten(), layout)

    rows = torch.tensor([0, 1, 2, 2, 2, 1])
    counts = torch.tensor([1, 77, capacity, 50, 51, 32])
    query = torch.randn(len(rows), query_heads, head_size, generator=gen).to(dtype)
    scale = 0.2
    mass0 = torch.rand(num_heads, num_blocks * block_size, generator=gen)
    mass, output = mass0.clone(), torch.zeros(len(rows), query_heads, head_size)
    reference.attention_mass(query, cache, layout, table, rows, counts, scale, mass, output)

    expected_mass, expected_out = mass0.clone(), torch.zeros_like(output)
    for i, (row, count) in enumerate(zip(rows.tolist(), counts.tolist())):
        for q_head in range(query_heads):
            kv_head = q_head // group
            k = keys[row, :count, kv_head].float()
            v = values[row, :count, kv_head].float()
            p = torch.softmax(query[i, q_head].float() @ k.T * scale, dim=-1)
            expected_out[i, q_head] = p @ v
            expected_mass[kv_head, row_slots[row, :count]] += p
    torch.testing.assert_close(output, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, expected_mass, rtol=1e-5, atol=1e-5)


@needs_extension
def test_extension_rejects_bad_input_clearly() -> None:
    layout = probe_layout(torch.float32, 32, 64, "vec")
    cache = torch.zeros(4, 2, 32, 128)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    query = torch.zeros(2, 4, 64)
    rows, counts = torch.tensor([0, 1]), torch.tensor([10, 64])
    mass = torch.zeros(2, 128)
    kernels.attention_mass(query, cache, layout, table, rows, counts, 1.0, mass)  # valid
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        kernels.attention_mass(torch.zeros(2, 3, 64), cache, layout, table, rows, counts, 1.0, mass)
    with pytest.raises(RuntimeError, match=r"key_counts\[1\] = 65"):
        kernels.attention_mass(query, cache, layout, table, rows, torch.tensor([10, 65]), 1.0, mass)
    with pytest.raises(RuntimeError, match=r"query_rows\[0\] = 2"):
        kernels.attention_mass(query, cache, layout, table, torch.tensor([2, 1]), counts, 1.0, mass)
    with pytest.raises(RuntimeError, match="mass must be"):
        kernels.attention_mass(query, cache, layout, table, rows, counts, 1.0, torch.zeros(2, 96))
    with pytest.raises(RuntimeError, match="not a cache block"):
        kernels.attention_mass(query, cache, layout, table + 3, rows, counts, 1.0, mass)
    with pytest.raises(RuntimeError, match="output dtype"):
        kernels.attention_mass(query, cache, layout, table, rows, counts, 1.0, mass, torch.zeros(2, 4, 64, dtype=torch.half))


@needs_extension
@pytest.mark.parametrize("config", [CONFIGS[2], CONFIGS[6]], ids=_config_id)
def test_soft_capping_equals_reference(config: tuple) -> None:
    """Logit soft-capping (Gemma 2): cap * tanh(scale * q.k / cap) before the softmax, in the C++
    kernel as in the torch reference, and it changes the mass (the cap bites)."""
    dtype, block_size, head_size, num_heads, group = config
    gen = torch.Generator().manual_seed(zlib.crc32(("softcap" + _config_id(config)).encode()))
    max_blocks = 4
    num_blocks = 6 * (max_blocks + 1) + 3
    table = _block_table(6, max_blocks, num_blocks, gen)
    rows, counts = _queries(block_size, max_blocks, gen)
    query = _fused_query(len(rows), num_heads * group, num_heads, head_size, dtype, gen) * 3
    cache = torch.randn(num_blocks, num_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    layout = probe_layout(dtype, block_size, head_size, default_isa(dtype, block_size, head_size))
    results = {}
    for softcap in (0.0, 5.0):
        mass_cpp = torch.zeros(num_heads, num_blocks * block_size)
        mass_ref = torch.zeros_like(mass_cpp)
        out_cpp = torch.zeros(query.shape, dtype=torch.float32)
        out_ref = torch.zeros_like(out_cpp)
        kernels.attention_mass(query, cache, layout, table, rows, counts, 1.0, mass_cpp, out_cpp, softcap=softcap)
        reference.attention_mass(query, cache, layout, table, rows, counts, 1.0, mass_ref, out_ref, softcap=softcap)
        torch.testing.assert_close(mass_cpp, mass_ref, **_tolerance(MASS_TOL, 1.0, head_size))
        torch.testing.assert_close(out_cpp, out_ref, **_tolerance(OUT_TOL, 1.0, head_size))
        results[softcap] = mass_cpp
    assert (results[0.0] - results[5.0]).abs().max() > 1e-2, "a cap of 5 on logits of +-40 must flatten the softmax"
