"""`vllm-kvprune calibrate fdc MODEL --out FILE`: FDC's offline stage, with a report.

Runs random tokens (seeded) through the Hugging Face model in ``MODEL`` (a local folder), fits
one rotation per layer and KV head to the post-RoPE keys and queries, decomposes the value
projections, picks each head's ranks at the removal rate ``--rate`` and writes a safetensors
file for ``--kv-fdc``. The report gives the compression, the spread of the heads' largest
singular values (FDC Tables 3/4) and the ranks per layer; ``--report`` also writes it as JSON
with the mean spectra (FDC Fig. 3). ``--compare FILE`` measures how far this calibration's
rotations are from another's (FDC Table 2: random tokens vs essays, or two token counts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence

from vllm_kvprune.fdc import calibration as fdc

TARGET_EVAL_TOKENS = 1024  # perplexity text of --target-accuracy when --eval-tokens is not given


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) (the share of each head's spectrum dropped), got {text}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be >= 1 (perplexity allowed, as a multiple of the uncompressed "
                                         f"cache's), got {text}")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-kvprune calibrate fdc", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("model", metavar="MODEL", help="a local Hugging Face model folder (config.json, *.safetensors)")
    add("--out", required=True, type=Path, help="the calibration file to write (safetensors)")
    add("--tokens", type=_positive, default=fdc.DEFAULT_TOKENS,
        help=f"calibration tokens (default {fdc.DEFAULT_TOKENS}; FDC needs at least 8K)")
    add("--seq-len", type=_positive, default=fdc.DEFAULT_SEQ_LEN,
        help=f"tokens per sequence fed to the model (default {fdc.DEFAULT_SEQ_LEN})")
    add("--seed", type=int, default=0, help="seed of the random tokens (default 0)")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--rate", type=_rate, default=None,
                        help=f"singular-value removal rate r, one for every head (FDC Eq. 1; default {fdc.DEFAULT_RATE})")
    chosen.add_argument("--target-accuracy", type=_ratio, default=None, metavar="PPL_RATIO",
                        help="pick the largest rate whose perplexity on essay text (--eval-tokens, default "
                             f"{TARGET_EVAL_TOKENS}; --eval-offset) is at most PPL_RATIO x the uncompressed "
                             "cache's, e.g. 1.05")
    add("--source", choices=("random", "essays"), default="random",
        help="calibration tokens: uniform random ids (FDC's choice, default) or essay text")
    add("--v-source", choices=fdc.V_SOURCES, default="values",
        help="V's rotation: an SVD of the calibration tokens' values (default), or of the value "
             "projection's weights (Palu's, the paper's; on SmolLM2 dropping one dimension so "
             "breaks the model, docs/FDC.md)")
    add("--report", type=Path, default=None, help="also write the report as JSON here")
    add("--compare", type=Path, default=None,
        help="another calibration of the same model: report how far the rotations are apart")
    add("--eval-tokens", type=int, default=0,
        help="also measure perplexity of this many essay tokens (one sequence, fp32 reference) "
             "through the compressed cache vs the full one (default 0: skip)")
    add("--eval-offset", type=int, default=0,
        help="essay token where the perplexity text starts (default 0; past --tokens for text "
             "that --source essays did not calibrate on)")
    add("--eval-rates", type=_rate, nargs="+", default=None,
        help="removal rates of the perplexity sweep (default: --rate only); each also with uniform ranks")
    add("--eval-pre-rope", action="store_true",
        help="the sweep also cuts the keys before RoPE at the same ranks (Palu-style ablation; "
             "fits the pre-RoPE keys on the calibration tokens)")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        parser.error(f"argument MODEL: {args.model} is not a model folder (no config.json)")
    config = json.loads((model / "config.json").read_text())
    try:
        fdc.check_supported(config)
    except fdc.UnsupportedModelError as error:
        parser.error(f"argument MODEL: {error}")
    if args.eval_pre_rope and fdc.narrowed_layers(config) is not None:
        parser.error("argument --eval-pre-rope: not on a hybrid model (FDC narrows only its full-attention layers)")
    if args.eval_tokens < 0:
        parser.error(f"argument --eval-tokens: must be 0 or more, got {args.eval_tokens}")
    if args.eval_offset < 0:
        parser.error(f"argument --eval-offset: must be 0 or more, got {args.eval_offset}")
    if args.eval_pre_rope and args.eval_tokens == 0:
        parser.error("argument --eval-pre-rope: needs --eval-tokens (it is a column of the perplexity sweep)")
    if not args.out.parent.is_dir():
        parser.error(f"argument --out: folder {args.out.parent} does not exist")
    if args.compare is not None:
        try:
            fdc.load(args.compare, model)
        except fdc.FdcFileError as error:
            parser.error(f"argument --compare: {error}")


def _essay_sequences(model: Path, tokens: int, seq_len: int) -> list[list[int]]:
    """The first `tokens` tokens of the essays (`fdc.essays`), in sequences of `seq_len`."""
    from transformers import AutoTokenizer

    from vllm_kvprune.fdc.essays import essays_text

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer(essays_text(), add_special_tokens=False)["input_ids"][:tokens]
    return [ids[start:start + seq_len] for start in range(0, len(ids), seq_len)]


def _evaluate(model_dir: Path, calibration: fdc.FdcCalibration, tokens: int, offset: int,
              rates: list[float], pre_rope_sequences: list[list[int]] | None = None) -> dict:
    from vllm_kvprune.fdc.evaluate import sweep
    from vllm_kvprune.fdc.pre_rope import fit_pre_rope_keys
    from vllm_kvprune.reference.model import load_reference_model

    token_ids = _essay_sequences(model_dir, offset + tokens, offset + tokens)[0][offset:]
    model = load_reference_model(str(model_dir))
    pre_rope = None if pre_rope_sequences is None else fit_pre_rope_keys(model, pre_rope_sequences)
    none, points = sweep(model, calibration, token_ids, rates, pre_rope)
    print(f"perplexity of {len(token_ids)} essay tokens: none {none:.3f}")
    print("  rate  KV kept  perplexity (vs none) | uniform ranks: KV kept  perplexity (vs none)"
          + (" | keys cut before RoPE: perplexity (vs none)" if pre_rope is not None else ""))
    for point in points:
        line = (f"  {point.rate:4.2f}  {point.kv_fraction:7.1%}  {point.perplexity:10.3f} ({point.perplexity / none:5.3f}x) |"
                f"                {point.uniform_kv_fraction:7.1%}  {point.uniform_perplexity:10.3f} "
                f"({point.uniform_perplexity / none:5.3f}x)")
        if point.pre_rope_perplexity is not None:
            line += f" | {point.pre_rope_perplexity:10.3f} ({point.pre_rope_perplexity / none:5.3f}x)"
        print(line)
    return {"tokens": len(token_ids), "offset": offset, "none": none, "points": [dataclasses.asdict(point) for point in points]}


def _search_rate(model_dir: Path, calibration: fdc.FdcCalibration, target: float, tokens: int, offset: int):
    """`evaluate.rate_for_target` on `tokens` essay tokens from `offset`, printed as it goes."""
    from vllm_kvprune.fdc.evaluate import rate_for_target
    from vllm_kvprune.reference.model import load_reference_model

    token_ids = _essay_sequences(model_dir, offset + tokens, offset + tokens)[0][offset:]
    search = rate_for_target(load_reference_model(str(model_dir)), calibration, token_ids, target)
    print(f"target: perplexity <= {target} x none ({search.none:.3f}) on {len(token_ids)} essay tokens")
    for rate, value, kept in search.tried:
        verdict = "meets" if value <= target * search.none else "misses"
        print(f"  rate {rate:<8g} KV kept {kept:6.1%}  perplexity {value:.3f} ({value / search.none:.3f}x) {verdict}")
    if search.rate is not None:
        print(f"chosen rate: {search.rate}")
    return search


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    from tqdm import tqdm

    model = Path(args.model)
    rate = fdc.DEFAULT_RATE if args.rate is None else args.rate
    # Made here, not inside `calibrate`, so the pre-RoPE ablation fits on the very same tokens.
    sequences = (_essay_sequences(model, args.tokens, args.seq_len) if args.source == "essays" else
                 fdc.random_sequences(json.loads((model / "config.json").read_text())["vocab_size"], args.tokens,
                                      args.seq_len, args.seed))
    with tqdm(total=args.tokens, desc="calibrating", unit="tok", dynamic_ncols=True) as bar:
        result = fdc.calibrate(model, tokens=args.tokens, seq_len=args.seq_len, seed=args.seed, rate=rate,
                               sequences=sequences, source=args.source, progress=bar.update,
                               v_source=args.v_source)
    search = None
    if args.target_accuracy is not None:
        search = _search_rate(model, result, args.target_accuracy, args.eval_tokens or TARGET_EVAL_TOKENS,
                              args.eval_offset)
        if search.rate is None:
            print(f"no removal rate meets perplexity <= {args.target_accuracy} x the uncompressed cache's "
                  f"(the smallest tried, {search.tried[0][0]}, gives {search.tried[0][1] / search.none:.3f}x); "
                  "nothing written", file=sys.stderr)
            return 1
        result = result.with_rate(search.rate)
        result.settings.update(target_accuracy=args.target_accuracy, target_eval_tokens=search.num_tokens,
                               target_eval_offset=args.eval_offset)
        rate = search.rate
    result.save(args.out)
    print(fdc.describe(result))
    from vllm_kvprune.machine import machine_info

    report = {"settings": result.settings, "machine": machine_info(), **fdc.spectrum_summary(result)}
    if args.compare is not None:
        other = fdc.load(args.compare, model)
        report["compared_with"] = {
            "file": str(args.compare),
            "settings": other.settings,
            "qk_rotation_difference": fdc.rotation_difference(other.qk_rotation, result.qk_rotation),
            "qk_subspace_overlap": fdc.subspace_overlap(other.qk_rotation, result.qk_rotation, result.qk_rank),
        }
        compared = report["compared_with"]
        print(f"vs {args.compare}: rotation difference (FDC Table 2) {compared['qk_rotation_difference']:.1%}, "
              f"kept Q/K subspace shared {compared['qk_subspace_overlap']:.1%}")
    if search is not None:
        report["target_search"] = {"target": search.target, "none": search.none, "rate": search.rate,
                                   "tried": [{"rate": r, "perplexity": p, "kv_fraction": f} for r, p, f in search.tried]}
    if args.eval_tokens > 0 and search is None:
        report["perplexity"] = _evaluate(model, result, args.eval_tokens, args.eval_offset,
                                         args.eval_rates or [rate], sequences if args.eval_pre_rope else None)
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.report}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
