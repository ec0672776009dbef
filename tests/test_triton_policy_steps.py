"""The impl's work around the attention kernel (`PolicyAttentionImpl`, shared by the CPU and GPU
wrappers) carried out with the GPU kernel set: step plans, writes to planned slots, moves,
attention mass and token scores on the cache's device, prompt pruning, h2o's victims searched
where its mass table is (`kernels/victims.py` on a GPU), paged_eviction's on the host. `streaming`, `h2o` and `paged_eviction` steps run twice, with `TritonKernels` on
`DEVICE` (the GPU; Triton's interpreter here) and with the torch references on CPU tensors (the
references the C++ and Triton kernels are tested against, over vLLM's GPU layout); caches,
score tables, choices and attention outputs must agree.

No vLLM and no conftest: on a GPU machine `pytest -m triton --noconftest tests/` runs this, and
there it is the check that every tensor the wrapper hands a kernel is on the cache's device.
vLLM's own cache write, which the impl calls through its parent, is stood in for by the same
kernel set's write (`bench.gpu_steps.StepImpl`, which times these steps on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import triton_setup  # noqa: F401 - before Triton is imported
import numpy as np
import pytest
import torch

from triton_setup import DEVICE
from vllm_kvprune.config import KVPolicyConfig
from vllm_kvprune.kernels import reference
from vllm_kvprune.kernels.layout import gpu_layout
from vllm_kvprune.worker.kernel_sets import KernelSet, TritonKernels
from benchmarks.gpu_steps import StandInMetadata, StepImpl  # vLLM's write and attention stood in for
from vllm_kvprune.worker.state import StepRows, WorkerKVState

pytestmark = pytest.mark.triton

BLOCK_SIZE, HEADS, GROUP, HEAD_DIM, NUM_BLOCKS = 16, 2, 2, 32, 24
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
# Two requests, each over its own blocks of the pool (vLLM's block-table rows).
BLOCK_ROWS = np.array([[3, 9, 4, 17, 0, 22, 6, 11], [5, 2, 20, 8, 13, 1, 15, 7]], np.int32)
PROMPTS = (70, 40)
DECODE_STEPS = 20

POLICIES = {
    "streaming": {"name": "streaming", "budget": 48, "sinks": 4, "prune_interval": 4, "prefill": "full"},
    "h2o": {"name": "h2o", "budget": 48, "sinks": 4, "recent": 8, "prune_interval": 2},
    "paged_eviction": {"name": "paged_eviction", "budget": 48, "sinks": 4, "prune_interval": 1},
}


class ReferenceKernels(KernelSet):
    """The torch references over vLLM's GPU layout, on CPU tensors."""

    @staticmethod
    def layout(kv_cache: torch.Tensor):
        return gpu_layout(kv_cache.dtype, kv_cache.shape[2], kv_cache.shape[3] // 2)

    def write_slots(self, layer, key, value, kv_cache, slots) -> None:
        reference.write_slots(key, value, kv_cache, slots.cpu().long(), self.layout(kv_cache))

    def copy_slots(self, layer, kv_cache, sources, destinations) -> None:
        reference.copy_slots(kv_cache, sources.cpu().long(), destinations.cpu().long(), self.layout(kv_cache))

    def read_slots(self, layer, kv_cache, slots):
        return reference.read_slots(kv_cache, slots.cpu().long(), self.layout(kv_cache))

    def attention_mass(self, layer, query, kv_cache, block_table, query_rows, key_counts, scale, mass, output,
                       softcap) -> None:
        if mass is None:  # attention alone (vLLM's, stood in for): the mass is thrown away
            mass = torch.zeros(kv_cache.shape[1], kv_cache.shape[0] * kv_cache.shape[2])
        reference.attention_mass(query, kv_cache, self.layout(kv_cache), block_table.cpu(), query_rows.cpu().long(),
                                 key_counts.cpu().long(), scale, mass, output, softcap)


def token_inputs(layer: int, request: int, positions: range) -> tuple[torch.Tensor, ...]:
    """q [n, Hq, D], k, v [n, H, D] of a request's tokens in a layer: the same in every run."""
    out = []
    for position in positions:
        generator = torch.Generator().manual_seed(layer * 1_000_003 + request * 10_007 + position)
        out.append((torch.randn(HEADS * GROUP, HEAD_DIM, generator=generator),
                    torch.randn(HEADS, HEAD_DIM, generator=generator),
                    torch.randn(HEADS, HEAD_DIM, generator=generator)))
    return tuple(torch.stack(part) for part in zip(*out))


def run_steps(policy: dict, kernels: KernelSet, device: str) -> dict:
    """The two requests' prompts (one step each, then both decoding together), every layer's
    impl work as the wrapper does it, through the step's plan; what the run leaves behind, on
    the host (the caches, the score table, every layer's attention output: vLLM's stood in for
    by our kernel without the mass, h2o's fused decode its own)."""
    state = WorkerKVState(KVPolicyConfig.from_dict(policy))
    state.bind_cache(LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEADS, device=device)
    caches = [torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM, device=device) for _ in LAYERS]
    impl = StepImpl(kernels, HEADS * GROUP, HEADS, HEAD_DIM)
    layers = [SimpleNamespace(layer_name=name) for name in LAYERS]
    block_table = torch.from_numpy(BLOCK_ROWS).to(device)
    outputs = []
    schedule = [([0], [PROMPTS[0]], [0]), ([0], [PROMPTS[1]], [1])]
    schedule += [([PROMPTS[0] + i, PROMPTS[1] + i], [1, 1], [0, 1]) for i in range(DECODE_STEPS)]
    for num_computed, num_new, rows in schedule:
        state.rows = StepRows([f"r{r}" for r in rows], np.array(num_computed), np.array([PROMPTS[r] for r in rows]),
                              BLOCK_ROWS[rows], [None] * len(rows))
        plan = state.plan(np.concatenate([[0], np.cumsum(num_new)]), BLOCK_SIZE).to_device(device)
        row_of = np.repeat(np.arange(len(rows)), num_new)
        ends = np.cumsum(num_new)
        key_counts = plan.seq_lens.numpy()[row_of] - (ends[row_of] - 1 - np.arange(len(row_of)))
        metadata = StandInMetadata(block_table[rows].contiguous(), torch.from_numpy(row_of).to(device),
                                   torch.from_numpy(key_counts).to(device), len(row_of))
        plan.prepare(None, metadata)
        for index, (layer, kv_cache) in enumerate(zip(layers, caches)):
            parts = [token_inputs(index, r, range(c, c + n)) for r, c, n in zip(rows, num_computed, num_new)]
            query, key, value = (torch.cat(part).to(device) for part in zip(*parts))
            outputs.append(impl.layer_step(plan, layer, kv_cache, query, key, value, plan.slot_mapping.to(device),
                                           metadata).cpu())
        if getattr(plan, "layer_tables", None) is not None:
            outputs.append(plan.layer_tables.cpu())
    tables = state.tables.by_slot.cpu() if state.tables is not None else None
    return {"caches": [cache.cpu() for cache in caches], "scores": tables, "outputs": outputs,
            "kept": {rid: request.kept_choices() for rid, request in state.requests.items()}}


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_steps_with_the_gpu_kernel_set_match_the_references(name):
    policy = POLICIES[name]
    expected = run_steps(policy, ReferenceKernels(), "cpu")
    got = run_steps(policy, TritonKernels(), DEVICE)
    assert got["kept"] == expected["kept"]
    kind, kept = got["kept"]["r0"]  # the longer request has evicted: within its budget (+ R lazily)
    held = len(kept) if kind == "slots" else len(kept[0][0]) if kind == "heads" else len(kept[0])
    assert 0 < held <= policy["budget"] + policy["prune_interval"] < PROMPTS[0] + DECODE_STEPS
    for got_cache, expected_cache in zip(got["caches"], expected["caches"]):
        assert torch.equal(got_cache, expected_cache)  # bit copies and writes
    if expected["scores"] is not None:
        torch.testing.assert_close(got["scores"], expected["scores"], atol=1e-5, rtol=1e-4)
    assert len(got["outputs"]) == len(expected["outputs"])
    for got_output, expected_output in zip(got["outputs"], expected["outputs"]):
        torch.testing.assert_close(got_output, expected_output.to(got_output.dtype), atol=2e-4, rtol=1e-3)


