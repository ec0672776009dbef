"""Triton attention kernels vs their torch references: H2O's fused decode attention + attention
mass (``attention_mass``: output and added mass, GQA groups, several queries of one row on the
same slots, count 0, softcap, HND and NHD caches, mass-only and output-only) and per-head
variable-length decode attention over shuffled head-pages (``head_page_attention``: heads of
very different lengths, length 0 -> zeros). The references run on CPU copies with
``gpu_layout`` (NHD caches made contiguous first); shapes are small for the interpreter."""
from triton_setup import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET=1 without a GPU)

import pytest
import torch

from vllm_kvprune.kernels import reference
from vllm_kvprune.kernels.layout import gpu_layout
from vllm_kvprune.kernels.triton import attention_mass as triton_mass
from vllm_kvprune.kernels.triton import head_pages, nhd_cache

pytestmark = pytest.mark.triton

NUM_HEADS, BLOCK_SIZE = 2, 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (output atol/rtol, mass atol) per cache dtype: fp32 tight; 16-bit outputs are stored rounded.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (4e-3, 1e-4), torch.bfloat16: (2e-2, 1e-4)}


def make_cache(num_blocks: int, head_size: int, dtype: torch.dtype, nhd: bool, seed: int,
               block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """A random layer cache on DEVICE, HND (contiguous) or NHD strides."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_blocks, NUM_HEADS, block_size, 2 * head_size, generator=generator).to(dtype)
    if not nhd:
        return values.to(DEVICE)
    cache = nhd_cache(num_blocks, NUM_HEADS, block_size, head_size, dtype, DEVICE)
    cache.copy_(values.to(DEVICE))
    assert not cache.is_contiguous()
    return cache


def make_query(num_queries: int, query_heads: int, head_size: int, dtype: torch.dtype, seed: int,
               spread: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(num_queries, query_heads, head_size, generator=generator)).to(dtype).to(DEVICE)


def reference_mass(query, cache, block_table, rows, counts, scale, mass, output, softcap=0.0):
    """reference.attention_mass on CPU copies; returns (mass, output) after the call (None kept None)."""
    block_size, head_size = cache.shape[2], cache.shape[3] // 2
    mass_cpu = None if mass is None else mass.cpu().clone()  # clone: .cpu() is the same tensor on CPU
    mass_arg = mass_cpu if mass_cpu is not None else torch.zeros(cache.shape[1], cache.shape[0] * block_size)
    output_cpu = None if output is None else output.cpu().clone()
    reference.attention_mass(query.cpu(), cache.cpu().contiguous(), gpu_layout(cache.dtype, block_size, head_size),
                             block_table.cpu(), rows.cpu(), counts.cpu(), scale, mass_arg, output_cpu, softcap)
    return mass_cpu, output_cpu


def mass_scenario(dtype: torch.dtype, group: int, head_size: int, nhd: bool, seed: int,
                  block_size: int = BLOCK_SIZE):
    """Two rows over shuffled blocks; row 0 has three prefill-like queries on overlapping slots
    (masses add up), row 1 a long query, a 1-key query and a 0-key query."""
    num_blocks, max_blocks = 9, 4
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=generator)[: 2 * max_blocks].view(2, max_blocks)
    block_table = blocks.to(torch.int32).to(DEVICE)
    rows = torch.tensor([0, 0, 0, 1, 1, 1], device=DEVICE)
    counts = torch.tensor([2 * block_size + 3, 2 * block_size + 4, 2 * block_size + 5, 4 * block_size, 1, 0],
                          dtype=torch.int32, device=DEVICE)
    cache = make_cache(num_blocks, head_size, dtype, nhd, seed, block_size)
    query = make_query(len(rows), NUM_HEADS * group, head_size, dtype, seed + 1, spread=2.0)
    initial_mass = torch.rand(NUM_HEADS, num_blocks * block_size, generator=generator).to(DEVICE)
    return cache, query, block_table, rows, counts, initial_mass


def assert_output_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCES[dtype][0]
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=tolerance, rtol=tolerance)


def assert_mass_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.cpu(), expected, atol=TOLERANCES[dtype][1], rtol=1e-5)


# ---- attention_mass -------------------------------------------------------------------------


def check_mass_against_reference(dtype: torch.dtype, group: int, head_size: int, nhd: bool,
                                 seed: int) -> torch.Tensor:
    """`mass_scenario` through the kernel and the reference: output and mass agree; the output."""
    cache, query, block_table, rows, counts, mass = mass_scenario(dtype, group, head_size, nhd, seed=seed)
    output = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    expected_mass, expected_output = reference_mass(query, cache, block_table, rows, counts, scale, mass, output)
    triton_mass.attention_mass(query, cache, block_table, rows, counts, scale, mass, output)
    assert_output_close(output, expected_output, dtype)
    assert_mass_close(mass, expected_mass, dtype)
    return output


@pytest.mark.parametrize("nhd", [False, True], ids=["HND", "NHD"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_mass_matches_reference(dtype: torch.dtype, group: int, nhd: bool) -> None:
    output = check_mass_against_reference(dtype, group, 32 if group == 1 else 64, nhd, seed=group)
    assert bool((output[-1] == 0).all()), "a query with 0 keys has a zero output"


# Served models' head sizes (Llama/Qwen 128, Gemma 256) at GQA group 4: the tiles and
# precisions the wrappers choose for them are the launches a GPU compiles
# (`python -m tools.triton_targets`), so they are run here too.
@pytest.mark.parametrize("head_size", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_mass_at_model_head_sizes(dtype: torch.dtype, head_size: int) -> None:
    check_mass_against_reference(dtype, 4, head_size, False, seed=head_size)


def test_attention_mass_sums_over_queries_and_heads() -> None:
    """Per query, the added mass of each KV head sums to its group size; slots no query reaches keep their value."""
    group = 2
    cache, query, block_table, rows, counts, _ = mass_scenario(torch.float32, group, 16, False, seed=5)
    mass = torch.zeros(NUM_HEADS, cache.shape[0] * BLOCK_SIZE, device=DEVICE)
    triton_mass.attention_mass(query, cache, block_table, rows, counts, 1.0, mass, None)
    attending = int((counts > 0).sum())
    torch.testing.assert_close(mass.sum(dim=1).cpu(), torch.full((NUM_HEADS,), float(group * attending)))
    reached = torch.zeros(cache.shape[0] * BLOCK_SIZE, dtype=torch.bool)
    for row, count in zip(rows.tolist(), counts.tolist()):
        positions = torch.arange(count)
        reached[block_table[row].cpu().long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE] = True
    assert bool((mass.cpu()[:, ~reached] == 0).all())


@pytest.mark.parametrize("nhd", [False, True], ids=["HND", "NHD"])
def test_attention_mass_softcap(nhd: bool) -> None:
    cache, query, block_table, rows, counts, mass = mass_scenario(torch.float32, 2, 32, nhd, seed=7)
    query = query * 4  # logits well past the cap
    output = torch.empty_like(query)
    expected_mass, expected_output = reference_mass(query, cache, block_table, rows, counts, 1.0, mass, output, 5.0)
    triton_mass.attention_mass(query, cache, block_table, rows, counts, 1.0, mass, output, softcap=5.0)
    assert_output_close(output, expected_output, torch.float32)
    assert_mass_close(mass, expected_mass, torch.float32)
    _, uncapped = reference_mass(query, cache, block_table, rows, counts, 1.0, None, torch.empty_like(query))
    assert not torch.allclose(uncapped, expected_output, atol=1e-3), "the softcap must change this output"


@pytest.mark.parametrize("mode", ["mass_only", "output_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_mass_single_products(dtype: torch.dtype, mode: str) -> None:
    cache, query, block_table, rows, counts, mass = mass_scenario(dtype, 4, 32, True, seed=11)
    output = torch.full_like(query, float("nan"))
    expected_mass, expected_output = reference_mass(query, cache, block_table, rows, counts, 0.2, mass, output)
    if mode == "mass_only":
        triton_mass.attention_mass(query, cache, block_table, rows, counts, 0.2, mass, None)
        assert_mass_close(mass, expected_mass, dtype)
    else:
        mass_before = mass.clone()
        triton_mass.attention_mass(query, cache, block_table, rows, counts, 0.2, None, output)
        assert_output_close(output, expected_output, dtype)
        assert torch.equal(mass, mass_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_mass_long_rows_span_key_tiles(dtype: torch.dtype) -> None:
    """Rows longer than two key tiles (the online softmax rescales across tiles), shuffled blocks."""
    head_size, group = 16, 2
    tile = triton_mass.key_tile(dtype, head_size)
    max_blocks = (2 * tile + 40) // BLOCK_SIZE + 1
    num_blocks = 2 * max_blocks + 1
    generator = torch.Generator().manual_seed(43)
    block_table = torch.randperm(num_blocks, generator=generator)[: 2 * max_blocks].view(2, -1).to(torch.int32)
    block_table = block_table.to(DEVICE)
    rows = torch.tensor([0, 1, 1], device=DEVICE)
    counts = torch.tensor([2 * tile + 37, tile + 1, tile], dtype=torch.int32, device=DEVICE)
    cache = make_cache(num_blocks, head_size, dtype, True, seed=43)
    query = make_query(3, NUM_HEADS * group, head_size, dtype, seed=44, spread=2.0)
    mass = torch.zeros(NUM_HEADS, num_blocks * BLOCK_SIZE, device=DEVICE)
    output = torch.empty_like(query)
    expected_mass, expected_output = reference_mass(query, cache, block_table, rows, counts, 0.5, mass, output)
    triton_mass.attention_mass(query, cache, block_table, rows, counts, 0.5, mass, output)
    assert_output_close(output, expected_output, dtype)
    assert_mass_close(mass, expected_mass, dtype)


def test_attention_mass_padded_tiles() -> None:
    """block_size 8 and head_size 24 (tiles padded to 16/32 and masked), group 3 (padded to 16
    rows), fp32 output from a bf16 query and cache."""
    cache, query, block_table, rows, counts, mass = mass_scenario(torch.bfloat16, 3, 24, True, seed=13, block_size=8)
    output = torch.empty(query.shape, dtype=torch.float32, device=DEVICE)
    expected_mass, expected_output = reference_mass(query, cache, block_table, rows, counts, 0.3, mass, output)
    triton_mass.attention_mass(query, cache, block_table, rows, counts, 0.3, mass, output)
    assert_output_close(output, expected_output, torch.float16)  # fp32 output: only TF32 P @ V rounding
    assert_mass_close(mass, expected_mass, torch.bfloat16)


def test_attention_mass_rejects_bad_inputs() -> None:
    cache, query, block_table, rows, counts, mass = mass_scenario(torch.float32, 2, 16, False, seed=17)
    output = torch.empty_like(query)
    call = triton_mass.attention_mass
    bad_calls = {
        "query heads": lambda: call(query[:, :3], cache, block_table, rows, counts, 1.0, mass, output),
        "query head_size": lambda: call(query[..., :8], cache, block_table, rows, counts, 1.0, mass, output),
        "mass dtype": lambda: call(query, cache, block_table, rows, counts, 1.0, mass.double(), output),
        "mass shape": lambda: call(query, cache, block_table, rows, counts, 1.0, mass[:, :-1], output),
        "output shape": lambda: call(query, cache, block_table, rows, counts, 1.0, mass, output[:-1]),
        "block_table int64": lambda: call(query, cache, block_table.long(), rows, counts, 1.0, mass, output),
        "key_counts length": lambda: call(query, cache, block_table, rows, counts[:-1], 1.0, mass, output),
        "query_rows float": lambda: call(query, cache, block_table, rows.float(), counts, 1.0, mass, output),
        "nothing to do": lambda: call(query, cache, block_table, rows, counts, 1.0, None, None),
        "cache dims": lambda: call(query, cache[0], block_table, rows, counts, 1.0, mass, output),
    }
    for name, bad_call in bad_calls.items():
        with pytest.raises(ValueError):
            bad_call()
            pytest.fail(f"{name} was accepted")


# ---- head_page_attention --------------------------------------------------------------------


def head_page_scenario(dtype: torch.dtype, group: int, head_size: int, nhd: bool, seed: int):
    """Three requests whose KV heads hold very different lengths (0, 1, exactly one page,
    several pages), spread over a shuffled pool of head-pages, -1 padded."""
    lengths = torch.tensor([[0, 3 * BLOCK_SIZE + 5], [1, BLOCK_SIZE], [2 * BLOCK_SIZE + 1, 17]], dtype=torch.int32)
    num_requests = lengths.shape[0]
    pages_per_head = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    max_pages = int(pages_per_head.max()) + 1  # one more column of padding
    num_blocks = (int(pages_per_head.sum()) + 3 + NUM_HEADS - 1) // NUM_HEADS  # a few head-pages spare
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randperm(num_blocks * NUM_HEADS, generator=generator)
    pages = torch.full((num_requests, NUM_HEADS, max_pages), -1, dtype=torch.int32)
    taken = 0
    for n in range(num_requests):
        for h in range(NUM_HEADS):
            used = int(pages_per_head[n, h])
            pages[n, h, :used] = pool[taken: taken + used].to(torch.int32)
            taken += used
    cache = make_cache(num_blocks, head_size, dtype, nhd, seed)
    query = make_query(num_requests, NUM_HEADS * group, head_size, dtype, seed + 1, spread=2.0)
    return cache, query, pages.to(DEVICE), lengths.to(DEVICE)


def reference_head_pages(query, cache, pages, lengths, scale, output, softcap=0.0) -> torch.Tensor:
    expected = output.cpu().clone()  # clone: .cpu() is the same tensor on CPU
    layout = gpu_layout(cache.dtype, cache.shape[2], cache.shape[3] // 2)
    reference.head_page_attention_reference(query.cpu(), cache.cpu().contiguous(), layout, pages.cpu(),
                                            lengths.cpu(), scale, expected, softcap)
    return expected


@pytest.mark.parametrize("nhd", [False, True], ids=["HND", "NHD"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_page_attention_matches_reference(dtype: torch.dtype, group: int, nhd: bool) -> None:
    head_size = 32 if group == 4 else 64
    cache, query, pages, lengths = head_page_scenario(dtype, group, head_size, nhd, seed=group + 20)
    output = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    expected = reference_head_pages(query, cache, pages, lengths, scale, output)
    head_pages.head_page_attention(query, cache, pages, lengths, scale, output)
    assert_output_close(output, expected, dtype)
    assert bool((output[0, :group] == 0).all()), "a head of length 0 has a zero output"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_page_attention_long_heads_span_key_tiles(dtype: torch.dtype) -> None:
    """Heads longer than two key tiles next to short ones, over a shuffled head-page pool."""
    head_size, group = 16, 2
    tile = triton_mass.key_tile(dtype, head_size)
    lengths = torch.tensor([[2 * tile + 37, 5], [0, tile + 1]], dtype=torch.int32)
    pages_per_head = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = (int(pages_per_head.sum()) + NUM_HEADS) // NUM_HEADS
    pool = torch.randperm(num_blocks * NUM_HEADS, generator=torch.Generator().manual_seed(47)).to(torch.int32)
    pages = torch.full((2, NUM_HEADS, int(pages_per_head.max())), -1, dtype=torch.int32)
    taken = 0
    for n in range(2):
        for h in range(NUM_HEADS):
            used = int(pages_per_head[n, h])
            pages[n, h, :used] = pool[taken: taken + used]
            taken += used
    cache = make_cache(num_blocks, head_size, dtype, False, seed=47)
    query = make_query(2, NUM_HEADS * group, head_size, dtype, seed=48, spread=2.0)
    pages, lengths = pages.to(DEVICE), lengths.to(DEVICE)
    output = torch.full_like(query, float("nan"))
    expected = reference_head_pages(query, cache, pages, lengths, 0.5, output)
    head_pages.head_page_attention(query, cache, pages, lengths, 0.5, output)
    assert_output_close(output, expected, dtype)


def test_head_page_attention_softcap() -> None:
    cache, query, pages, lengths = head_page_scenario(torch.float32, 2, 16, True, seed=31)
    query = query * 4
    output = torch.empty_like(query)
    expected = reference_head_pages(query, cache, pages, lengths, 1.0, output, softcap=3.0)
    head_pages.head_page_attention(query, cache, pages, lengths, 1.0, output, softcap=3.0)
    assert_output_close(output, expected, torch.float32)
    assert not torch.allclose(reference_head_pages(query, cache, pages, lengths, 1.0, output), expected, atol=1e-3)


@pytest.mark.parametrize("head_size", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_page_attention_at_model_head_sizes(dtype: torch.dtype, head_size: int) -> None:
    cache, query, pages, lengths = head_page_scenario(dtype, 4, head_size, False, seed=head_size)
    output = torch.full_like(query, float("nan"))
    scale = head_size ** -0.5
    expected = reference_head_pages(query, cache, pages, lengths, scale, output)
    head_pages.head_page_attention(query, cache, pages, lengths, scale, output)
    assert_output_close(output, expected, dtype)


def test_head_page_reference_matches_block_attention() -> None:
    """With vLLM's uniform layout (every head of a request in pages ``block * H + h``) the
    head-page reference is the block-table reference's attention, and the kernel agrees."""
    cache, query, block_table, _, _, _ = mass_scenario(torch.float32, 2, 16, False, seed=37)
    rows = torch.tensor([0, 1], device=DEVICE)
    counts = torch.tensor([2 * BLOCK_SIZE + 9, 3 * BLOCK_SIZE], dtype=torch.int32, device=DEVICE)
    query = query[:2]
    _, expected = reference_mass(query, cache, block_table, rows, counts, 0.5, None, torch.empty_like(query))
    heads = torch.arange(NUM_HEADS, device=DEVICE, dtype=torch.int32)
    pages = (block_table[rows].unsqueeze(1) * NUM_HEADS + heads.view(1, -1, 1)).to(torch.int32)  # [N, H, blocks]
    lengths = counts.view(-1, 1).expand(-1, NUM_HEADS).contiguous()
    torch.testing.assert_close(reference_head_pages(query, cache, pages, lengths, 0.5, torch.empty_like(query)),
                               expected, atol=1e-6, rtol=1e-6)
    output = torch.empty_like(query)
    head_pages.head_page_attention(query, cache, pages, lengths, 0.5, output)
    assert_output_close(output, expected, torch.float32)


def test_head_page_attention_rejects_bad_inputs() -> None:
    cache, query, pages, lengths = head_page_scenario(torch.float32, 2, 16, False, seed=41)
    output = torch.empty_like(query)
    call = head_pages.head_page_attention
    bad_calls = {
        "pages int64": lambda: call(query, cache, pages.long(), lengths, 1.0, output),
        "pages 2-d": lambda: call(query, cache, pages[:, :, 0], lengths, 1.0, output),
        "pages heads": lambda: call(query, cache, pages[:, :1], lengths, 1.0, output),
        "lengths shape": lambda: call(query, cache, pages, lengths[:-1], 1.0, output),
        "lengths int64": lambda: call(query, cache, pages, lengths.long(), 1.0, output),
        "output shape": lambda: call(query, cache, pages, lengths, 1.0, output[:, :-1]),
        "query heads": lambda: call(query[:, :3], cache, pages, lengths, 1.0, output[:, :3]),
    }
    for name, bad_call in bad_calls.items():
        with pytest.raises(ValueError):
            bad_call()
            pytest.fail(f"{name} was accepted")
    layout = gpu_layout(cache.dtype, BLOCK_SIZE, 16)
    too_long = lengths.cpu().clone()
    too_long[0, 0] = pages.shape[2] * BLOCK_SIZE + 1
    with pytest.raises(ValueError):
        reference.head_page_attention_reference(query.cpu(), cache.cpu(), layout, pages.cpu(), too_long, 1.0,
                                                output.cpu())
    padding_read = lengths.cpu().clone()
    padding_read[1, 0] = pages.shape[2] * BLOCK_SIZE  # reaches the -1 padding
    with pytest.raises(ValueError):
        reference.head_page_attention_reference(query.cpu(), cache.cpu(), layout, pages.cpu(), padding_read, 1.0,
                                                output.cpu())
