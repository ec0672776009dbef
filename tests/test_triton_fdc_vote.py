"""Triton kernels of FDC's reduced attention and GVote's votes against their torch oracles.

Reduced attention: ``reduced_attention_reference`` on CPU copies, heads of unequal ranks (one
not a power of two, one at the full query width) packed in blocks scattered over a pool whose
unwritten slots are NaN (a stray read shows), decode and prefill batches and a mixed one,
GQA groups 1 and 3, block sizes 16 and 32, fp32 tight and fp16/bf16 within a tolerance, both
launch orders bit-identical, a zero tail past the widest value rank. Votes:
``GVotePolicy.keep_mask`` on the same inputs, with ties from duplicated keys and budgets of 1
and P. Bad inputs raise ValueError.
"""

from triton_setup import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET without a GPU)

import pytest
import torch

from vllm_kvprune.kernels.reduced_attention import PackedHeads, reduced_attention_reference
from vllm_kvprune.kernels.triton import reduced_attention as triton_fdc
from vllm_kvprune.kernels.triton import vote as triton_vote
from vllm_kvprune.policies.gvote import GVotePolicy

pytestmark = pytest.mark.triton

QUERY_WIDTH = 32
OUTPUT_WIDTH = 40  # wider than any value rank: the tail must come back zero
K_RANKS = (5, 32, 12)  # 5: not a power of two; 32: the full query width
V_RANKS = (32, 7, 23)


def _case(seed: int, group: int, block_size: int, query_counts: tuple[int, ...], seq_lens: tuple[int, ...],
          dtype: torch.dtype = torch.float32, ranks: tuple[tuple[int, ...], tuple[int, ...]] = (K_RANKS, V_RANKS),
          width: int = QUERY_WIDTH):
    """(query, cache, block_table, query_start_loc, seq_lens, heads) on CPU: every sequence's
    positions written through ``PackedHeads.write`` into blocks scattered over a pool with
    spare blocks; unwritten slots NaN."""
    generator = torch.Generator().manual_seed(seed)
    heads = PackedHeads.from_ranks(*ranks)
    num_heads = heads.num_heads
    blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * blocks_per_seq + 3
    order = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * blocks_per_seq]
    block_table = order.view(len(seq_lens), blocks_per_seq).to(torch.int32)
    cache = torch.full((num_blocks, block_size * heads.row_width), float("nan")).to(dtype)
    for s, seq_len in enumerate(seq_lens):
        keys = torch.randn(seq_len, num_heads, width, generator=generator)
        values = torch.randn(seq_len, num_heads, width, generator=generator)
        positions = torch.arange(seq_len)
        slots = block_table[s, positions // block_size].long() * block_size + positions % block_size
        heads.write(cache, slots, keys.to(dtype), values.to(dtype), block_size)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(query_counts), 0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), num_heads * group, width, generator=generator).to(dtype)
    return query, cache, block_table, starts, torch.tensor(seq_lens, dtype=torch.int32), heads


def _both(case, block_size: int, scale: float, balanced: bool = True, output_width: int = OUTPUT_WIDTH):
    """(Triton on DEVICE, reference on CPU) outputs of one case."""
    query, cache, table, starts, lens, heads = case
    expected = reduced_attention_reference(query, cache, table, starts, lens, heads, scale, output_width, block_size)
    got = triton_fdc.reduced_attention(query.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), starts.to(DEVICE),
                                       lens.to(DEVICE), heads, scale, output_width, balanced, block_size)
    assert got.device.type == torch.device(DEVICE).type and got.dtype == torch.float32
    return got.cpu(), expected