def test_the_joint_victim_search_on_the_device_chooses_as_the_host_op():
    """h2o's victims for a step's requests at once on the mass table's device (a GPU's sort),
    against the host reference request by request: ragged lengths, counts, windows, ties."""
    from vllm_kvprune.kernels.victims import VictimSearch, lowest_mass_slots_batched

    gen = torch.Generator().manual_seed(3)
    layers, heads, table_slots = 3, 2, 4096
    mass = (torch.randint(0, 10, (layers, heads, table_slots), generator=gen) / 8.0).float()
    pool, searches, start = torch.randperm(table_slots, generator=gen), [], 0
    for n, count, sinks, recent in ((300, 1, 4, 16), (64, 2, 0, 4), (129, 5, 3, 1)):
        held = torch.stack([torch.randperm(n + 30, generator=gen)[:n] for _ in range(layers * heads)])
        searches.append(VictimSearch(pool[start:start + n], held.view(layers, heads, n).numpy(), count, n + 30,
                                     sinks, recent))
        start += n
    found = lowest_mass_slots_batched(mass.to(DEVICE), searches)
    for search, victims in zip(searches, found):
        assert victims.device.type == "cpu"  # one copy back, for the host's maps
        expected = reference.lowest_mass_slots(mass, search.slots, torch.from_numpy(search.logical), search.count,
                                               search.next_position, search.sinks, search.recent)
        assert torch.equal(victims, expected)


