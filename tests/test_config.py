"""KVPolicyConfig: every surface, every bad input, the capacity rule."""

import pytest

from vllm_kvprune.config import (
    CLI,
    REQUEST,
    KVConfigError,
    KVPolicyConfig,
    from_additional_config,
    load_yaml,
)


def test_streaming_budget_window_sinks():
    config = KVPolicyConfig.from_dict({"name": "streaming", "sinks": 4, "window": 60})
    assert config.budget == 64 and config.window_size == 60
    assert KVPolicyConfig.from_dict({"name": "streaming", "budget": 64}).window_size == 60


@pytest.mark.parametrize(
    "raw, setting, words",
    [
        ({"name": "bogus", "budget": 64}, "kv_policy.name", "unknown policy"),
        ({"name": "streaming", "budget": 0}, "kv_policy.budget", "positive"),
        ({"name": "streaming", "budget": -5}, "kv_policy.budget", "positive"),
        ({"name": "streaming", "budget": 64, "sinks": 64}, "kv_policy.sinks", "smaller than the budget"),
        ({"name": "streaming"}, "kv_policy.budget", "needs a budget"),
        ({"name": "streaming", "budget": 64, "window": 10}, "kv_policy.window", "must equal the budget"),
        ({"name": "streaming", "budget": "64"}, "kv_policy.budget", "integer"),
        ({"name": "streaming", "budget": 64, "positions": "absolute"}, "kv_policy.positions", "original, cache"),
        ({"name": "streaming", "budget": 64, "prune_interval": 0}, "kv_policy.prune_interval", "positive"),
        ({"name": "streaming", "budgt": 64}, "kv_policy.budgt", "unknown setting"),
    ],
)
def test_bad_settings_name_the_setting(raw, setting, words):
    with pytest.raises(KVConfigError) as info:
        KVPolicyConfig.from_dict(raw)
    assert info.value.setting == setting
    assert words in str(info.value)


def test_budget_must_hold_one_block():
    config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 16, "sinks": 4})
    with pytest.raises(KVConfigError, match="cannot hold one KV block"):
        config.check_engine(32)
    KVPolicyConfig.from_dict({"name": "streaming", "budget": 32}).check_engine(32)
    with pytest.raises(KVConfigError, match="multiple of 32"):
        KVPolicyConfig().check_engine(48)


def test_cli_surface_names_flags():
    with pytest.raises(KVConfigError) as info:
        KVPolicyConfig(name="streaming", budget=0).validated(CLI)
    assert str(info.value).startswith("--kv-budget:")


def test_request_overrides():
    base = KVPolicyConfig.from_dict({"name": "streaming", "budget": 256, "sinks": 4})
    assert base.for_request({"kv_budget": 128}).budget == 128
    assert base.for_request({"kv_window": 100}).budget == 104
    assert base.for_request({"kv_sinks": 8}).window_size == 248
    assert base.for_request(None) is base
    for extra, setting in [({"kv_budget": 0}, "kv_budget"), ({"kv_budget": "x"}, "kv_budget"),
                           ({"kv_sinks": 300}, "kv_sinks"), ({"kv_bogus": 1}, "kv_bogus")]:
        with pytest.raises(KVConfigError) as info:
            base.for_request(extra)
        assert info.value.setting == setting
    # vLLM's own keys are not ours to judge.
    assert base.for_request({"kv_transfer_params": {}}) is base


def test_capacity_rule():
    config = KVPolicyConfig.from_dict({"name": "streaming", "budget": 100, "prune_interval": 8})
    assert config.cap_blocks(32) == 4  # ceil(108 / 32)
    assert config.prefill_cap_blocks(32) is None
    streaming = KVPolicyConfig.from_dict({"name": "streaming", "budget": 100, "prefill": "streaming",
                                          "prefill_chunk": 64})
    assert streaming.prefill_cap_blocks(32) == 6  # ceil((99 + 64) / 32)


def test_yaml(tmp_path):
    good = tmp_path / "s.yaml"
    good.write_text("name: streaming\nbudget: 128\nsinks: 4\n")
    assert load_yaml(good).budget == 128
    wrapped = tmp_path / "w.yaml"
    wrapped.write_text("kv_policy:\n  name: streaming\n  budget: 128\n")
    assert load_yaml(wrapped).name == "streaming"
    typo = tmp_path / "t.yaml"
    typo.write_text("name: streaming\nbudegt: 128\n")
    with pytest.raises(KVConfigError) as info:
        load_yaml(typo)
    assert info.value.setting.startswith("budegt") and str(typo) in info.value.setting
    with pytest.raises(KVConfigError, match="file not found"):
        load_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["none", "streaming", "streaming-endless", "h2o", "paged_eviction", "gvote", "fdc",
                                  "streaming-fdc", "paged_eviction-fdc"])
def test_presets_are_valid(name):
    from pathlib import Path

    preset = load_yaml(Path(__file__).parent.parent / "configs" / f"{name}.yaml")
    assert preset.name in name.replace("-endless", "").replace("-fdc", "")
    assert (preset.fdc is not None) == ("fdc" in name)


def test_additional_config_forms():
    assert not from_additional_config({}).active
    assert from_additional_config({"kv_policy": {"name": "streaming", "budget": 64}}).budget == 64
    dotted = from_additional_config({"kv_policy": "streaming", "kv_budget": 64})
    assert dotted.name == "streaming" and dotted.budget == 64


def test_request_surface_name():
    assert REQUEST.name("budget") == "kv_budget"


def test_h2o_recent_window():
    config = KVPolicyConfig.from_dict({"name": "h2o", "budget": 256, "sinks": 4})
    assert config.recent_size == 126  # half of budget - sinks by default
    assert config.for_request({"kv_recent": 10}).recent_size == 10
    assert config.for_request({"kv_budget": 100}).recent_size == 48  # the default follows the budget
    assert KVPolicyConfig.from_dict({"name": "h2o", "budget": 256, "sinks": 4, "recent": 251}).recent_size == 251
    for extra in ({"kv_recent": 252}, {"kv_recent": -1}, {"kv_recent": "x"}):
        with pytest.raises(KVConfigError) as info:
            config.for_request(extra)
        assert info.value.setting == "kv_recent"
    for field, value in (("positions", "cache"), ("prefill", "streaming")):
        with pytest.raises(KVConfigError, match=f"policy 'h2o' supports only"):
            KVPolicyConfig.from_dict({"name": "h2o", "budget": 256, field: value})