# Decode: one query per sequence. Prefill: chunks after earlier context (20 queries > one tile
# of 16 at group 3), a whole prompt, a single-token chunk.
DECODE = ((1, 1, 1, 1), (1, 17, 33, 50))
PREFILL = ((7, 20, 1, 9), (30, 45, 3, 9))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("batch", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_reduced_attention_matches_reference_fp32(batch, group: int, block_size: int) -> None:
    case = _case(group * 100 + block_size, group, block_size, *batch)
    got, expected = _both(case, block_size, 0.17)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not got[..., max(V_RANKS):].any()
    for h, v_rank in enumerate(V_RANKS):  # each head's own tail is zero too
        assert not got[:, h * group:(h + 1) * group, v_rank:].any()


# A 128-wide model's heads (Llama/Qwen) at FDC's ranks: one at full width, one at half, one
# unaligned; value ranks all multiples of 8 in bf16 (the aligned path's wider key tile). The
# tiles chosen for them are what a GPU compiles (`python -m tools.triton_targets`).
@pytest.mark.parametrize(("dtype", "v_ranks"), [(torch.float32, (128, 40, 72)), (torch.bfloat16, (128, 64, 96))],
                         ids=["float32", "bfloat16-aligned"])
@pytest.mark.parametrize("batch", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_reduced_attention_at_a_model_head_size(batch, dtype: torch.dtype, v_ranks: tuple[int, ...]) -> None:
    case = _case(7, 4, 16, *batch, dtype=dtype, ranks=((128, 64, 37), v_ranks), width=128)
    got, expected = _both(case, 16, 128 ** -0.5, output_width=128)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_reduced_attention_half_precision_cache(dtype: torch.dtype, group: int) -> None:
    case = _case(7 + group, group, 16, (4, 1, 6), (20, 33, 6), dtype)
    got, expected = _both(case, 16, 0.125)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [1, 3])
def test_launch_order_does_not_change_the_result(group: int) -> None:
    """A mixed batch (prefill chunks and decodes): LPT and natural order bit-identical."""
    case = _case(11 + group, group, 16, (1, 18, 1, 5), (40, 18, 7, 12))
    balanced, expected = _both(case, 16, 0.2, balanced=True)
    natural, _ = _both(case, 16, 0.2, balanced=False)
    torch.testing.assert_close(balanced, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(balanced, natural)


@pytest.mark.parametrize("group", [1, 3])
def test_block_size_not_a_power_of_two(group: int) -> None:
    """24-slot blocks: a keys step spans blocks and ends mid-block."""
    case = _case(21 + group, group, 24, (3, 1, 30), (50, 24, 30))
    got, expected = _both(case, 24, 0.2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("splits", "block_size"), [(2, 16), (4, 24), (8, 16)])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_with_key_splits_matches_reference(splits: int, group: int, block_size: int) -> None:
    """Flash-decoding: each task's keys over `splits` programs, partials combined. Lengths
    shorter than one split (empty partials), ending mid-split and mid-block; 24-slot blocks go
    key by key; both launch orders."""
    lens = (1, 17, 130, 50, 3)
    case = _case(31 + splits + group, group, block_size, (1,) * len(lens), lens)
    query, cache, table, starts, seq_lens, heads = case
    expected = reduced_attention_reference(query, cache, table, starts, seq_lens, heads, 0.2, OUTPUT_WIDTH, block_size)
    for balanced in (True, False):
        got = triton_fdc.reduced_attention(query.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), starts.to(DEVICE),
                                           seq_lens.to(DEVICE), heads, 0.2, OUTPUT_WIDTH, balanced, block_size,
                                           key_splits=splits, max_seq_len=max(lens)).cpu()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for h, v_rank in enumerate(V_RANKS):
            assert not got[:, h * group:(h + 1) * group, v_rank:].any()


@pytest.mark.parametrize("batch", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("group", [1, 3])
def test_keys_by_token_layout_matches_reference(batch, group: int) -> None:
    """The GPU layout (each head's keys token-major in a block) gives the same attention as
    the dims-major cache it was converted from; with key splits too."""
    block_size = 16
    query, cache, table, starts, lens, heads = _case(51 + group, group, block_size, *batch)
    expected = reduced_attention_reference(query, cache, table, starts, lens, heads, 0.2, OUTPUT_WIDTH, block_size)
    converted = triton_fdc.keys_by_token(cache, heads, block_size)
    assert not torch.equal(converted.nan_to_num(), cache.nan_to_num())  # a real change of layout
    for splits in (1, 4):
        got = triton_fdc.reduced_attention(query.to(DEVICE), converted.to(DEVICE), table.to(DEVICE), starts.to(DEVICE),
                                           lens.to(DEVICE), heads, 0.2, OUTPUT_WIDTH, True, block_size,
                                           key_splits=splits, max_seq_len=max(batch[1]), keys_by_token=True).cpu()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_key_splits_leave_prefill_unchanged() -> None:
    """A mixed batch ignores key_splits (prefill tiles are not split): bit-identical."""
    case = _case(41, 3, 16, (1, 18, 1, 5), (40, 18, 7, 12))
    query, cache, table, starts, lens, heads = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case)
    plain = triton_fdc.reduced_attention(query, cache, table, starts, lens, heads, 0.2, OUTPUT_WIDTH, block_size=16)
    split = triton_fdc.reduced_attention(query, cache, table, starts, lens, heads, 0.2, OUTPUT_WIDTH, block_size=16,
                                         key_splits=4, max_seq_len=40)
    assert torch.equal(plain, split)


def test_choose_key_splits() -> None:
    # 300 tasks fill 132 SMs twice over: no split; 256 do not: 2; 32 tasks of 4096 keys: 16
    # splits of 256 keys (512 programs).
    assert triton_fdc.choose_key_splits(300, 4096, 132) == 1
    assert triton_fdc.choose_key_splits(256, 4096, 132) == 2
    assert triton_fdc.choose_key_splits(32, 4096, 132) == 16
    assert triton_fdc.choose_key_splits(32, 4096, 132, min_keys=1024) == 4
    # Short sequences are not split below min_keys per split.
    assert triton_fdc.choose_key_splits(8, 600, 132) == 2
    assert triton_fdc.choose_key_splits(8, 300, 132) == 1


def test_default_block_size_is_what_a_block_holds() -> None:
    case = _case(5, 1, 16, (2, 1), (9, 16))
    query, cache, table, starts, lens, heads = case
    expected = reduced_attention_reference(query, cache, table, starts, lens, heads, 0.3, OUTPUT_WIDTH)
    got = triton_fdc.reduced_attention(query.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), starts.to(DEVICE),
                                       lens.to(DEVICE), heads, 0.3, OUTPUT_WIDTH)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile_queries", [1, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_tasks_cover_every_query_and_head_once(tile_queries: int, balanced: bool) -> None:
    counts, lens = (3, 1, 9, 0, 4), (10, 1, 9, 2, 30)
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(counts), 0).tolist()], dtype=torch.int32)
    heads = PackedHeads.from_ranks(K_RANKS, V_RANKS)
    tasks = triton_fdc.build_tasks(starts.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                   heads, sum(counts), tile_queries, balanced).cpu().long()
    covered = torch.zeros(sum(counts), heads.num_heads, dtype=torch.long)
    costs = []
    for seq, head, first_token, num_queries, first_position in tasks.tolist():
        assert 0 <= num_queries <= tile_queries
        if num_queries == 0:
            costs.append(0)
            continue
        offset = first_token - int(starts[seq])
        assert first_position == lens[seq] - counts[seq] + offset
        covered[first_token:first_token + num_queries, head] += 1
        costs.append((first_position + num_queries) * (K_RANKS[head] + V_RANKS[head]))
    assert torch.equal(covered, torch.ones_like(covered))
    if balanced:
        assert costs == sorted(costs, reverse=True)
    else:
        real = tasks[tasks[:, 3] > 0]
        assert real[:, [2, 1]].tolist() == sorted(real[:, [2, 1]].tolist())  # token-major, then head


