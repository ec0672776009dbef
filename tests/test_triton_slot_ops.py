"""Triton slot ops and PagedEviction score kernels (and the optional CUDA slot ops) against the
torch references: fp32/fp16/bf16, HND and NHD caches, [n] and [n, H] slots with -1 entries,
overlapping (compaction) copies, untouched slots bit-equal, bad inputs rejected. The CUDA slot
ops are a benchmark's (`benchmarks/cuda_ops.py`), not the package's."""
from triton_setup import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET=1 without a GPU)

import pytest
import torch

from benchmarks import cuda_ops
from vllm_kvprune.kernels import reference
from vllm_kvprune.kernels.layout import gpu_layout
from vllm_kvprune.kernels.triton import block_scores, nhd_cache, slot_ops
from vllm_kvprune.policies.paged_eviction import PagedEvictionPolicy

pytestmark = pytest.mark.triton

NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE = 4, 3, 16, 24  # D not a power of two: masked tail
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_cache(dtype: torch.dtype, nhd: bool, seed: int = 0) -> torch.Tensor:
    """A random cache (every element set, so untouched regions are checkable bit for bit)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=generator).to(dtype)
    if not nhd:
        return values.to(DEVICE)
    cache = nhd_cache(NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype, DEVICE)
    cache.copy_(values)
    assert not cache.is_contiguous()
    return cache


def make_tokens(num_tokens: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator).to(dtype).to(DEVICE)
    value = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator).to(dtype).to(DEVICE)
    return key, value


def make_slots(per_head: bool, seed: int = 2, count: int = 10) -> torch.Tensor:
    """Distinct slots per head with two -1 entries; [count] or [count, H]."""
    generator = torch.Generator().manual_seed(seed)
    if per_head:
        slots = torch.stack([torch.randperm(NUM_SLOTS, generator=generator)[:count] for _ in range(NUM_HEADS)], 1)
        slots[1, 0] = -1
        slots[4, 2] = -1
    else:
        slots = torch.randperm(NUM_SLOTS, generator=generator)[:count]
        slots[[1, 6]] = -1
    return slots.to(DEVICE)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same-width integers of a tensor, contiguous on CPU: equality means bit equality."""
    width = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[tensor.dtype]
    return tensor.detach().cpu().contiguous().view(width)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def write_reference(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    expected = cache.detach().cpu().clone(memory_format=torch.contiguous_format)  # never the cache itself
    reference.write_slots(key.cpu(), value.cpu(), expected, slots.cpu(), gpu_layout(cache.dtype, BLOCK_SIZE, HEAD_SIZE))
    return expected


def copy_reference(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    expected = cache.detach().cpu().clone(memory_format=torch.contiguous_format)  # never the cache itself
    reference.copy_slots(expected, src.cpu(), dst.cpu(), gpu_layout(cache.dtype, BLOCK_SIZE, HEAD_SIZE))
    return expected


def compaction_pairs(per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep every other token of slots 0..31 and pack them into 0..15 (sources and destinations
    overlap, and some destinations are sources of later pairs); one pair skipped with dst -1."""
    src = torch.arange(1, 32, 2)
    dst = torch.arange(16)
    dst[5] = -1
    if per_head:  # each head keeps a different set: head h keeps odd slots shifted by h
        src = torch.stack([torch.clamp(src + h - 1, max=NUM_SLOTS - 1) for h in range(NUM_HEADS)], 1)
        dst = dst.unsqueeze(1).repeat(1, NUM_HEADS)
        src[5, 1] = -1  # skipped pair: dst is -1 too
    return src.to(DEVICE), dst.to(DEVICE)


# ---------------------------------------------------------------- Triton slot ops

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nhd", [False, True], ids=["hnd", "nhd"])
@pytest.mark.parametrize("per_head", [False, True], ids=["slots_n", "slots_nh"])
def test_write_read_copy_match_reference(dtype: torch.dtype, nhd: bool, per_head: bool) -> None:
    cache = make_cache(dtype, nhd)
    key, value = make_tokens(10, dtype)
    slots = make_slots(per_head)

    expected = write_reference(cache, key, value, slots)
    slot_ops.write_slots(key, value, cache, slots)
    assert_bit_equal(cache, expected)  # written slots and every untouched one

    read_key, read_value = slot_ops.read_slots(cache, slots)
    ref_key, ref_value = reference.read_slots(expected, slots.cpu(), gpu_layout(dtype, BLOCK_SIZE, HEAD_SIZE))
    assert_bit_equal(read_key, ref_key)
    assert_bit_equal(read_value, ref_value)
    skipped = (slots.cpu() < 0) if per_head else (slots.cpu() < 0).unsqueeze(1).expand(-1, NUM_HEADS)
    assert bool((read_key.cpu()[skipped] == 0).all()) and bool((read_value.cpu()[skipped] == 0).all())

    src, dst = compaction_pairs(per_head)
    expected = copy_reference(cache, src, dst)
    slot_ops.copy_slots(cache, src, dst)
    assert_bit_equal(cache, expected)


def test_copy_is_staged_for_chains() -> None:
    """A chain 0->1->2->3 must move the old contents, not ripple slot 0 along."""
    cache = make_cache(torch.float32, nhd=False)
    src = torch.tensor([0, 1, 2], device=DEVICE)
    dst = torch.tensor([1, 2, 3], device=DEVICE)
    before = cache.clone()
    slot_ops.copy_slots(cache, src, dst)
    assert_bit_equal(cache, copy_reference(before, src, dst))
    assert torch.equal(cache[0, :, 3], before[0, :, 2])


def test_write_accepts_strided_tokens_and_int32_slots() -> None:
    cache = make_cache(torch.float16, nhd=True)
    packed = torch.randn(6, NUM_HEADS, 2 * HEAD_SIZE).to(torch.float16).to(DEVICE)
    key, value = packed[..., :HEAD_SIZE], packed[..., HEAD_SIZE:]  # views with a token stride of 2D*H
    slots = torch.tensor([5, -1, 17, 40, 63, 0], dtype=torch.int32, device=DEVICE)
    expected = write_reference(cache, key.contiguous(), value.contiguous(), slots.long())
    slot_ops.write_slots(key, value, cache, slots)
    assert_bit_equal(cache, expected)


def test_empty_slots_are_no_ops() -> None:
    cache = make_cache(torch.float32, nhd=False)
    before = cache.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    key, value = make_tokens(0, torch.float32)
    slot_ops.write_slots(key, value, cache, empty)
    slot_ops.copy_slots(cache, empty, empty)
    read_key, _ = slot_ops.read_slots(cache, empty)
    assert read_key.shape == (0, NUM_HEADS, HEAD_SIZE)
    assert torch.equal(cache, before)


def test_bad_inputs_raise() -> None:
    cache = make_cache(torch.float32, nhd=False)
    key, value = make_tokens(3, torch.float32)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="out of range"):
        slot_ops.write_slots(key, value, cache, torch.tensor([0, 1, NUM_SLOTS], device=DEVICE))
    with pytest.raises(ValueError, match="out of range"):
        slot_ops.read_slots(cache, torch.tensor([-2], device=DEVICE))
    with pytest.raises(ValueError, match="key must be"):
        slot_ops.write_slots(key[:2], value, cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        slot_ops.write_slots(key.half(), value.half(), cache, slots)
    with pytest.raises(ValueError, match="integer"):
        slot_ops.write_slots(key, value, cache, slots.float())
    with pytest.raises(ValueError, match=r"\[n\] or \[n, 3\]"):
        slot_ops.read_slots(cache, torch.zeros(3, 2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="kv_cache must be"):
        slot_ops.read_slots(cache[..., :-1], slots)
    with pytest.raises(ValueError, match="differ in shape"):
        slot_ops.copy_slots(cache, slots, slots[:2])
    with pytest.raises(ValueError, match="source -1"):
        slot_ops.copy_slots(cache, torch.tensor([0, -1], device=DEVICE), torch.tensor([3, 4], device=DEVICE))


# ---------------------------------------------------------------- PagedEviction scores

@pytest.mark.parametrize("dtype", DTYPES)
def test_store_token_scores_matches_policy(dtype: torch.dtype) -> None:
    key, value = make_tokens(10, dtype, seed=3)
    slots = make_slots(per_head=False, seed=4)
    scores_row = torch.full((NUM_SLOTS,), -7.0, device=DEVICE)
    block_scores.store_token_scores(key, value, scores_row, slots)

    expected = torch.full((NUM_SLOTS,), -7.0)
    valid = slots.cpu() >= 0
    expected[slots.cpu()[valid]] = PagedEvictionPolicy.token_scores(key.cpu(), value.cpu())[valid]
    torch.testing.assert_close(scores_row.cpu(), expected, rtol=1e-5, atol=1e-6)
    assert bool((scores_row.cpu()[expected == -7.0] == -7.0).all())  # skipped and untouched slots


def test_block_means_matches_worker_formula() -> None:
    num_layers, divisor = 3, BLOCK_SIZE * 8.0
    by_slot = torch.rand(num_layers, NUM_SLOTS, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    block_ids = torch.tensor([3, 0, 2, 2], device=DEVICE)
    means = block_scores.block_means(by_slot, block_ids, BLOCK_SIZE, divisor)
    expected = by_slot.cpu().view(num_layers, -1, BLOCK_SIZE)[:, block_ids.cpu()].sum(-1) / divisor
    assert means.dtype == torch.float32 and means.shape == (num_layers, 4)
    torch.testing.assert_close(means.cpu(), expected, rtol=1e-6, atol=1e-7)


def test_score_kernels_reject_bad_inputs() -> None:
    key, value = make_tokens(2, torch.float32)
    row = torch.zeros(NUM_SLOTS, device=DEVICE)
    with pytest.raises(ValueError, match="out of range"):
        block_scores.store_token_scores(key, value, row, torch.tensor([0, NUM_SLOTS], device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        block_scores.store_token_scores(key, value, row.half(), torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match=r"slots must be \[2\]"):
        block_scores.store_token_scores(key, value, row, torch.tensor([0], device=DEVICE))
    by_slot = torch.zeros(2, NUM_SLOTS, device=DEVICE)
    with pytest.raises(ValueError, match="out of range"):
        block_scores.block_means(by_slot, torch.tensor([NUM_BLOCKS], device=DEVICE), BLOCK_SIZE, 1.0)
    with pytest.raises(ValueError, match="whole blocks"):
        block_scores.block_means(by_slot, torch.tensor([0], device=DEVICE), 5, 1.0)


# ---------------------------------------------------------------- CUDA slot ops (GPU only)

def _cuda_ops_or_skip() -> None:
    """Skip without a GPU or without any way to get the ops; fail if nvcc is there but the
    build failed (a compile error must not pass as a skip)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not cuda_ops.load_cuda_ops():
        if cuda_ops.can_jit_build():
            pytest.fail(f"CUDA slot ops failed to build: {cuda_ops.load_error()}")
        pytest.skip(f"CUDA slot ops unavailable: {cuda_ops.load_error()}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nhd", [False, True], ids=["hnd", "nhd"])
@pytest.mark.parametrize("per_head", [False, True], ids=["slots_n", "slots_nh"])
def test_cuda_ops_match_reference(dtype: torch.dtype, nhd: bool, per_head: bool) -> None:
    _cuda_ops_or_skip()
    cache = make_cache(dtype, nhd)
    key, value = make_tokens(10, dtype)
    slots = make_slots(per_head)
    expected = write_reference(cache, key, value, slots)
    cuda_ops.write_slots(key, value, cache, slots)
    assert_bit_equal(cache, expected)

    read_key, read_value = cuda_ops.read_slots(cache, slots)
    ref_key, ref_value = reference.read_slots(expected, slots.cpu(), gpu_layout(dtype, BLOCK_SIZE, HEAD_SIZE))
    assert_bit_equal(read_key, ref_key)
    assert_bit_equal(read_value, ref_value)

    src, dst = compaction_pairs(per_head)
    expected = copy_reference(cache, src, dst)
    cuda_ops.copy_slots(cache, src, dst)
    assert_bit_equal(cache, expected)

    # The raw torch ops too (no Python validation), on strided key/value views.
    packed = torch.randn(4, NUM_HEADS, 2 * HEAD_SIZE).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 33, 60], device=DEVICE)
    expected = write_reference(cache, packed[..., :HEAD_SIZE].contiguous(), packed[..., HEAD_SIZE:].contiguous(), slots)
    torch.ops.kvprune_cuda.write_slots(packed[..., :HEAD_SIZE], packed[..., HEAD_SIZE:], cache, slots)
    assert_bit_equal(cache, expected)
    src, dst = torch.tensor([3, 33, 0], device=DEVICE), torch.tensor([33, 3, -1], device=DEVICE)
    expected = copy_reference(cache, src, dst)
    torch.ops.kvprune_cuda.copy_slots(cache, src, dst)
    assert_bit_equal(cache, expected)


def test_cuda_ops_reject_bad_inputs() -> None:
    _cuda_ops_or_skip()
    cache = make_cache(torch.float16, nhd=False)
    key, value = make_tokens(2, torch.float16)
    with pytest.raises(ValueError, match="out of range"):
        cuda_ops.write_slots(key, value, cache, torch.tensor([0, NUM_SLOTS], device=DEVICE))
    with pytest.raises(ValueError, match="source -1"):
        cuda_ops.copy_slots(cache, torch.tensor([-1], device=DEVICE), torch.tensor([0], device=DEVICE))
    with pytest.raises(RuntimeError):
        torch.ops.kvprune_cuda.write_slots(key.float(), value.float(), cache, torch.tensor([0, 1], device=DEVICE))
