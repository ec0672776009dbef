"""Tiny random models of other attention architectures, built offline with transformers.

Each exercises one attention feature a policy must honour or refuse (see
`vllm_kvprune/worker/features.py` and the model matrix in `docs/MODELS.md`): qkv bias,
q/k norm, partial rotary, RoPE scaling, GPT-J-style (non-NeoX) RoPE, sliding windows,
hybrid sliding/full layers, logit soft-capping, ALiBi, learned attention sinks. They cost
a second to build and a few seconds to start, so the tests can cover the architectures
users serve without downloading anything.

Weights: the model class's own initialisation under a fixed seed (`initializer_range`
0.06, sharper than the usual 0.02, so that context matters), then biases redrawn (a zero
bias would hide a dropped qkv bias), learned sinks redrawn, an untied `lm_head` redrawn at
a large scale (wide top-1/top-2 margins), and for tied-embedding models a few edits that
keep them from repeating their last input token (listed per model). Each folder is cached
under the assets home with a manifest, like the other assets (`tools/assets.py`).

Command line, from the repository root: ``python -m tools.model_zoo [NAME ...]`` builds them and
prints paths.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tools import assets

ZOO_RECIPE = 1
SEED = 1234
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.06)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One tiny architecture: transformers config class and kwargs, model class, weight edits
    (("normal", name part, std) or ("fill", name part, value)), the attention features it
    exercises, and engine arguments it needs (e.g. an fp8 KV cache)."""

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    features: tuple[str, ...]
    edits: tuple[tuple[str, str, float], ...] = ()
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def source(self) -> dict[str, Any]:
        spec = dataclasses.asdict(self)
        spec.pop("engine_args")
        return {"kind": "zoo", "recipe": ZOO_RECIPE, "seed": SEED, "spec": spec}


_GEMMA_EDITS = (("normal", "embed_tokens.weight", 0.01), ("fill", "post_attention_layernorm.weight", 3.0),
                ("fill", "post_feedforward_layernorm.weight", 3.0), ("fill", "model.norm.weight", 30.0))

