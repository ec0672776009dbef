"""The GPU wrappers (vLLM's TRITON_ATTN and FLASH_ATTN with the policies) in a real vLLM engine.

This machine has no GPU, so the engine runs on the CPU with a GPU wrapper in place of the
CPU one (`KVPRUNE_TRITON_ON_CPU=1`, or `=FLASH_ATTN`): the shared step planning, the
impl's work around the kernel with our Triton kernels (`TritonKernels`), all in Triton's
interpreter, and for the cache write and the attention vLLM's own Triton kernels (TRITON_ATTN,
interpreted too) or vLLM's FLASH_ATTN builder and impl calling torch references of the two
FlashAttention ops (its CUDA kernels are not in vLLM's CPU build). The proof is the policy's
reference implementation, as for the CPU wrapper. The engine runs in a subprocess: the
wrapper is chosen when the plugin registers, once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import policy_reference
from test_model_matrix import model_dir
from test_streaming_engine import prompts

RUNNER = Path(__file__).with_name("gpu_wrapper_run.py")
SINKS = 4


def policy_cases(model: str) -> dict[str, dict]:
    """One engine per policy the GPU wrapper runs, each with requests that evict in decode
    and prune their prompt (gvote and fdc on the HND layout they ask for). Few tokens: vLLM's
    Triton attention is slow in the interpreter (about 3 s a step here; h2o's decode runs our
    kernel instead), and short prompts: its prefill programs grow with the square of a prompt's
    length, and every kernel that writes the cache runs a program per token. vLLM decodes a few
    sequences with its split-keys (3D) kernel, 16 times the programs of its 2D one: `streaming`,
    `paged_eviction` and `snapkv` take the 2D kernel (`split_keys_decode`); `gvote` (each
    (request, KV head) its own sequence) keeps vLLM's choice, so the 3D path is run too."""
    def case(policy, lengths, overrides, max_tokens, block_size=32, seed=3, kv_blocks=64, split_keys_decode=True):
        return dict(model=model, policy=policy, max_tokens=max_tokens, block_size=block_size, kv_blocks=kv_blocks,
                    split_keys_decode=split_keys_decode,
                    requests=[{"prompt": p, "extra_args": o or None} for p, o in zip(prompts(lengths, seed), overrides)])

    return {
        # Sinks re-anchored with the layer's RoPE on the cache's device (`positions: cache`), a
        # full prompt compacted after its last chunk, lazy pruning (R = 8) and in-place decode
        # (R = 1), a second budget, a prompt shorter than the sinks.
        "streaming": case({"name": "streaming", "budget": 64, "sinks": SINKS, "prune_interval": 8,
                           "positions": "cache", "prefill": "full"},
                          (3, 80, 120), [{}, {"kv_prune_interval": 1}, {"kv_budget": 96}], 10,
                          split_keys_decode=False),
        # Attention mass on the device (our Triton kernel, fused with decode attention), victims
        # chosen on the host from the requests' slots, per-head writes and moves. The long prompt
        # is pruned to the budget and evicts at every 4th of its 12 tokens; the short one never
        # reaches the budget (its mass is accumulated all the same).
        "h2o": case({"name": "h2o", "budget": 64, "sinks": SINKS, "prune_interval": 1},
                    (20, 100), [{}, {"kv_prune_interval": 4}], 12),
        # Token scores written beside the cache on the device, per-layer block tables.
        "paged_eviction": case({"name": "paged_eviction", "budget": 96, "sinks": SINKS, "prune_interval": 1},
                               (110, 140), [{}, {}], 12, split_keys_decode=False),
        # Head-pages on vLLM's HND layout: the vote on the device, each (request, KV head) its
        # own sequence through vLLM's Triton kernel, blocks the vote gives back.
        # (A voted request may keep all of max_model_len: the pool must hold one such.)
        "gvote": case({"name": "gvote", "gvote_p": 0.3, "gvote_samples": 4}, (40, 100), [{}, {}], 8, kv_blocks=136),
        # The prompt scored by its last queries (window 16, kernel 5) from keys read back
        # from vLLM's cache, per-head writes and moves; a prompt shorter than the window's room.
        "snapkv": case({"name": "snapkv", "budget": 64, "snapkv_window": 16}, (20, 100), [{}, {"kv_snapkv_kernel": 3}], 8,
                         split_keys_decode=False),
        # The packed narrow cache (rate 0.1: heads of unequal ranks) on the HND layout, our
        # Triton reduced-space attention (prefill and decode); the calibration is the fixture's.
        "fdc": case({"name": "fdc", "fdc": None}, (40, 100), [{}, {}], 8, kv_blocks=136),
        # FDC under eviction (FDC's "KF-F"): narrow writes to planned slots, the prompt pruned
        # after its last chunk and the window slid in decode (the 40-token prompt from its 9th
        # token), narrow tokens moved on the device.
        "streaming_fdc": case({"name": "streaming", "budget": 48, "sinks": SINKS, "prefill": "full", "fdc": None},
                              (60, 40), [{}, {}], 12),
        # Beyond the Llama family: Qwen3 (q/k norms before RoPE, GQA, head size 64) with h2o's
        # fused kernel and per-head moves.
        "h2o_qwen3": {**case({"name": "h2o", "budget": 64, "sinks": SINKS, "prune_interval": 1},
                             (20, 100), [{}, {"kv_prune_interval": 4}], 24), "model": model_dir("qwen3")},
    }


