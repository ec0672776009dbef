"""FDC's projections in Triton (`kernels/triton/projections.py`) against torch: each head times
its KV head's rotation cut to that head's own rank (odd ranks, a rank of 1, the full width),
GQA groups, bf16 and strided activations, the V rotation read transposed for the output, one
token (decode) up to more than one tile of tokens; and `TritonProjections` against the einsums
FdcLayers runs by default (`worker/fdc_projections.py`)."""

from triton_setup import DEVICE  # noqa: I001  (first: sets TRITON_INTERPRET without a GPU)

import pytest
import torch

from vllm_kvprune.kernels.triton.projections import head_projection

pytestmark = pytest.mark.triton

HEAD_DIM = 32
RANKS = (5, 32, 1, 17)  # per KV head


def _reference(tokens, rotations, out_widths, in_widths, out_width):
    group = tokens.shape[1] // rotations.shape[0]
    out = torch.zeros(tokens.shape[0], tokens.shape[1], out_width)
    for q in range(tokens.shape[1]):
        h = q // group
        n, k = int(out_widths[h]), int(in_widths[h])
        out[:, q, :n] = tokens[:, q, :k].float() @ rotations[h, :k, :n].float()
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 70])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_projection_matches_torch(num_tokens: int, group: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(num_tokens * group)
    heads = len(RANKS)
    # A strided view (k of a fused qkv row), as vLLM hands the layer.
    wide = torch.randn(num_tokens, heads * group + 2, HEAD_DIM, generator=generator).to(dtype)
    tokens = wide[:, 1:1 + heads * group]
    rotations = torch.randn(heads, HEAD_DIM, HEAD_DIM, generator=generator)
    ranks = torch.tensor(RANKS, dtype=torch.int32)
    full = torch.full_like(ranks, HEAD_DIM)
    on_device = [t.to(DEVICE) for t in (tokens, rotations, ranks, full)]
    # Into the reduced space (keys, values, queries) ...
    reduced = head_projection(on_device[0], on_device[1], on_device[2], on_device[3], HEAD_DIM + 3)
    expected = _reference(tokens, rotations, ranks, full, HEAD_DIM + 3)
    torch.testing.assert_close(reduced.cpu(), expected, atol=1e-4, rtol=1e-4)
    # ... and back, the rotation read transposed (the output), each head from its own rank.
    back = head_projection(reduced.to(dtype), on_device[1].transpose(1, 2), on_device[3], on_device[2], HEAD_DIM)
    expected_back = _reference(reduced.cpu().to(dtype), rotations.transpose(1, 2), full, ranks, HEAD_DIM)
    torch.testing.assert_close(back.cpu(), expected_back, atol=1e-4, rtol=1e-4)


def test_head_projection_refuses_what_it_cannot_read() -> None:
    tokens = torch.zeros(2, 4, HEAD_DIM, device=DEVICE)
    rotations = torch.zeros(2, HEAD_DIM, 8, device=DEVICE)
    widths = torch.full((2,), 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="must cover rotations"):
        head_projection(tokens[..., :8], rotations, widths, widths, 8)
    with pytest.raises(ValueError, match="rotations 8 wide for an output 4 wide"):
        head_projection(tokens, rotations, widths, widths, 4)
    with pytest.raises(ValueError, match="in_widths must be int32"):
        head_projection(tokens, rotations, widths, widths.long(), 8)


def test_triton_projections_match_the_einsums() -> None:
    from test_fdc_projections import GROUP, V_RANKS, _fdc, _tokens

    from vllm_kvprune.worker.fdc_projections import EinsumProjections, TritonProjections

    fdc = _fdc(DEVICE)
    einsum, triton_projections = EinsumProjections(fdc.layers), TritonProjections(fdc.layers)
    heads = fdc.num_kv_heads
    for index in range(len(V_RANKS)):
        key = _tokens(9, heads, torch.bfloat16, 1, strided=True).to(DEVICE)
        for actual, expected in zip(triton_projections.keys_values(index, key, key), einsum.keys_values(index, key, key)):
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        query = _tokens(9, heads * GROUP, torch.float32, 3).to(DEVICE)
        reduced = triton_projections.queries(index, query)
        torch.testing.assert_close(reduced, einsum.queries(index, query), atol=1e-5, rtol=1e-5)
        assert triton_projections.output_width(index) == einsum.output_width(index)
        out = torch.randn(9, heads * GROUP, einsum.output_width(index), device=DEVICE)
        torch.testing.assert_close(triton_projections.outputs(index, out), einsum.outputs(index, out),
                                   atol=1e-5, rtol=1e-5)
