"""`LLM(...)` raises ValueError with the same one-line messages, before any engine starts."""

import pytest

from conftest import make_llm

BAD_POLICIES = [
    ({"name": "bogus", "budget": 64}, "kv_policy.name: unknown policy 'bogus'"),
    ({"name": "streaming", "budget": 0}, "kv_policy.budget: must be positive"),
    ({"name": "streaming", "budget": 64, "sinks": 64}, "kv_policy.sinks: must be smaller than the budget"),
    ({"name": "streaming", "budget": 16}, "kv_policy.budget: 16 tokens cannot hold one KV block"),
    ({"name": "streaming", "budget": 64, "sinkz": 4}, "kv_policy.sinkz: unknown setting"),
    ({"name": "paged_eviction", "budget": 256, "positions": "cache"},
     "kv_policy.positions: policy 'paged_eviction' supports only 'original'"),
    ({"name": "h2o", "budget": 64, "recent": 63}, "kv_policy.recent: must be at most budget - 1 - sinks = 59"),
    ({"name": "fdc"}, "kv_policy.fdc: policy 'fdc' needs a calibration file"),
    ({"name": "fdc", "fdc": "/does/not/exist.safetensors"}, "kv_policy.fdc: file not found"),
    ({"name": "fdc", "fdc": "x.safetensors", "budget": 64}, "kv_policy.budget: policy 'fdc' keeps every token"),
    ({"name": "gvote", "gvote_samples": 0}, "kv_policy.gvote_samples: must be positive"),
    ({"name": "gvote", "budget": 256}, "kv_policy.budget: policy 'gvote' chooses its own footprint"),
]


@pytest.mark.parametrize("policy, message", BAD_POLICIES, ids=[str(p) for p, _ in BAD_POLICIES])
def test_llm_rejects_bad_policy(tiny_model, policy, message):
    with pytest.raises(ValueError) as info:
        make_llm(tiny_model, policy)
    assert message in str(info.value)


def test_speculative_decoding_refused(tiny_model):
    with pytest.raises(ValueError, match="cannot run with speculative decoding"):
        make_llm(tiny_model, {"name": "streaming", "budget": 64},
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


@pytest.mark.parametrize("option, flag", [
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                             "kv_connector_extra_config": {"shared_storage_path": "/tmp/kvprune-never-written"}}},
     "--kv-transfer-config"),
    ({"kv_offloading_size": 1.0}, "--kv-offloading-size"),
])
def test_kv_connectors_refused(tiny_model, option, flag):
    # A connector saves and loads whole token rows; with ExampleConnector, a second run of the
    # same prompts under streaming (loading what the first saved) answered differently from no connector.
    with pytest.raises(ValueError, match=f"cannot run with a KV connector: .*; remove {flag}"):
        make_llm(tiny_model, {"name": "streaming", "budget": 64}, **option)


def test_pipeline_parallelism_refused(tiny_model):
    with pytest.raises(ValueError, match=r"cannot run with pipeline parallelism: .*; remove --pipeline-parallel-size 2 "
                                         r"\(tensor parallelism is supported\)"):
        make_llm(tiny_model, {"name": "h2o", "budget": 64}, pipeline_parallel_size=2)


@pytest.mark.parametrize("option", [{"runner": "pooling"}, {"convert": "embed"}])
def test_pooling_models_refused(tiny_model, option):
    # Before: vLLM's pooling runner failed the engine on our request validator, far from the cause.
    with pytest.raises(ValueError, match="cannot run with a pooling model: it runs each prompt once"):
        make_llm(tiny_model, {"name": "streaming", "budget": 64}, **option)


def test_mla_models_refused():
    # DeepSeek-style MLA: before, the CPU MLA backend's block size (16) was refused as if the
    # user had asked for it ("--block-size: must be a multiple of 32").
    from tools.model_zoo import zoo_model_dir

    model = str(zoo_model_dir("deepseek-mla"))
    with pytest.raises(ValueError, match=r"cannot run with MLA attention \(DeepseekV2ForCausalLM: a latent KV cache"):
        make_llm(model, {"name": "paged_eviction", "budget": 384})


@pytest.fixture(scope="module")
def fdc_file(tiny_model, tmp_path_factory) -> str:
    """A calibration of the tiny model (what an fdc policy needs to get as far as its runner)."""
    from vllm_kvprune.fdc import calibration

    path = tmp_path_factory.mktemp("fdc") / "tiny.safetensors"
    calibration.calibrate(tiny_model, tokens=64, seq_len=32, seed=0, rate=0.5).save(path)
    return str(path)


@pytest.mark.parametrize("value, uses_fdc, message", [
    ("cublas", False, "KVPRUNE_FDC_PROJECTIONS: 'cublas' is not one of torch, triton, cutlass"),
    ("triton", True, "KVPRUNE_FDC_PROJECTIONS: triton needs a GPU; the cache is on the CPU"),
    ("cutlass", True, "KVPRUNE_FDC_PROJECTIONS: cutlass needs a CUDA device"),
])
def test_fdc_projections_variable_refused_before_start(tiny_model, fdc_file, monkeypatch, value, uses_fdc, message):
    # Before: the worker refused it, as the root cause of vLLM's engine-start traceback.
    monkeypatch.setenv("KVPRUNE_FDC_PROJECTIONS", value)
    policy = {"name": "fdc", "fdc": fdc_file} if uses_fdc else {"name": "streaming", "budget": 64}
    with pytest.raises(ValueError) as info:
        make_llm(tiny_model, policy)
    assert message in str(info.value)


def test_fdc_projections_variable_checked_where_it_matters(fdc_file, monkeypatch):
    """A GPU runner set on a CPU machine stops only a policy that uses FDC; a typo stops any."""
    from vllm_kvprune import plugin
    from vllm_kvprune.config import KVConfigError, KVPolicyConfig
    from vllm_kvprune.worker import fdc_projections

    monkeypatch.setenv("KVPRUNE_FDC_PROJECTIONS", "triton")
    plugin.check_fdc_projections(KVPolicyConfig(name="h2o"))
    with pytest.raises(KVConfigError, match="triton needs a GPU"):
        plugin.check_fdc_projections(KVPolicyConfig(name="streaming", fdc=fdc_file))
    monkeypatch.setenv("KVPRUNE_FDC_PROJECTIONS", "Triton")
    with pytest.raises(KVConfigError, match="'Triton' is not one of"):
        plugin.check_fdc_projections(KVPolicyConfig(name="h2o"))
    # Where each runner can run, as the worker checks it on the cache's device.
    assert [fdc_projections.refusal(kind, "cuda") for kind in fdc_projections.KINDS] == [None, None, None]
    assert fdc_projections.refusal("triton", "rocm") is None
    assert "on ROCm use triton" in fdc_projections.refusal("cutlass", "rocm")