def reference_for(model, policy: dict, override: dict, block_size: int):
    """The policy's own reference at the request's settings, FDC's narrow heads included where
    the case names a calibration."""
    from vllm_kvprune.config import KVPolicyConfig

    return policy_reference(model, KVPolicyConfig.from_dict(policy).for_request(override), block_size)


@pytest.fixture(scope="module")
def fdc_calibration(tiny_model, tmp_path_factory):
    """The file of FDC's calibration of the tiny model (rate 0.1: heads of unequal ranks)."""
    from vllm_kvprune.fdc import calibration

    calibrated = calibration.calibrate(tiny_model, tokens=256, seq_len=128, seed=0, rate=0.1)
    widths = calibrated.qk_rank + calibrated.v_rank
    assert (calibrated.qk_rank < calibrated.head_dim).any() and (widths != widths.flatten()[0]).any()
    path = tmp_path_factory.mktemp("fdc") / "tiny.safetensors"
    calibrated.save(path)
    return str(path)


def _with_calibration(cases: dict, path: str) -> dict:
    for name in ("fdc", "streaming_fdc"):
        if name in cases:
            cases[name]["policy"]["fdc"] = path
    return cases


def _suite_cases(cases: dict, heavy: tuple[str, ...], config) -> dict:
    """The cases this run takes: those marked heavy only with --heavy."""
    return {name: case for name, case in cases.items() if name not in heavy or config.getoption("--heavy")}


@pytest.fixture(scope="module")
def wrapper_runs(tiny_model, fdc_calibration, tmp_path_factory, request):
    """Every case's engine, in one subprocess (the interpreter's kernels are built once)."""
    cases = _suite_cases(_with_calibration(policy_cases(tiny_model), fdc_calibration), TRITON_HEAVY, request.config)
    return cases, _run_engines(cases, tmp_path_factory.mktemp("gpu_wrapper"), "TRITON_ATTN")


# The policies whose cache write and attention go through vLLM's backend, and fdc (its narrow
# cache is written and attended by our kernels alone, but its narrowed spec meets FA's builder).
# (Qwen3 meets FA's path as Llama does; its Triton case, with --heavy, covers the architecture.)
FLASH_CASES = ("streaming", "h2o", "paged_eviction", "gvote", "fdc", "snapkv")
# With --heavy: h2o's part on FA is its prompt through FA's builder and impl, which streaming's
# and snapkv's (per-head slots, as h2o's) take too; its decode is our kernel, as on TRITON_ATTN.
FLASH_HEAVY = ("h2o",)
# With --heavy: Qwen3 (q/k norms before RoPE) differs from Llama in vLLM's model code, not in
# our path; the model matrix serves it on the CPU wrapper (every policy with --heavy).
TRITON_HEAVY = ("h2o_qwen3",)


