"""FDC's offline stage: per (layer, KV head) rotations that sort the head's dimensions by weight.

FDC (paper §5.1–5.2) compresses the KV cache along the head dimension, after RoPE:
- **Q/K.** Random tokens go through the model; for each layer and KV head the post-RoPE keys of
  that head and the post-RoPE queries of its GQA group are stacked as rows of one matrix ``X``
  and decomposed, ``X = U Σ Rᵀ``. ``R`` (``[d, d]``, orthogonal) rotates queries and keys alike,
  so ``(qR)(kR)ᵀ = qkᵀ``, and the rotated dimensions come in decreasing order of ``Σ``: keeping
  the first ``k`` columns keeps the strongest ``k`` dimensions of both, with no decompression
  and no re-rotation, since RoPE has already been applied.
- **V.** Palu-style, from the weights: the SVD of the KV head's value projection
  ``W_v = U Σ R_vᵀ`` (``[hidden, d]``); values are cached as ``v R_v[:, :k_v]`` and the attention
  output is turned back by ``R_v[:, :k_v]ᵀ``, which can be folded into ``o_proj``.
- **Ranks.** One singular-value removal rate ``r`` for the whole model (Eq. 1): each head drops
  the longest tail of its spectrum whose share of the spectrum's sum is at most ``r``, so heads
  with flatter spectra keep more dimensions.

Choices the paper leaves open (docs/FDC.md):
- GQA: one rotation per KV head, fitted to its keys and to the queries of every query head of
  its group (the paper pairs "each query head with its key head"; a KV head's cache can hold
  only one rotation, so the group shares it).
- ``X`` is never stored: its Gram matrix ``XᵀX`` is accumulated in float64 over the tokens and
  eigendecomposed (``Σ² `` and ``R`` are its eigenvalues and eigenvectors), so any number of
  tokens costs ``d × d`` per head.
- Each column of ``R`` has its largest entry made positive (SVD signs are arbitrary), so two
  calibrations can be compared entry by entry (the paper's Table 2 / Fig. 14 metric).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

FORMAT = "vllm-kvprune-fdc-1"
DEFAULT_TOKENS = 8192
DEFAULT_SEQ_LEN = 2048
DEFAULT_RATE = 0.1
V_SOURCES = ("values", "weights")  # where V's rotation comes from (docs/FDC.md: why values)
# Architectures the reference forward (`reference/model.py`: Llama-style decoder, full RoPE,
# optional per-head q/k norms; Gemma-3's extra norms, scaled embeddings, per-kind RoPE and
# sliding windows) reproduces, checked against vLLM's `fdc` engine in the tests.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")
_WEIGHT_SUFFIXES = (".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight")


def narrowed_layers(config: dict) -> list[int] | None:
    """The layers FDC narrows: on a hybrid model (`layer_types` with sliding windows) its
    full-attention layers, the ones whose memory grows with the context (a sliding layer's is
    bounded by its window, and it stays vLLM's at full width); None: every layer."""
    types = config.get("layer_types")
    if not types or all(kind == "full_attention" for kind in types):
        return None
    return [index for index, kind in enumerate(types) if kind == "full_attention"]


class FdcFileError(ValueError):
    """A calibration file that cannot be used (unreadable, wrong format, another model)."""


class UnsupportedModelError(ValueError):
    """A model whose queries and keys the reference forward would not reproduce."""


def check_supported(config: dict) -> None:
    """Refuse, in one line, an architecture the calibration cannot fit faithfully."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model type {model_type!r} is not supported by FDC's calibration "
                                    f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


@dataclasses.dataclass
class FdcCalibration:
    """Rotations and ranks of one model, per layer ``L`` and KV head ``H`` (head size ``d``).

    ``qk_rotation`` / ``v_rotation``: ``[L, H, d, d]`` float32, columns in decreasing order of
    ``qk_singular`` / ``v_singular`` (``[L, H, d]``). ``qk_rank`` / ``v_rank``: ``[L, H]`` int,
    the dimensions kept at ``rate``. ``settings``: how the file was made (model fingerprint,
    tokens, seed, rate, ...), checked when it is loaded for a model; on a hybrid model
    ``settings["layers"]`` names the model layers the ``L`` rows are (its full-attention ones).
    """

    qk_rotation: torch.Tensor
    qk_singular: torch.Tensor
    v_rotation: torch.Tensor
    v_singular: torch.Tensor
    qk_rank: torch.Tensor
    v_rank: torch.Tensor
    settings: dict

    @property
    def num_layers(self) -> int:
        return int(self.qk_rotation.shape[0])

    @property
    def layers(self) -> list[int]:
        """The model layers the rows are, in order (every layer unless the file names them)."""
        return list(self.settings.get("layers") or range(self.num_layers))

    @property
    def rows(self) -> dict[int, int]:
        """Model layer -> its row; a layer without one (a hybrid model's sliding-window layer)
        is left whole."""
        return {layer: row for row, layer in enumerate(self.layers)}

    @property
    def num_kv_heads(self) -> int:
        return int(self.qk_rotation.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.qk_rotation.shape[-1])

    def with_rate(self, rate: float, v_rate: float | None = None) -> "FdcCalibration":
        """The same rotations with the ranks a removal rate ``rate`` gives (Eq. 1); V at its
        own rate ``v_rate`` if given (the paper shares one; 0 keeps V whole)."""
        v_rate = rate if v_rate is None else v_rate
        settings = {**self.settings, "rate": rate}
        if v_rate != rate:
            settings["v_rate"] = v_rate
        return dataclasses.replace(
            self, qk_rank=ranks_for_rate(self.qk_singular, rate), v_rank=ranks_for_rate(self.v_singular, v_rate),
            settings=settings,
        )

    def with_uniform_ranks(self, qk_rank: int, v_rank: int) -> "FdcCalibration":
        """Every head at the same ranks (the paper's "without adaptive rates" ablation)."""
        shape = self.qk_rank.shape
        return dataclasses.replace(
            self, qk_rank=torch.full(shape, qk_rank, dtype=torch.int32),
            v_rank=torch.full(shape, v_rank, dtype=torch.int32),
            settings={**self.settings, "rate": None, "uniform_ranks": [qk_rank, v_rank]},
        )

    def with_uniform_ranks_like(self, adaptive: "FdcCalibration") -> "FdcCalibration":
        """Every head at `adaptive`'s mean ranks: the same compression without adaptive rates."""
        return self.with_uniform_ranks(round(float(adaptive.qk_rank.double().mean())),
                                       round(float(adaptive.v_rank.double().mean())))

    def kv_fraction(self) -> float:
        """Cached elements per token over the uncompressed cache's (K and V, all heads)."""
        kept = int(self.qk_rank.sum()) + int(self.v_rank.sum())
        return kept / (2 * self.qk_rank.numel() * self.head_dim)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {name: getattr(self, name).contiguous() for name in _TENSORS}
        save_file(tensors, str(path), metadata={"format": FORMAT, "settings": json.dumps(self.settings)})


_TENSORS = ("qk_rotation", "qk_singular", "v_rotation", "v_singular", "qk_rank", "v_rank")


def load(path: str | Path, model_dir: str | Path | None = None) -> FdcCalibration:
    """Read a calibration file; with ``model_dir``, check that it was made for that model."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FdcFileError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # safetensors raises several types for a foreign or cut file
        raise FdcFileError(f"{path}: not a safetensors file ({error})") from error
    if metadata.get("format") != FORMAT:
        raise FdcFileError(f"{path}: not an FDC calibration (format {metadata.get('format')!r}, "
                           f"expected {FORMAT!r}); make one with `vllm-kvprune calibrate fdc`")
    missing = [name for name in _TENSORS if name not in tensors]
    if missing:
        raise FdcFileError(f"{path}: missing tensors {missing}")
    calibration = FdcCalibration(**{name: tensors[name] for name in _TENSORS},
                                 settings=json.loads(metadata.get("settings", "{}")))
    if model_dir is not None:
        check_model(calibration, model_dir, path)
    return calibration


def check_model(calibration: FdcCalibration, model_dir: str | Path, path: str | Path = "calibration") -> None:
    """Refuse a calibration made for another model (shapes and attention weights)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = model_shape(config)
    made_for = calibration.settings.get("model_shape")
    if made_for is not None and list(made_for) != list(shape):
        raise FdcFileError(f"{path}: made for a model of (layers, KV heads, head size) {tuple(made_for)}, "
                           f"this one is {shape}")
    expected = calibration.settings.get("fingerprint")
    actual = model_fingerprint(model_dir)
    if expected != actual:
        raise FdcFileError(f"{path}: made for another model ({calibration.settings.get('model', '?')}; "
                           f"attention weights differ from {model_dir})")


def model_shape(config: dict) -> tuple[int, int, int]:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"], config.get("num_key_value_heads") or heads, head_dim


def model_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 of the q/k/v projection weights as stored in the model folder's safetensors
    files: what the rotations were fitted to (the HF reference and vLLM read the same files).
    Computed once per folder and process: the front end checks a calibration at several
    points of start-up, and an in-process engine's worker once more."""
    return _fingerprint(str(Path(model_dir).resolve()))


@functools.lru_cache(maxsize=8)
def _fingerprint(model_dir: str) -> str:
    from safetensors import safe_open

    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FdcFileError(f"{model_dir}: no safetensors weights to fingerprint")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(key for key in handle.keys() if key.endswith(_WEIGHT_SUFFIXES)):
                tensor = handle.get_tensor(name)
                digest.update(name.encode())
                digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- ranks ------------------------------------------------------------------------------------
def ranks_for_rate(singular: torch.Tensor, rate: float) -> torch.Tensor:
    """Eq. 1: the fewest leading dimensions whose dropped tail holds at most ``rate`` of the
    spectrum's sum, per head (``singular`` ``[..., d]``, descending). At least one is kept."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate must be in [0, 1), got {rate}")
    values = singular.double().clamp(min=0)
    total = values.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    # tail[..., k] = share of dimensions k..d-1; keep k dims where tail[k] <= rate.
    tail = values.flip(-1).cumsum(-1).flip(-1) / total
    tail = torch.cat([tail, torch.zeros_like(tail[..., :1])], dim=-1)
    fits = tail <= rate + 1e-12
    first = torch.argmax(fits.to(torch.int8), dim=-1)
    return first.clamp(min=1).to(torch.int32)


# ---- fitting ------------------------------------------------------------------------------------
def _descending_eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular values and right singular vectors of X from ``XᵀX`` (``[..., d, d]``),
    in decreasing order, each column's largest entry positive."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    singular = eigenvalues.flip(-1).clamp(min=0).sqrt()
    return singular, _fix_signs(eigenvectors.flip(-1))


def _fix_signs(rotation: torch.Tensor) -> torch.Tensor:
    largest = rotation.abs().argmax(dim=-2, keepdim=True)
    signs = torch.sign(torch.gather(rotation, -2, largest))
    return rotation * torch.where(signs == 0, torch.ones_like(signs), signs)


def value_rotations(model: torch.nn.Module, layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Palu-style V: per layer (``layers``, default all) and KV head, the SVD of the value
    projection ``[hidden, d]``."""
    decoder = model.model if hasattr(model, "model") else model
    rotations, singulars = [], []
    for layer in (decoder.layers if layers is None else [decoder.layers[index] for index in layers]):
        attn = layer.self_attn
        weight = attn.v_proj.weight.detach().double()  # [H * d, hidden]
        per_head = weight.view(-1, attn.head_dim, weight.shape[-1])  # [H, d, hidden]
        _, singular, right_t = torch.linalg.svd(per_head.transpose(1, 2), full_matrices=False)
        rotations.append(_fix_signs(right_t.transpose(1, 2)))
        singulars.append(singular)
    return torch.stack(rotations).float(), torch.stack(singulars).float()


def captures(model: torch.nn.Module, sequences: Iterable[list[int]],
             progress: Callable[[int], None] | None = None) -> Iterator[dict]:
    """Each sequence run through the reference forward (fp32, post-RoPE cache), as the
    per-layer queries, keys (after and before RoPE) and values it captured; one at a time, so
    only one sequence's activations are held."""
    from vllm_kvprune.reference.model import ContiguousKVCache, forward_step

    decoder = model.model if hasattr(model, "model") else model
    for token_ids in sequences:
        capture: dict = {}
        forward_step(model, token_ids, ContiguousKVCache(len(decoder.layers), rope="post"),
                     torch.arange(len(token_ids)), capture=capture)
        yield capture
        if progress is not None:
            progress(len(token_ids))


def grams(model: torch.nn.Module, sequences: Iterable[list[int]],
          progress: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and KV head (float64): ``XᵀX``, ``X`` the post-RoPE keys of the head stacked
    with the post-RoPE queries of its GQA group, and ``VᵀV``, ``V`` the head's values, over
    every token of ``sequences``."""
    decoder = model.model if hasattr(model, "model") else model
    num_layers = len(decoder.layers)
    qk: torch.Tensor | None = None
    values: torch.Tensor | None = None
    for capture in captures(model, sequences, progress):
        for layer, (query, key, value) in enumerate(zip(capture["query"], capture["key"], capture["value"])):
            kv_heads, _, head_dim = key.shape
            group = query.shape[0] // kv_heads
            rows = torch.cat([key.double().unsqueeze(1), query.double().view(kv_heads, group, -1, head_dim)], dim=1)
            rows = rows.reshape(kv_heads, -1, head_dim)
            if qk is None:
                qk = torch.zeros(num_layers, kv_heads, head_dim, head_dim, dtype=torch.float64)
                values = torch.zeros_like(qk)
            qk[layer] += rows.transpose(1, 2) @ rows
            values[layer] += value.double().transpose(1, 2) @ value.double()
    if qk is None:
        raise ValueError("no tokens to calibrate on")
    return qk, values


def random_sequences(vocab_size: int, tokens: int, seq_len: int, seed: int) -> list[list[int]]:
    """``tokens`` token ids drawn uniformly from the vocabulary (seeded), cut into sequences."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (tokens,), generator=generator).tolist()
    return [ids[start:start + seq_len] for start in range(0, tokens, seq_len)]


def fit(model: torch.nn.Module, sequences: Iterable[list[int]], rate: float = DEFAULT_RATE,
        progress: Callable[[int], None] | None = None, settings: dict | None = None,
        v_source: str = "values", layers: list[int] | None = None) -> FdcCalibration:
    """Rotations of a loaded Hugging Face model and the ranks at removal rate ``rate``: Q/K
    from ``sequences``; V from the values of ``sequences`` (``v_source="values"``) or from the
    value projection's weights (``"weights"``, Palu's and the paper's). ``layers``: the model
    layers to fit (`narrowed_layers`; None: every layer), recorded in the settings."""
    if v_source not in V_SOURCES:
        raise ValueError(f"v_source must be one of {V_SOURCES}, got {v_source!r}")
    qk_gram, v_gram = grams(model, sequences, progress)
    if layers is not None:
        qk_gram, v_gram = qk_gram[layers], v_gram[layers]
        settings = {**(settings or {}), "layers": list(layers)}
    qk_singular, qk_rotation = _descending_eigh(qk_gram)
    if v_source == "weights":
        v_rotation, v_singular = value_rotations(model, layers)
    else:
        v_singular, v_rotation = _descending_eigh(v_gram)
        v_rotation, v_singular = v_rotation.float(), v_singular.float()
    settings = {**(settings or {}), "v_source": v_source}
    qk_singular = qk_singular.float()
    return FdcCalibration(
        qk_rotation=qk_rotation.float(), qk_singular=qk_singular, v_rotation=v_rotation, v_singular=v_singular,
        qk_rank=ranks_for_rate(qk_singular, rate), v_rank=ranks_for_rate(v_singular, rate),
        settings={**(settings or {}), "rate": rate},
    )


def calibrate(model_dir: str | Path, *, tokens: int = DEFAULT_TOKENS, seq_len: int = DEFAULT_SEQ_LEN,
              seed: int = 0, rate: float = DEFAULT_RATE, sequences: list[list[int]] | None = None,
              source: str = "random", progress: Callable[[int], None] | None = None,
              v_source: str = "values") -> FdcCalibration:
    """The offline stage on the Hugging Face model in ``model_dir`` (fp32): rotations from
    ``tokens`` random tokens (or the given ``sequences``), ranks at removal rate ``rate``."""
    from vllm_kvprune.reference.model import load_reference_model

    config = json.loads((Path(model_dir) / "config.json").read_text())
    check_supported(config)
    if sequences is None:
        sequences = random_sequences(config["vocab_size"], tokens, seq_len, seed)
    model = load_reference_model(str(model_dir), dtype=torch.float32)
    settings = {
        "model": Path(model_dir).name,
        "model_shape": list(model_shape(config)),
        "fingerprint": model_fingerprint(model_dir),
        "tokens": sum(len(sequence) for sequence in sequences),
        "seq_len": max(len(sequence) for sequence in sequences),
        "seed": seed,
        "source": source,
        "gqa": "one rotation per KV head, fitted to its keys and its group's queries",
    }
    return fit(model, sequences, rate, progress, settings, v_source, narrowed_layers(config))


# ---- the paper's observations -----------------------------------------------------------------
def max_singular_cv(singular: torch.Tensor) -> float:
    """Coefficient of variation of each head's largest singular value over all (layer, head)
    (FDC Tables 3/4)."""
    largest = singular[..., 0].double().flatten()
    return float(largest.std(unbiased=False) / largest.mean())


def rotation_difference(first: torch.Tensor, second: torch.Tensor) -> float:
    """FDC's Table 2 metric: mean |R_a - R_b| over mean |R_a|, averaged over (layer, head)."""
    deviation = (first.double() - second.double()).abs().mean(dim=(-2, -1))
    magnitude = first.double().abs().mean(dim=(-2, -1))
    return float((deviation / magnitude).mean())


def subspace_overlap(first: torch.Tensor, second: torch.Tensor, ranks: torch.Tensor) -> float:
    """Share of the kept subspace two calibrations agree on, mean over (layer, head):
    ``‖R_a[:, :k]ᵀ R_b[:, :k]‖²_F / k`` (1 = the same ``k`` dimensions, whatever their order
    and signs)."""
    overlaps = []
    for index in torch.cartesian_prod(*(torch.arange(size) for size in ranks.shape)).view(-1, ranks.dim()):
        layer, head = (int(value) for value in index)
        k = int(ranks[layer, head])
        product = first[layer, head, :, :k].double().T @ second[layer, head, :, :k].double()
        overlaps.append(float((product ** 2).sum()) / k)
    return sum(overlaps) / len(overlaps)


def spectrum_summary(calibration: FdcCalibration) -> dict:
    """What the report prints and writes: the mean normalised spectra (FDC Fig. 3), the spread
    of the largest singular values (Tables 3/4), the ranks per layer, the compression."""
    def mean_normalised(singular: torch.Tensor) -> list[float]:
        return (singular.double() / singular[..., :1].double().clamp(min=1e-30)).mean(dim=(0, 1)).tolist()

    return {
        "rate": calibration.settings.get("rate"),
        "kv_fraction": calibration.kv_fraction(),
        "compression": 1.0 - calibration.kv_fraction(),
        "qk_max_singular_cv": max_singular_cv(calibration.qk_singular),
        "v_max_singular_cv": max_singular_cv(calibration.v_singular),
        "qk_mean_spectrum": mean_normalised(calibration.qk_singular),
        "v_mean_spectrum": mean_normalised(calibration.v_singular),
        "qk_rank": calibration.qk_rank.tolist(),
        "v_rank": calibration.v_rank.tolist(),
        "qk_rank_mean": float(calibration.qk_rank.double().mean()),
        "v_rank_mean": float(calibration.v_rank.double().mean()),
        "head_dim": calibration.head_dim,
        "layers": calibration.layers,  # the model layers of the rows above (a hybrid model: its full-attention ones)
    }


def rank_granule(ranks: torch.Tensor, granule: int, head_dim: int) -> torch.Tensor:
    """Ranks rounded up to a multiple of ``granule`` (what a kernel that needs aligned widths
    would store), capped at the head size."""
    return torch.clamp(torch.ceil(ranks.double() / granule) * granule, max=head_dim).to(torch.int32)


def describe(calibration: FdcCalibration) -> str:
    """A few lines for the terminal."""
    summary = spectrum_summary(calibration)
    lines = [
        f"removal rate r = {summary['rate']}: KV cache at {summary['kv_fraction']:.1%} of full "
        f"({summary['compression']:.1%} compression); mean rank Q/K {summary['qk_rank_mean']:.1f}, "
        f"V {summary['v_rank_mean']:.1f} of {summary['head_dim']}",
        f"spread of each head's largest singular value (CV): Q/K {summary['qk_max_singular_cv']:.1%}, "
        f"V {summary['v_max_singular_cv']:.1%}",
        "ranks per layer (Q/K | V, one entry per KV head):",
    ]
    for layer, qk, v in zip(calibration.layers, summary["qk_rank"], summary["v_rank"]):
        lines.append(f"  layer {layer:>2}: {' '.join(f'{r:>3}' for r in qk)} | {' '.join(f'{r:>3}' for r in v)}")
    return "\n".join(lines)