def test_reduced_attention_rejects_bad_inputs() -> None:
    query, cache, table, starts, lens, heads = (t.to(DEVICE) if isinstance(t, torch.Tensor) else t
                                                for t in _case(3, 1, 16, (1, 1), (5, 9)))

    def call(**changes):
        args = dict(query=query, kv_cache=cache, block_table=table, query_start_loc=starts, seq_lens=lens,
                    heads=heads, scale=0.1, output_width=OUTPUT_WIDTH, block_size=16)
        args.update(changes)
        return triton_fdc.reduced_attention(**args)

    with pytest.raises(ValueError, match="output_width"):
        call(output_width=max(V_RANKS) - 1)
    with pytest.raises(ValueError, match="query width"):
        call(query=query[:, :, :20])
    with pytest.raises(ValueError, match="group"):
        call(query=query[:, :2])
    with pytest.raises(ValueError, match="query_start_loc"):
        call(query_start_loc=starts[:2])
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=cache.view(cache.shape[0], 16, -1))
    with pytest.raises(ValueError, match="hold"):
        call(block_size=64)
    with pytest.raises(ValueError, match="integer"):
        call(seq_lens=lens.float())
    with pytest.raises(ValueError, match="power of two"):
        call(key_splits=3, max_seq_len=9)
    with pytest.raises(ValueError, match="max_seq_len"):
        call(key_splits=2)