ZOO: dict[str, ZooModel] = {model.name: model for model in (
    ZooModel("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
             dict(**_SMALL, rope_parameters=_ROPE, tie_word_embeddings=False), ("GQA", "qkv bias")),
    ZooModel("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
             dict(**_SMALL, head_dim=64, rope_parameters=_ROPE, tie_word_embeddings=False), ("GQA", "q/k norm")),
    ZooModel("phi", "PhiConfig", "PhiForCausalLM",
             dict(**{**_SMALL, "hidden_size": 256, "intermediate_size": 512},
                  rope_parameters={**_ROPE, "partial_rotary_factor": 0.5}, tie_word_embeddings=False),
             ("partial rotary", "RoPE applied by transformers (vLLM's Transformers backend)")),
    ZooModel("llama3", "LlamaConfig", "LlamaForCausalLM",
             dict(**_SMALL, head_dim=32, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 256}),
             ("GQA", "RoPE scaling (llama3)")),
    ZooModel("gptj", "GPTJConfig", "GPTJForCausalLM",
             dict(n_embd=128, n_layer=2, n_head=4, rotary_dim=16, n_inner=256, n_positions=4096,
                  tie_word_embeddings=False, initializer_range=0.06),
             ("GPT-J-style (non-NeoX) RoPE", "partial rotary")),
    ZooModel("cohere", "CohereConfig", "CohereForCausalLM",
             dict(**_SMALL, rope_parameters=_ROPE, logit_scale=1.0, tie_word_embeddings=True),
             ("GPT-J-style (non-NeoX) RoPE", "GQA"),
             edits=(("normal", "embed_tokens.weight", 0.01), ("normal", "o_proj.weight", 0.3),
                    ("normal", "down_proj.weight", 0.3), ("normal", "q_proj.weight", 0.15),
                    ("normal", "k_proj.weight", 0.15))),
    ZooModel("mistral", "MistralConfig", "MistralForCausalLM",
             dict(**_SMALL, head_dim=32, rope_parameters=_ROPE, sliding_window=64, tie_word_embeddings=False),
             ("sliding window (every layer)",)),
    ZooModel("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
             dict(**{**_SMALL, "num_hidden_layers": 4}, head_dim=32, rope_parameters=_ROPE,
                  query_pre_attn_scalar=32, sliding_window=64,
                  layer_types=["sliding_attention", "full_attention"] * 2,
                  attn_logit_softcapping=5.0, final_logit_softcapping=5.0, tie_word_embeddings=True),
             ("hybrid sliding/full layers", "logit soft-capping"),
             edits=(*_GEMMA_EDITS, ("normal", "q_proj.weight", 0.2), ("normal", "k_proj.weight", 0.2))),
    ZooModel("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
             dict(**{**_SMALL, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=32,
                  sliding_window=64, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                  tie_word_embeddings=True),
             ("hybrid sliding/full layers (5:1 style)", "q/k norm", "per-layer RoPE base"),
             edits=(*_GEMMA_EDITS, ("fill", "q_norm.weight", 1.0), ("fill", "k_norm.weight", 1.0))),
    ZooModel("bloom", "BloomConfig", "BloomForCausalLM",
             dict(hidden_size=128, n_layer=2, n_head=4, tie_word_embeddings=True, initializer_range=0.06),
             ("ALiBi",),
             edits=(("fill", "word_embeddings_layernorm.weight", 0.05), ("normal", "self_attention.dense.weight", 0.3),
                    ("normal", "dense_4h_to_h.weight", 0.3))),
    ZooModel("gptoss", "GptOssConfig", "GptOssForCausalLM",
             dict(**{**_SMALL, "intermediate_size": 128}, head_dim=32, num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
                  tie_word_embeddings=False),
             ("attention sinks (learned)", "hybrid sliding/full layers", "RoPE scaling (YaRN)")),
    # vLLM's CPU MLA kernel takes only DeepSeek's latent width (512 + 64); dense layers (no MoE).
    ZooModel("deepseek-mla", "DeepseekV2Config", "DeepseekV2ForCausalLM",
             dict(**{**_SMALL, "num_key_value_heads": 4}, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                  qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2, moe_intermediate_size=64,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, tie_word_embeddings=False),
             ("MLA (a latent KV cache shared by all heads)",)),
    ZooModel("llama-fp8", "LlamaConfig", "LlamaForCausalLM",
             dict(**_SMALL, head_dim=32, rope_parameters=_ROPE, tie_word_embeddings=False),
             ("fp8 KV cache",), engine_args={"kv_cache_dtype": "fp8"}),
)}


def zoo_model_dir(name: str) -> Path:
    """Cached folder of the tiny `name` model (fp32 safetensors, SmolLM2's tokenizer)."""
    model = ZOO[name]
    folder, _ = assets._ensure(f"zoo-{name}", model.source(), lambda staging: _build(model, staging))
    return folder


def _build(model: ZooModel, staging: Path) -> None:
    import torch
    import transformers

    assets._copy_files(assets.tokenizer_dir(), staging)
    vocab_size = len(json.loads((staging / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    config = getattr(transformers, model.config_class)(vocab_size=vocab_size, **_IDS, **model.config)
    config.architectures = [model.model_class]
    assets._say(f"generating the tiny {model.name} ({model.model_class}, seed {SEED})")
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        network = getattr(transformers, model.model_class)(config).to(torch.float32).eval()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        with torch.no_grad():
            for name, parameter in network.named_parameters():
                leaf = name.split(".")
                if name.endswith("bias") and "norm" not in name and not leaf[-2].startswith("ln"):
                    parameter.normal_(0.0, 0.02)
                elif name.endswith("sinks"):
                    parameter.normal_(0.0, 1.0)
                elif name.startswith("lm_head") and not tied:
                    parameter.normal_(0.0, 1.0)
            for operation, part, value in model.edits:
                for name, parameter in network.named_parameters():
                    if part in name:
                        parameter.normal_(0.0, value) if operation == "normal" else parameter.fill_(value)
    network.save_pretrained(str(staging))
    transformers.GenerationConfig(**_IDS).save_pretrained(str(staging))


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(ZOO)
    for name in names:
        print(f"{name}: {zoo_model_dir(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
