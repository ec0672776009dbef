"""`positions: cache` re-anchors sink keys with the layer's own RoPE: rotating a cached key
(rotated at position j) forward by `shift` must give the key rotated at j + shift, for every
RoPE variant vLLM builds (NeoX and GPT-J styles, partial rotary, llama3, YaRN, dynamic NTK)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def vllm_config_context():
    """vLLM's RoPE modules are custom ops, built only inside a config context."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield

ROPES = {
    "neox": dict(head_size=64, is_neox_style=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gptj-partial": dict(head_size=32, is_neox_style=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "gptj-full": dict(head_size=32, is_neox_style=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "llama3": dict(head_size=64, is_neox_style=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "yarn": dict(head_size=32, is_neox_style=True,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "original_max_position_embeddings": 128}),
    "dynamic": dict(head_size=32, is_neox_style=True,
                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
}


@pytest.mark.parametrize("name", ROPES)
def test_rotation_moves_a_cached_key_forward(name: str) -> None:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_kvprune import vllm_hooks

    settings = ROPES[name]
    rope = get_rope(settings["head_size"], max_position=4096, is_neox_style=settings["is_neox_style"],
                    rope_parameters=settings["rope_parameters"], dtype=torch.float32)
    rotate = vllm_hooks.rope_rotation(rope)
    assert rotate is not None, f"{type(rope).__name__} should be a plain rotation"
    gen = torch.Generator().manual_seed(0)
    heads, head_size = 3, settings["head_size"]
    keys = torch.randn(6, heads * head_size, generator=gen)
    positions = torch.tensor([0, 1, 2, 3, 7, 100])
    shifts = torch.tensor([0, 5, 64, 300, 1000, 2000])

    def at(where: torch.Tensor) -> torch.Tensor:
        query = torch.zeros_like(keys)
        _, rotated = rope.forward_native(where, query, keys.clone())
        return rotated.view(-1, heads, head_size)

    moved = rotate(at(positions), shifts)
    torch.testing.assert_close(moved, at(positions + shifts), rtol=1e-4, atol=2e-4)
    # and the rotation is a real one: zero shift changes nothing, another shift does
    torch.testing.assert_close(rotate(at(positions), torch.zeros_like(shifts)), at(positions))
    assert not torch.allclose(moved[1:], at(positions)[1:], atol=1e-2)


@pytest.mark.parametrize("name", ["neox", "gptj-partial"])
def test_rotation_past_the_table(name: str) -> None:
    """A stream longer than the model's positions re-anchors sinks past RoPE's table: the shift
    is applied in parts, and equals the rotation a table long enough gives."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_kvprune import vllm_hooks

    settings = ROPES[name]

    def build(max_position: int):
        return get_rope(settings["head_size"], max_position=max_position, is_neox_style=settings["is_neox_style"],
                        rope_parameters=settings["rope_parameters"], dtype=torch.float32)

    short, long = build(256), build(4096)
    heads, head_size = 2, settings["head_size"]
    keys = torch.randn(4, heads * head_size, generator=torch.Generator().manual_seed(1))
    positions, shifts = torch.tensor([0, 3, 10, 200]), torch.tensor([255, 256, 700, 3000])

    def at(rope, where: torch.Tensor) -> torch.Tensor:
        _, rotated = rope.forward_native(where, torch.zeros_like(keys), keys.clone())
        return rotated.view(-1, heads, head_size)

    moved = vllm_hooks.rope_rotation(short)(at(short, positions), shifts)
    torch.testing.assert_close(moved, at(long, positions + shifts), rtol=1e-4, atol=5e-4)


def test_a_rope_that_is_not_a_plain_rotation_is_refused() -> None:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_kvprune import vllm_hooks

    deepseek = get_rope(64, max_position=4096, is_neox_style=True, dtype=torch.float32,
                        rope_parameters={"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 0.0})
    assert vllm_hooks.rope_rotation(deepseek) is None
    assert vllm_hooks.rope_rotation(torch.nn.Identity()) is None