def _vote_case(seed: int, num_kv_heads: int, group: int, samples: int, num_keys: int, head_dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    synthetic = torch.randn(samples, num_kv_heads * group, head_dim, generator=generator)
    keys = torch.randn(num_kv_heads, num_keys, head_dim, generator=generator)
    budgets = torch.randint(1, num_keys + 1, (num_kv_heads * group,), generator=generator)
    return synthetic, keys, budgets


def _check_votes(synthetic: torch.Tensor, keys: torch.Tensor, budgets: torch.Tensor, scale: float) -> torch.Tensor:
    synthetic, keys, budgets = synthetic.to(DEVICE), keys.to(DEVICE), budgets.to(DEVICE)
    expected = GVotePolicy.keep_mask(synthetic, keys, budgets, scale)  # same device: the same logits
    got = triton_vote.keep_mask(synthetic, keys, budgets, scale)
    assert got.dtype == torch.bool and got.shape == expected.shape and got.device == keys.device
    assert torch.equal(got.cpu(), expected.cpu())
    return got.cpu()


@pytest.mark.parametrize(("num_kv_heads", "group", "samples", "num_keys"),
                         [(2, 1, 3, 37), (2, 3, 4, 150), (1, 4, 1, 9)])
def test_keep_mask_matches_the_policy(num_kv_heads: int, group: int, samples: int, num_keys: int) -> None:
    synthetic, keys, budgets = _vote_case(num_kv_heads * 10 + group, num_kv_heads, group, samples, num_keys)
    budgets[0], budgets[-1] = 1, num_keys
    got = _check_votes(synthetic, keys, budgets, 0.35)
    assert got[-1].all()  # the last KV head's group holds a budget of P: it keeps everything


def test_keep_mask_ties_keep_every_key_at_the_threshold() -> None:
    synthetic, keys, _ = _vote_case(4, 2, 2, 2, 20)
    keys[:, 5:10] = keys[:, 4:5]  # keys 4..9 of each head are the same vector: equal logits
    keys[1] = keys[1, 4]  # head 1: every key the same, so any budget keeps all of them
    budgets = torch.ones(4, dtype=torch.int64)
    got = _check_votes(synthetic, keys, budgets, 1.0)
    assert got[1].all()
    # Budget 1 per row: each row's top key, with its duplicates when it is one of keys 4..9.
    assert got[0, 4:10].all() or not got[0, 4:10].any()
    budgets = torch.tensor([3, 7, 1, 20])
    _check_votes(synthetic, keys, budgets, 0.5)


def test_keep_mask_budget_one_and_all() -> None:
    synthetic, keys, _ = _vote_case(9, 3, 2, 5, 33)
    got = _check_votes(synthetic, keys, torch.full((6,), 33), 0.2)
    assert got.all()
    got = _check_votes(synthetic, keys, torch.ones(6, dtype=torch.int32), 0.2)
    assert (got.sum(1) >= 1).all() and (got.sum(1) <= 10).all()  # 2 members x 5 samples, no ties


def test_keep_mask_rejects_bad_inputs() -> None:
    synthetic, keys, budgets = (t.to(DEVICE) for t in _vote_case(1, 2, 2, 2, 10))
    with pytest.raises(ValueError, match="budgets must lie"):
        triton_vote.keep_mask(synthetic, keys, torch.zeros_like(budgets), 1.0)
    with pytest.raises(ValueError, match="budgets must lie"):
        triton_vote.keep_mask(synthetic, keys, torch.full_like(budgets, 11), 1.0)
    with pytest.raises(ValueError, match="integer"):
        triton_vote.keep_mask(synthetic, keys, budgets.float(), 1.0)
    with pytest.raises(ValueError, match=r"budgets must be \[4\]"):
        triton_vote.keep_mask(synthetic, keys, budgets[:3], 1.0)
    with pytest.raises(ValueError, match="group"):
        triton_vote.keep_mask(synthetic[:, :3], keys, budgets[:3], 1.0)
    with pytest.raises(ValueError, match="dims"):
        triton_vote.keep_mask(synthetic[..., :4], keys, budgets, 1.0)


@pytest.mark.parametrize("p_nuc", [0.5, 1.0])
def test_the_policy_votes_on_the_device_as_on_the_host(p_nuc: float) -> None:
    """The vote's torch steps where the serving path runs them (`LayerVoter.vote`: statistics
    and queries on the hidden states' device): the synthetic noise comes from the layer's host
    generator on any device, the budgets (p = 1 included: the whole prompt) and the keep mask
    are made beside the keys; the same mask as on the host (one ulp in a logit could move a
    threshold key, so the keys here are spread far apart)."""
    policy, generator = GVotePolicy(), torch.Generator().manual_seed(3)
    mean, std = torch.randn(48, generator=generator, dtype=torch.float64), torch.rand(48, generator=generator)
    query = torch.randn(6, 16, generator=generator)
    keys = torch.randn(3, 40, 16, generator=generator) * 4
    masks = []
    for device in ("cpu", DEVICE):
        hidden = policy.synthetic_hidden(mean.to(device), std.to(device).double(), 4,
                                         policy.layer_generator(7, layer=2))
        synthetic = (hidden.float() @ torch.randn(48, 6 * 16, generator=torch.Generator().manual_seed(5))
                     .to(device)).view(4, 6, 16)
        budgets = policy.step_budgets(query.to(device), keys.to(device), 0.25, p_nuc)
        assert hidden.device.type == budgets.device.type == torch.device(device).type
        masks.append(policy.keep_mask(synthetic, keys.to(device), budgets, 0.25).cpu())
    assert torch.equal(masks[0], masks[1]) and masks[0].any()
    assert bool(masks[0].all()) == (p_nuc >= 1)  # p = 1 keeps every key


def test_packed_heads_write_keys_token_major() -> None:
    """`PackedHeads(keys_by_token=True)` writes (and reads) exactly the layout
    `keys_by_token()` converts a dims-major cache to, which the kernel reads with
    `keys_by_token=True`; values are laid out alike in both."""
    block_size, num_blocks, generator = 16, 5, torch.Generator().manual_seed(11)
    dims_major, token_major = (PackedHeads.from_ranks(K_RANKS, V_RANKS, keys_by_token=flag) for flag in (False, True))
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:50]
    keys, values = torch.randn(50, 3, 32, generator=generator), torch.randn(50, 3, 32, generator=generator)
    caches = []
    for heads in (dims_major, token_major):
        cache = torch.zeros(num_blocks, block_size * heads.row_width)
        heads.write(cache, slots, keys, values, block_size=block_size)
        read_keys, read_values = heads.read(cache, slots, block_size)
        for head, (k, v) in enumerate(zip(read_keys, read_values)):
            assert torch.equal(k, keys[:, head, : K_RANKS[head]]) and torch.equal(v, values[:, head, : V_RANKS[head]])
        caches.append(cache)
    assert torch.equal(triton_fdc.keys_by_token(caches[0], dims_major, block_size), caches[1])
    assert not torch.equal(caches[0], caches[1])
