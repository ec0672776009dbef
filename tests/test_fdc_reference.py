"""FDC's offline stage and its plain-PyTorch reference.

- the ranks of Eq. 1 against spectra worked by hand;
- the rotations against an explicit SVD of the stacked post-RoPE keys and queries (the Gram
  route must give the same spectrum, an orthogonal R, and drop exactly the tail's energy);
- the reference's zero-masked full-width attention against attention computed in each head's
  truly reduced width, by hand;
- full ranks: FDC equals `none` (fp32 rounding); reduced ranks change the logits, more as the
  rate grows;
- the pre-RoPE ablation (keys cut before RoPE at FDC's ranks): its rotations against an
  explicit SVD of the pre-RoPE keys; at full ranks it equals `none`, at reduced ranks it differs
  from both `none` and FDC; the command's sweep reports it;
- the file: a round trip, and refusals of a foreign model, another format, a cut file;
- `vllm-kvprune calibrate fdc`: writes a file and a report; bad flags exit 2 naming the flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vllm_kvprune.fdc import calibration as fdc  # noqa: E402
from vllm_kvprune.reference.fdc import FdcReference, FdcTransform  # noqa: E402
from vllm_kvprune.reference.budgeted import BudgetedReference  # noqa: E402
from vllm_kvprune.reference.model import ContiguousKVCache, compute_logits, forward_step  # noqa: E402

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices (conftest)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         initializer_range=0.2, attn_implementation="eager")
    model = LlamaForCausalLM(config).float().eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def sequences() -> list[list[int]]:
    return fdc.random_sequences(VOCAB, 192, 96, seed=1)


@pytest.fixture(scope="module")
def calibrated(model, sequences) -> fdc.FdcCalibration:
    return fdc.fit(model, sequences, rate=0.1)


def test_ranks_follow_eq1_on_hand_worked_spectra() -> None:
    spectrum = torch.tensor([[4.0, 3.0, 2.0, 1.0]])  # tail shares from dim k: 1, .6, .3, .1, 0
    assert fdc.ranks_for_rate(spectrum, 0.0).tolist() == [4]
    assert fdc.ranks_for_rate(spectrum, 0.05).tolist() == [4]
    assert fdc.ranks_for_rate(spectrum, 0.1).tolist() == [3]
    assert fdc.ranks_for_rate(spectrum, 0.35).tolist() == [2]
    assert fdc.ranks_for_rate(spectrum, 0.99).tolist() == [1]  # at least one dimension
    flat, steep = torch.ones(1, 8), torch.tensor([[8.0, 1, 1, 1, 1, 1, 1, 1]])
    assert fdc.ranks_for_rate(flat, 0.25).tolist() == [6]
    assert fdc.ranks_for_rate(steep, 0.25).tolist() == [5]  # a steeper head keeps fewer
    with pytest.raises(ValueError):
        fdc.ranks_for_rate(spectrum, 1.0)


def _stacked_rows(model, sequences) -> list[torch.Tensor]:
    """Per layer, [KV heads, rows, d]: each KV head's post-RoPE keys then its group's queries."""
    per_layer: list[list[torch.Tensor]] = []
    for ids in sequences:
        capture: dict = {}
        forward_step(model, ids, ContiguousKVCache(2, rope="post"), torch.arange(len(ids)), capture=capture)
        for layer, (query, key) in enumerate(zip(capture["query"], capture["key"])):
            heads = [torch.cat([key[h], *query[h * 3:(h + 1) * 3]]) for h in range(key.shape[0])]
            if len(per_layer) <= layer:
                per_layer.append([])
            per_layer[layer].append(torch.stack(heads))
    return [torch.cat(chunks, dim=1).double() for chunks in per_layer]


def test_rotations_match_an_explicit_svd_of_the_stacked_queries_and_keys(model, sequences, calibrated) -> None:
    for layer, rows in enumerate(_stacked_rows(model, sequences)):
        for head in range(rows.shape[0]):
            x = rows[head]
            expected = torch.linalg.svdvals(x)
            singular = calibrated.qk_singular[layer, head].double()
            torch.testing.assert_close(singular, expected.float().double(), rtol=1e-4, atol=1e-4)
            rotation = calibrated.qk_rotation[layer, head].double()
            torch.testing.assert_close(rotation.T @ rotation, torch.eye(16, dtype=torch.float64), atol=1e-5, rtol=0)
            # Dropping the columns after k drops exactly the tail's energy.
            k = int(calibrated.qk_rank[layer, head])
            dropped = (x @ rotation[:, k:]).pow(2).sum()
            torch.testing.assert_close(dropped, expected[k:].pow(2).sum(), rtol=1e-3, atol=1e-6)
    assert (calibrated.qk_singular[..., :-1] >= calibrated.qk_singular[..., 1:] - 1e-6).all()


def test_value_rotations_from_the_values_match_an_explicit_svd(model, sequences, calibrated) -> None:
    values: list[list[torch.Tensor]] = [[], []]
    for ids in sequences:
        capture: dict = {}
        forward_step(model, ids, ContiguousKVCache(2, rope="post"), torch.arange(len(ids)), capture=capture)
        for layer, value in enumerate(capture["value"]):
            values[layer].append(value)
    assert calibrated.settings["v_source"] == "values"
    for layer in range(2):
        stacked = torch.cat(values[layer], dim=1).double()  # [KV heads, tokens, d]
        for head in range(2):
            expected = torch.linalg.svdvals(stacked[head])
            torch.testing.assert_close(calibrated.v_singular[layer, head].double(), expected, rtol=1e-4, atol=1e-4)
            rotation = calibrated.v_rotation[layer, head].double()
            torch.testing.assert_close((stacked[head] @ rotation).norm(dim=0), expected, rtol=1e-4, atol=1e-4)


def test_value_rotations_from_the_weights_are_the_svd_of_each_value_projection(model, sequences) -> None:
    calibrated = fdc.fit(model, sequences, rate=0.1, v_source="weights")
    assert calibrated.settings["v_source"] == "weights"
    for layer, block in enumerate(model.model.layers):
        weight = block.self_attn.v_proj.weight.double().view(2, 16, -1)  # [KV heads, d, hidden]
        for head in range(2):
            expected = torch.linalg.svdvals(weight[head])
            torch.testing.assert_close(calibrated.v_singular[layer, head].double(), expected, rtol=1e-5, atol=1e-6)
            rotation = calibrated.v_rotation[layer, head].double()
            # Rows of W_v Rᵀ-ordered: ‖W_vᵀ R[:, i]‖ is the i-th singular value.
            torch.testing.assert_close((weight[head].T @ rotation).norm(dim=0), expected, rtol=1e-5, atol=1e-6)


def test_masked_full_width_attention_equals_attention_in_the_reduced_width(model, calibrated) -> None:
    """One layer's attention done the reference's way (rotated, dropped dims zeroed, full width)
    against the same attention computed with each head's K/Q/V really cut to its ranks."""
    torch.manual_seed(3)
    transform = FdcTransform(calibrated)
    layer, n = 1, 12
    q, k, v = torch.randn(6, n, 16), torch.randn(2, n, 16), torch.randn(2, n, 16)
    qm, km, vm = transform.project(layer, q, k, v)
    scale = 16 ** -0.5
    causal = torch.ones(n, n).tril().bool()
    masked_out = torch.empty(6, n, 16)
    for head in range(6):
        scores = (qm[head] @ km[head // 3].T * scale).masked_fill(~causal, float("-inf"))
        masked_out[head] = torch.softmax(scores, -1) @ vm[head // 3]
    masked_out = transform.restore(layer, masked_out)
    for head in range(6):
        kv = head // 3
        rank, v_rank = int(calibrated.qk_rank[layer, kv]), int(calibrated.v_rank[layer, kv])
        rotation, v_rotation = calibrated.qk_rotation[layer, kv], calibrated.v_rotation[layer, kv]
        q_small, k_small = q[head] @ rotation[:, :rank], k[kv] @ rotation[:, :rank]
        v_small = v[kv] @ v_rotation[:, :v_rank]
        scores = (q_small @ k_small.T * scale).masked_fill(~causal, float("-inf"))
        expected = torch.softmax(scores, -1) @ v_small @ v_rotation[:, :v_rank].T
        torch.testing.assert_close(masked_out[head], expected, rtol=1e-5, atol=1e-5)
    assert (calibrated.qk_rank < 16).any() and (calibrated.v_rank < 16).any()  # something was cut


def _prompt_logits(reference: BudgetedReference, prompt: list[int]) -> torch.Tensor:
    reference.reset()
    return compute_logits(reference.model, reference.step(prompt).hidden)


def test_full_ranks_equal_none_and_reduced_ranks_do_not(model, calibrated) -> None:
    prompt = fdc.random_sequences(VOCAB, 40, 40, seed=7)[0]
    none = BudgetedReference(model, budget=None)
    full = calibrated.with_uniform_ranks(16, 16)
    torch.testing.assert_close(_prompt_logits(FdcReference(model, full), prompt), _prompt_logits(none, prompt),
                               rtol=1e-4, atol=1e-4)
    expected = none.generate(prompt, 8, prompt_logprobs=False)
    assert FdcReference(model, full).generate(prompt, 8, prompt_logprobs=False).token_ids == expected.token_ids
    baseline = _prompt_logits(none, prompt)
    errors = [float((_prompt_logits(FdcReference(model, calibrated.with_rate(rate)), prompt) - baseline).abs().mean())
              for rate in (0.02, 0.1, 0.3)]
    assert errors[1] > 1e-3, errors  # rate 0.1 cuts dimensions (asserted in another test) and shows
    assert errors[0] <= errors[1] < errors[2], errors  # the more is cut, the further from `none`


def test_fdc_composes_with_eviction_only_at_original_positions(model, calibrated) -> None:
    transform = FdcTransform(calibrated)
    with pytest.raises(ValueError, match="positions='original'"):
        BudgetedReference(model, budget=16, positions="cache", head_transform=transform)


def test_pre_rope_rotations_match_an_explicit_svd_of_the_pre_rope_keys(model, sequences) -> None:
    from vllm_kvprune.fdc.pre_rope import fit_pre_rope_keys

    fitted = fit_pre_rope_keys(model, sequences)
    stacked = []
    for token_ids in sequences:
        capture: dict = {}
        forward_step(model, token_ids, ContiguousKVCache(2, rope="post"), torch.arange(len(token_ids)), capture=capture)
        stacked.append(torch.stack(capture["key_pre_rope"]).double())  # [L, H, n, d]
    keys = torch.cat(stacked, dim=2)
    singular = torch.linalg.svdvals(keys)
    torch.testing.assert_close(fitted.singular.double(), singular, rtol=1e-4, atol=1e-4)
    rotation = fitted.rotation.double()
    torch.testing.assert_close(rotation.transpose(-1, -2) @ rotation, torch.eye(16, dtype=torch.float64).expand_as(rotation),
                               rtol=1e-5, atol=1e-5)
    # The keys in the rotated basis have the singular values as column norms, in that order.
    torch.testing.assert_close((keys @ rotation).norm(dim=2), singular, rtol=1e-4, atol=1e-4)
    # Post-RoPE keys are not the pre-RoPE ones: the two fits differ.
    assert not torch.allclose(fitted.singular, fdc.fit(model, sequences, rate=0.1).qk_singular, atol=1e-2)


def test_keys_cut_before_rope_equal_none_at_full_rank_and_differ_from_fdc_below(model, sequences, calibrated) -> None:
    from vllm_kvprune.fdc.evaluate import perplexity
    from vllm_kvprune.fdc.pre_rope import PreRopeTransform, fit_pre_rope_keys

    keys = fit_pre_rope_keys(model, sequences)
    prompt = fdc.random_sequences(VOCAB, 40, 40, seed=7)[0]
    none = _prompt_logits(BudgetedReference(model, budget=None), prompt)

    def logits(calibration: fdc.FdcCalibration) -> torch.Tensor:
        return _prompt_logits(BudgetedReference(model, budget=None,
                                                head_transform=PreRopeTransform(calibration, keys)), prompt)

    torch.testing.assert_close(logits(calibrated.with_uniform_ranks(16, 16)), none, rtol=1e-4, atol=1e-4)
    reduced = calibrated.with_rate(0.1)
    transform = PreRopeTransform(reduced, keys)
    # Each head's key projector keeps exactly FDC's rank of that head.
    traces = transform.key_projector.diagonal(dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(traces, reduced.qk_rank.float(), rtol=1e-4, atol=1e-4)
    before_rope = logits(reduced)
    after_rope = _prompt_logits(FdcReference(model, reduced), prompt)
    assert float((before_rope - none).abs().mean()) > 1e-3
    assert float((before_rope - after_rope).abs().mean()) > 1e-3
    value = perplexity(model, prompt, reduced, keys)
    assert value == pytest.approx(perplexity(model, prompt, reduced, keys)) and value != perplexity(model, prompt, reduced)


# ---- the file -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> tuple:
    from tools import assets

    model_dir = assets.tiny_model_dir()
    path = tmp_path_factory.mktemp("fdc") / "tiny.safetensors"
    calibration = fdc.calibrate(model_dir, tokens=128, seq_len=64, seed=0, rate=0.1)
    calibration.save(path)
    return model_dir, path, calibration


def test_file_round_trip_and_model_check(tiny_file, tmp_path) -> None:
    model_dir, path, calibration = tiny_file
    loaded = fdc.load(path, model_dir)
    for name in ("qk_rotation", "qk_singular", "v_rotation", "v_singular", "qk_rank", "v_rank"):
        assert torch.equal(getattr(loaded, name), getattr(calibration, name)), name
    assert loaded.settings["tokens"] == 128 and loaded.settings["rate"] == 0.1
    assert loaded.settings["fingerprint"] == fdc.model_fingerprint(model_dir)


def test_file_refuses_another_model_another_format_and_a_cut_file(tiny_file, tmp_path) -> None:
    from safetensors.torch import save_file

    from tools import assets

    model_dir, path, calibration = tiny_file
    with pytest.raises(fdc.FdcFileError, match="made for a model of"):
        fdc.load(path, assets.real_model_dir())
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(fdc.FdcFileError, match="not an FDC calibration"):
        fdc.load(other)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(fdc.FdcFileError, match="not a safetensors file"):
        fdc.load(cut)
    with pytest.raises(fdc.FdcFileError, match="no such file"):
        fdc.load(tmp_path / "missing.safetensors")


# ---- the command --------------------------------------------------------------------------------
def _calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_kvprune.cli", "calibrate", *args],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_calibrate_command_writes_a_file_and_a_report(tiny_file, tmp_path) -> None:
    model_dir, first, _ = tiny_file
    out, report = tmp_path / "c.safetensors", tmp_path / "report.json"
    done = _calibrate("fdc", str(model_dir), "--out", str(out), "--tokens", "128", "--seq-len", "64",
                      "--seed", "1", "--rate", "0.2", "--report", str(report), "--compare", str(first))
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = fdc.load(out, model_dir)
    assert loaded.settings["seed"] == 1 and loaded.settings["rate"] == 0.2
    written = json.loads(report.read_text())
    assert len(written["qk_mean_spectrum"]) == 32 and written["qk_mean_spectrum"][0] == pytest.approx(1.0)
    assert 0 < written["compression"] < 1
    assert 0 < written["compared_with"]["qk_subspace_overlap"] <= 1 + 1e-6
    assert "KV cache at" in done.stdout


def test_calibrate_command_refuses_an_architecture_the_reference_does_not_reproduce(tmp_path) -> None:
    from tools.model_zoo import zoo_model_dir

    phi = zoo_model_dir("phi")  # partial rotary embedding, parallel attention/MLP
    done = _calibrate("fdc", str(phi), "--out", str(tmp_path / "phi.safetensors"), "--tokens", "64")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "argument MODEL: model type 'phi' is not supported" in done.stderr, done.stderr
    assert not (tmp_path / "phi.safetensors").exists()


@pytest.mark.parametrize("args, named", [
    (["fdc", "MODEL_DIR"], "--out"),
    (["fdc", "MODEL_DIR", "--out", "OUT", "--rate", "1.5"], "--rate"),
    (["fdc", "MODEL_DIR", "--out", "OUT", "--tokens", "0"], "--tokens"),
    (["fdc", "/nonexistent", "--out", "OUT"], "MODEL"),
    (["fdc", "MODEL_DIR", "--out", "/nonexistent/dir/x.safetensors"], "--out"),
    (["fdc", "MODEL_DIR", "--out", "OUT", "--compare", "/nonexistent.safetensors"], "--compare"),
    (["fdc", "MODEL_DIR", "--out", "OUT", "--eval-pre-rope"], "--eval-pre-rope"),
    (["quantize"], "unknown method"),
    ([], "name the method"),
])
def test_calibrate_command_refuses_bad_input_with_exit_2(tiny_file, tmp_path, args, named) -> None:
    model_dir = tiny_file[0]
    args = [str(model_dir) if arg == "MODEL_DIR" else str(tmp_path / "o.safetensors") if arg == "OUT" else arg
            for arg in args]
    done = _calibrate(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert named in done.stderr, done.stderr


def test_calibrate_command_sweeps_keys_cut_before_rope(tiny_file, tmp_path) -> None:
    model_dir = tiny_file[0]
    report = tmp_path / "p.json"
    done = _calibrate("fdc", str(model_dir), "--out", str(tmp_path / "p.safetensors"), "--tokens", "128",
                      "--seq-len", "64", "--eval-tokens", "64", "--eval-rates", "0.1", "0.3", "--eval-pre-rope",
                      "--report", str(report))
    assert done.returncode == 0, done.stderr[-2000:]
    points = json.loads(report.read_text())["perplexity"]["points"]
    assert [point["rate"] for point in points] == [0.1, 0.3]
    assert all(point["pre_rope_perplexity"] > 0 and point["pre_rope_perplexity"] != point["perplexity"]
               for point in points)
    assert "keys cut before RoPE" in done.stdout


def test_calibrate_command_picks_the_largest_rate_that_meets_a_target(tiny_file, tmp_path) -> None:
    """--target-accuracy: the chosen rate meets the perplexity bound and the next rate tried
    above it does not (or it is the ladder's top); the file records the target and the rate."""
    model_dir = tiny_file[0]
    out, report = tmp_path / "t.safetensors", tmp_path / "t.json"
    done = _calibrate("fdc", str(model_dir), "--out", str(out), "--tokens", "128", "--seq-len", "64",
                      "--target-accuracy", "1.01", "--eval-tokens", "96", "--report", str(report))
    assert done.returncode == 0, done.stderr[-2000:]
    search = json.loads(report.read_text())["target_search"]
    loaded = fdc.load(out, model_dir)
    assert loaded.settings["rate"] == search["rate"] and loaded.settings["target_accuracy"] == 1.01
    tried = {point["rate"]: point["perplexity"] for point in search["tried"]}
    bound = 1.01 * search["none"]
    assert tried[search["rate"]] <= bound
    above = [rate for rate in tried if rate > search["rate"]]
    assert above and all(tried[rate] > bound for rate in above)
    assert torch.equal(loaded.qk_rank, fdc.load(out).with_rate(search["rate"]).qk_rank)
    # --rate and --target-accuracy exclude each other; a ratio below 1 is refused.
    for args, named in ((["--rate", "0.1", "--target-accuracy", "1.05"], "--target-accuracy"),
                        (["--target-accuracy", "0.9"], "--target-accuracy")):
        refused = _calibrate("fdc", str(model_dir), "--out", str(tmp_path / "x.safetensors"), *args)
        assert refused.returncode == 2 and named in refused.stderr, refused.stderr
