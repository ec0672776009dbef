"""FDC's narrow write in Triton (`kernels/triton/packed_slots.py`) against its torch reference,
`PackedHeads.write` on the real rows only: heads of unequal ranks (one not a power of two, one
at the full width), keys dims-major and token-major, block sizes 16 and 24, fp32 and 16-bit
caches, slot -1 rows scattered through the batch (vLLM's padding: skipped, and nothing else
in the cache moves), blocks with unused room past the packed rows. Bit-equal caches.
"""

from triton_setup import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET without a GPU)

import pytest
import torch

from vllm_kvprune.kernels.reduced_attention import PackedHeads
from vllm_kvprune.kernels.triton import packed_slots

pytestmark = pytest.mark.triton

K_RANKS = (5, 32, 12)
V_RANKS = (32, 7, 24)
WIDTH = 32  # the reduced keys/values handed in: [n, H, WIDTH], zero past each head's rank


def _case(seed: int, block_size: int, dtype: torch.dtype, keys_by_token: bool, spare: int = 0):
    """(heads, cache, slots, keys, values) on CPU: a pool of random bits, distinct slots with
    -1 among them, keys/values of every row (the padding rows' too)."""
    generator = torch.Generator().manual_seed(seed)
    heads = PackedHeads.from_ranks(K_RANKS, V_RANKS, keys_by_token)
    num_blocks = 5
    cache = torch.randn(num_blocks, block_size * heads.row_width + spare, generator=generator).to(dtype)
    real = torch.randperm(num_blocks * block_size, generator=generator)[:9]
    slots = torch.cat([real[:3], torch.tensor([-1]), real[3:7], torch.tensor([-1, -1]), real[7:]])
    keys = torch.randn(len(slots), heads.num_heads, WIDTH, generator=generator)
    values = torch.randn(len(slots), heads.num_heads, WIDTH, generator=generator)
    return heads, cache, slots, keys, values


def _reference(heads, cache, slots, keys, values, block_size):
    expected = cache.clone()
    real = slots >= 0
    heads.write(expected, slots[real], keys[real], values[real], block_size)
    return expected


@pytest.mark.parametrize("keys_by_token", [False, True], ids=["dims-major", "token-major"])
@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_packed_matches_the_reference_and_skips_padding(dtype, block_size: int, keys_by_token: bool) -> None:
    heads, cache, slots, keys, values = _case(0, block_size, dtype, keys_by_token)
    expected = _reference(heads, cache, slots, keys, values, block_size)
    assert not torch.equal(expected, cache)  # the write changes something
    got = cache.to(DEVICE)
    packed_slots.write_packed(heads, got, slots.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), block_size)
    assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8))


def test_write_packed_leaves_the_unused_room_of_a_block_alone() -> None:
    """Blocks wider than their packed rows (a layer's row rounded up to a head size): the room
    past them is untouched, and the block size is what the caller says, not what fits."""
    heads, cache, slots, keys, values = _case(1, 16, torch.float32, True, spare=40)
    expected = _reference(heads, cache, slots, keys, values, 16)
    got = cache.to(DEVICE)
    packed_slots.write_packed(heads, got, slots.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), 16)
    assert torch.equal(got.cpu(), expected)


def test_write_packed_with_no_tokens_or_only_padding_changes_nothing() -> None:
    heads, cache, slots, keys, values = _case(2, 16, torch.float32, False)
    got = cache.to(DEVICE)
    packed_slots.write_packed(heads, got, slots[:0].to(DEVICE), keys[:0].to(DEVICE), values[:0].to(DEVICE), 16)
    padding = torch.full((4,), -1)
    packed_slots.write_packed(heads, got, padding.to(DEVICE), keys[:4].to(DEVICE), values[:4].to(DEVICE), 16)
    assert torch.equal(got.cpu(), cache)


def test_write_packed_rejects_bad_inputs() -> None:
    heads, cache, slots, keys, values = _case(3, 16, torch.float32, False)
    cache, slots, keys, values = (t.to(DEVICE) for t in (cache, slots, keys, values))
    with pytest.raises(ValueError, match="one row per token"):
        packed_slots.write_packed(heads, cache, slots[:-1], keys, values, 16)
    with pytest.raises(ValueError, match="heads"):
        packed_slots.write_packed(heads, cache, slots, keys[:, :2], values[:, :2], 16)
    with pytest.raises(ValueError, match="contiguous"):
        packed_slots.write_packed(heads, cache.view(5, 16, -1), slots, keys, values, 16)
    with pytest.raises(ValueError, match="cannot hold"):
        packed_slots.write_packed(heads, cache, slots, keys, values, 64)