@pytest.fixture(scope="module")
def flash_runs(tiny_model, fdc_calibration, tmp_path_factory, request):
    """The FLASH_ATTN wrapper's engines, in one subprocess."""
    cases = _suite_cases(_with_calibration({name: case for name, case in policy_cases(tiny_model).items()
                                            if name in FLASH_CASES}, fdc_calibration), FLASH_HEAVY, request.config)
    return cases, _run_engines(cases, tmp_path_factory.mktemp("flash_wrapper"), "FLASH_ATTN")


# Seconds each case's engine takes in the interpreter on a 2-core CI machine (one core each, AVX2
# only; 2026-11-29), to split the cases evenly over the machine's cores. Only the balance depends on it.
CASE_SECONDS = {"streaming": 54, "h2o": 52, "paged_eviction": 69, "gvote": 45, "fdc": 15, "streaming_fdc": 15,
                "h2o_qwen3": 45, "snapkv": 35}


def _split(names: list[str], parts: int) -> list[list[str]]:
    """The case names in `parts` groups of about equal time, longest first to the least loaded."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for name in sorted(names, key=lambda name: -CASE_SECONDS.get(name, 30)):
        least = loads.index(min(loads))
        groups[least].append(name)
        loads[least] += CASE_SECONDS.get(name, 30)
    return [group for group in groups if group]


def _run_engines(cases: dict, folder: Path, backend: str) -> dict:
    """Every case's engine, the cases split over one subprocess per core, run at once: the
    interpreter keeps one core busy, so two processes take half the time. Each process has its
    own core for vLLM's threads (`VLLM_CPU_OMP_THREADS_BIND`), so they never contend."""
    cores = sorted(os.sched_getaffinity(0))
    groups = _split(list(cases), max(1, min(len(cores), 2)))
    running = []
    for index, names in enumerate(groups):
        (folder / f"cases{index}.json").write_text(json.dumps([cases[name] for name in names]))
        env = {**os.environ, "TRITON_INTERPRET": "1", "KVPRUNE_TRITON_ON_CPU": backend}
        if len(groups) > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index])
        with open(folder / f"log{index}.txt", "w") as log:  # a file: a full pipe would stall the other
            running.append(subprocess.Popen(
                [sys.executable, str(RUNNER), str(folder / f"cases{index}.json"), str(folder / f"out{index}.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    runs = {}
    try:
        for index, (names, process) in enumerate(zip(groups, running)):
            process.wait(timeout=2400)
            assert process.returncode == 0, f"{names}: {(folder / f'log{index}.txt').read_text()[-4000:]}"
            runs.update(zip(names, json.loads((folder / f"out{index}.json").read_text())))
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
    return runs


def _own_reference_model(model: str):
    """A case on another architecture: the reference runs that model's own weights."""
    from vllm_kvprune.reference.model import load_reference_model

    return load_reference_model(model)


def _assert_matches_the_reference(reference_model, name: str, case: dict, run: dict) -> None:
    from vllm_kvprune.reference.budgeted import generate_together

    references = [reference_for(reference_model, case["policy"], request["extra_args"] or {}, case["block_size"])
                  for request in case["requests"]]
    expected_outputs = generate_together([(reference, request["prompt"]) for reference, request
                                          in zip(references, case["requests"])], case["max_tokens"])
    for request, got, reference, expected in zip(case["requests"], run["results"], references, expected_outputs):
        prompt, override = request["prompt"], request["extra_args"] or {}
        if name == "gvote":  # heads of one request kept different lengths: head-pages were exercised
            assert (reference.kept_lengths != reference.kept_lengths[0, 0]).any()
        assert got["token_ids"] == expected.token_ids, f"prompt of {len(prompt)}, {override}"
        assert np.max(np.abs(np.array(got["logprobs"]) - np.array(expected.logprobs))) < 1e-3


TRITON_CASES = ("streaming", "h2o", "paged_eviction", "gvote", "fdc", "streaming_fdc", "h2o_qwen3", "snapkv")


def test_every_gpu_policy_has_a_wrapper_case():
    """A registered policy that says it runs on a GPU (`Policy.gpu`) is run by both wrappers here."""
    from vllm_kvprune.policies import REGISTRY

    cases = policy_cases("model")
    gpu_policies = {name for name, policy in REGISTRY.items() if policy.gpu and name != "none"}
    served = {case["policy"]["name"] for case in cases.values()}
    assert gpu_policies <= served, f"no GPU wrapper case for {sorted(gpu_policies - served)}"
    for names in (TRITON_CASES, FLASH_CASES):
        assert gpu_policies <= {cases[name]["policy"]["name"] for name in names}


def _params(names: tuple[str, ...], heavy: tuple[str, ...]) -> list:
    return [pytest.param(name, marks=pytest.mark.heavy) if name in heavy else name for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(TRITON_CASES, TRITON_HEAVY))
def test_policy_on_the_gpu_wrapper_matches_the_reference(wrapper_runs, reference_model, tiny_model, name):
    cases, runs = wrapper_runs
    case, run = cases[name], runs[name]
    if case["model"] != tiny_model:
        reference_model = _own_reference_model(case["model"])
    assert "error" not in run, run.get("error")
    assert run["impls"] == ["KVPruneTritonImpl"]
    assert run["hnd"] == (name in ("gvote", "fdc", "streaming_fdc")), "head-pages, FDC's rows need HND; others NHD"
    # FDC's packed keys in the layout our Triton kernel reads fastest (token-major).
    assert run["fdc_keys_by_token"] == (True if "fdc" in name else None)
    _assert_matches_the_reference(reference_model, name, case, run)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params(FLASH_CASES, FLASH_HEAVY))
def test_policy_on_the_flash_attention_wrapper_matches_the_reference(flash_runs, reference_model, tiny_model, name):
    cases, runs = flash_runs
    case, run = cases[name], runs[name]
    if case["model"] != tiny_model:
        reference_model = _own_reference_model(case["model"])
    assert "error" not in run, run.get("error")
    assert run["impls"] == ["KVPruneFlashImpl"]
    assert run["hnd"] == (name in ("gvote", "fdc")), "head-pages, FDC's rows need HND; others NHD"
    assert run["fdc_keys_by_token"] == (True if name == "fdc" else None)
    _assert_matches_the_reference(reference_model, name, case, run)


def test_gpu_start_up_checks(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_kvprune import plugin
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.policies import REGISTRY

    for name in REGISTRY:  # every registered policy runs on a GPU today
        plugin._check_gpu_policy(KVPolicyConfig(name=name, fdc="rotations.safetensors" if name == "fdc" else None))
    plugin._check_gpu_policy(KVPolicyConfig(name="streaming", fdc="rotations.safetensors"))
    # A policy the wrappers do not carry out refuses, naming the ones they do.
    monkeypatch.setattr(type(REGISTRY["h2o"]), "gpu", False)
    with pytest.raises(ValueError, match=r"kv_policy 'h2o' does not run on a GPU yet \(GPU: streaming, paged_eviction"):
        plugin._check_gpu_policy(KVPolicyConfig(name="h2o"))
    chosen = SimpleNamespace(attention_config=SimpleNamespace(backend=None))
    plugin._use_gpu_attention(chosen)
    assert chosen.attention_config.backend == AttentionBackendEnum.TRITON_ATTN
    plugin._use_gpu_attention(chosen)  # asked for by name: kept
    assert chosen.attention_config.backend == AttentionBackendEnum.TRITON_ATTN
    asked = SimpleNamespace(attention_config=SimpleNamespace(backend=AttentionBackendEnum.FLASH_ATTN))
    plugin._use_gpu_attention(asked)
    assert asked.attention_config.backend == AttentionBackendEnum.FLASH_ATTN
    other = SimpleNamespace(attention_config=SimpleNamespace(backend=AttentionBackendEnum.FLASHINFER))
    with pytest.raises(ValueError, match="TRITON_ATTN or FLASH_ATTN .*--attention-backend FLASHINFER is not supported"):
        plugin._use_gpu_attention(other)
    # Context parallelism splits a request's tokens over ranks: refused, naming the flag
    # (with the other vLLM features no policy runs with, `unsupported.py`).
    from vllm_kvprune import unsupported

    unsupported.check("h2o", SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    with pytest.raises(ValueError, match="cannot run with context parallelism.*remove --decode-context-parallel-size 2"):
        unsupported.check("h2o", SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1))


def test_window_of_every_impl_kind():
    """vLLM's CPU impl stores a window's span, its GPU impls the (left, right) reach."""
    from vllm_kvprune.worker.features import LayerFeatures

    def window(stored):
        return LayerFeatures.of("layer", SimpleNamespace(impl=SimpleNamespace(sliding_window=stored))).sliding_window

    assert [window(w) for w in (None, -1, 4096, (-1, -1), (4095, 0))] == [None, None, 4096, None, 4096]


def test_flash_attention_4_head_size_256_kernel_refuses():
    """FA4's head-size-256 kernel (Blackwell) wants exact-width block tables: the FLASH_ATTN
    wrapper's layer says so and the feature check refuses it at model load, naming the remedy."""
    from vllm_kvprune.config import KVPolicyConfig
    from vllm_kvprune.worker.features import LayerFeatures, refusal
    from vllm_kvprune.worker.flash_backend import KVPruneFlashImpl

    impl = object.__new__(KVPruneFlashImpl)  # FA's __init__ sets fa4_hd256 from the device it finds
    for policy in ("streaming", "h2o", "paged_eviction", "gvote"):
        impl.fa4_hd256 = False
        layers = [LayerFeatures.of("layers.0.attn", SimpleNamespace(impl=impl))]
        assert refusal(KVPolicyConfig(name=policy), layers) is None
        impl.fa4_hd256 = True
        layers = [LayerFeatures.of("layers.0.attn", SimpleNamespace(impl=impl))]
        assert refusal(KVPolicyConfig(name=policy), layers) == (
            f"{policy}: FlashAttention 4's head-size-256 kernel (layers.0.attn) is not supported; "
            "use --attention-backend TRITON_ATTN")


def test_the_scheduler_follows_async_scheduling():
    """vLLM's default on a GPU is async scheduling: the policies' scheduler then extends
    vLLM's AsyncScheduler, with every hook of ours in front of it."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_kvprune import plugin
    from vllm_kvprune.engine.scheduler import KVPruneSchedulerMixin

    sync, asynchronous = (resolve_obj_by_qualname(plugin.scheduler_cls(flag)) for flag in (False, True))
    assert resolve_obj_by_qualname(plugin.scheduler_cls(None)) is sync
    assert issubclass(asynchronous, AsyncScheduler) and not issubclass(sync, AsyncScheduler)
    ours = [name for name, member in vars(KVPruneSchedulerMixin).items() if callable(member)]
    assert "_reserve_prefill_lookahead" in ours and "update_from_output" in ours
    for cls, base in ((sync, Scheduler), (asynchronous, AsyncScheduler)):
        assert cls.__mro__.index(KVPruneSchedulerMixin) < cls.__mro__.index(base)
        for name in ours:
            assert getattr(cls, name) is getattr(KVPruneSchedulerMixin, name), (cls.__name__, name)


def test_a_captured_cache_write_refuses():
    """On a GPU the policy's cache write must run eagerly: vLLM's default piecewise graphs split
    at it; Inductor graph partition or splitting ops without it refuse, naming them."""
    from vllm_kvprune import plugin
    from vllm_kvprune.config import KVPolicyConfig

    def config(mode="FULL_AND_PIECEWISE", partition=False, ops=("vllm::unified_attention_with_output",
                                                                "vllm::unified_kv_cache_update")):
        return SimpleNamespace(compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(name=mode), use_inductor_graph_partition=partition, splitting_ops=list(ops)))

    policy = KVPolicyConfig(name="h2o")
    plugin._check_graphs(policy, config())
    plugin._check_graphs(policy, config(mode="NONE", partition=True, ops=()))  # eager: nothing is captured
    with pytest.raises(ValueError, match="use_inductor_graph_partition would capture that write"):
        plugin._check_graphs(policy, config(partition=True))
    with pytest.raises(ValueError, match="splitting_ops without vllm::unified_kv_cache_update"):
        plugin._check_graphs(policy, config(ops=("vllm::unified_attention_with_output",)))