def test_fdc_narrow_steps_on_the_device(tmp_path):
    """FDC's work in the wrapper (`FdcLayers`): the new tokens reduced and written into the
    packed narrow cache by the kernel set's narrow write (a padding row, slot -1, skipped:
    Triton's writer on the device, the base set's after finding the real rows), a compaction's move, and the reduced-space attention through the
    kernel set, with the rotations moved beside the cache (`FdcLayers.to`). With
    `TritonKernels` on `DEVICE` (keys token-major, the set's layout) against the torch
    reference on the CPU (dims-major): every slot holds the same bits, outputs close. Heads of
    unequal ranks, a prefill step and a decode step."""
    from vllm_kvprune.fdc.calibration import FdcCalibration
    from vllm_kvprune.kernels.reduced_attention import reduced_attention_reference
    from vllm_kvprune.worker.fdc_layers import FdcLayers
    from vllm_kvprune.worker.fdc_layers import blocks_of as fdc_rows

    class ReferenceAttention(KernelSet):
        def reduced_attention(self, query, kv_cache, block_table, query_start_loc, seq_lens, heads, scale,
                              output_width, block_size):
            return reduced_attention_reference(query.cpu(), kv_cache.cpu(), block_table.cpu(), query_start_loc.cpu(),
                                               seq_lens.cpu(), heads, scale, output_width, block_size)

    generator = torch.Generator().manual_seed(0)
    rotations = [torch.linalg.qr(torch.randn(len(LAYERS), HEADS, HEAD_DIM, HEAD_DIM, generator=generator)).Q
                 for _ in range(2)]
    singular = torch.linspace(1, 0, HEAD_DIM).expand(len(LAYERS), HEADS, -1).contiguous()
    ranks = (torch.tensor([[24, 13], [32, 8]], dtype=torch.int32),
             torch.tensor([[20, 9], [16, 32]], dtype=torch.int32))
    FdcCalibration(rotations[0], singular, rotations[1], singular.clone(), *ranks, settings={}).save(
        tmp_path / "fdc.safetensors")

    def run(kernels: KernelSet, device: str) -> tuple[list, list]:
        fdc = FdcLayers(str(tmp_path / "fdc.safetensors"), None, keys_by_token=kernels.fdc_keys_by_token).to(device)
        caches, outputs = [], []
        for layer in range(len(LAYERS)):
            width = fdc.layer_widths[layer]  # the spec's [num_blocks, H, block_size, 2 * head_size] as rows
            cache = torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, width // HEADS, device=device)
            for rows, lengths, computed in (([0, 1], PROMPTS, [0, 0]), ([0, 1], [1, 1], list(PROMPTS))):
                parts = [token_inputs(layer, r, range(c, c + n)) for r, c, n in zip(rows, computed, lengths)]
                query, key, value = (torch.cat(part).to(device) for part in zip(*parts))
                positions = [np.arange(c, c + n) for c, n in zip(computed, lengths)]
                slots = np.concatenate([BLOCK_ROWS[r][p // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + p % BLOCK_SIZE
                                        for r, p in zip(rows, positions)])
                # Plus one padding row (slot -1, as vLLM pads a batch): the set's narrow write skips it.
                padded = [torch.cat([part, part[:1]]) for part in (key, value)]
                fdc.write(layer, *padded, cache, torch.from_numpy(np.append(slots, -1)).to(device), BLOCK_SIZE,
                          writer=kernels.write_narrow)
                seq_lens = torch.tensor([c + n for c, n in zip(computed, lengths)], dtype=torch.int32, device=device)
                starts = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
                outputs.append(fdc.attend(layer, query, cache, torch.from_numpy(BLOCK_ROWS[rows]).to(device), starts,
                                          seq_lens, HEAD_DIM ** -0.5, BLOCK_SIZE,
                                          attention=kernels.reduced_attention).cpu())
            # A compaction: request 0's tokens 40.. move down over 8.., in one staged copy.
            sources, destinations = (BLOCK_ROWS[0][p // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + p % BLOCK_SIZE
                                     for p in (np.arange(40, 60), np.arange(8, 28)))
            fdc.copy(layer, cache, torch.from_numpy(sources).to(device), torch.from_numpy(destinations).to(device),
                     BLOCK_SIZE)
            # What every written slot holds, per head (the two runs' layouts differ: the GPU set's
            # keys are token-major).
            written = np.concatenate([BLOCK_ROWS[r][np.arange(n + 1) // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
                                      + np.arange(n + 1) % BLOCK_SIZE for r, n in enumerate(PROMPTS)])
            keys, values = fdc.layers[layer].heads.read(fdc_rows(cache), torch.from_numpy(written).to(device),
                                                        BLOCK_SIZE)
            caches.append([part.cpu() for part in keys + values])
        return caches, outputs

    expected_caches, expected_outputs = run(ReferenceAttention(), "cpu")
    caches, outputs = run(TritonKernels(), DEVICE)
    for got_layer, expected_layer in zip(caches, expected_caches):
        for got, expected in zip(got_layer, expected_layer):
            assert torch.equal(got, expected)  # bit copies of the same reduced values
    for got, expected in zip(outputs, expected_outputs):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
