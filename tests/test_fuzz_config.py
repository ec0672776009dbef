"""Property-based fuzzing (hypothesis) of every way a KV setting comes in: the config mapping
(YAML / `additional_config`), the `--kv-*` flags and the per-request `vllm_xargs` keys. Whatever
comes in, the answer is a valid config or a `KVConfigError` whose message names the setting at
fault (the CLI turns it into exit 2, the server into HTTP 400): never another exception."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvprune.config import ALL_POLICIES, REQUEST_KEYS, SETTINGS, KVConfigError, KVPolicyConfig
from vllm_kvprune.plugin import flags_from_namespace, policy_from_args

FIELDS = [field.name for field in dataclasses.fields(KVPolicyConfig)]
NAMES = [*ALL_POLICIES, "bogus", ""]
# Anything a YAML file, a JSON body or a hand-written dict can hold.
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                   st.text(max_size=12), st.sampled_from(NAMES), st.lists(st.integers(), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
SMALL = st.one_of(st.integers(-8, 5000), VALUES)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _named(error: KVConfigError) -> None:
    assert error.setting and error.setting in str(error) and error.problem


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)), SMALL, max_size=6),
       st.sampled_from(NAMES))
def test_config_mappings_give_a_config_or_a_named_error(raw, name) -> None:
    raw = {"name": name, **raw} if "name" not in raw else raw
    try:
        policy = KVPolicyConfig.from_dict(raw)
    except KVConfigError as error:
        _named(error)
        return
    assert policy.name in NAMES


BASES = [KVPolicyConfig.from_dict(raw) for raw in (
    {"name": "streaming", "budget": 256, "sinks": 4}, {"name": "h2o", "budget": 256, "recent": 32},
    {"name": "paged_eviction", "budget": 256}, {"name": "gvote"})]


@FUZZ
@given(st.sampled_from(BASES),
       st.dictionaries(st.one_of(st.sampled_from([*REQUEST_KEYS, "kv_transfer_params", "kv_other", "other"]),
                                 st.text(max_size=10)), SMALL, max_size=4))
def test_request_overrides_give_a_config_or_a_named_error(base, extra_args) -> None:
    try:
        policy = base.for_request(extra_args)
    except KVConfigError as error:
        _named(error)
        assert error.setting in extra_args or error.setting.startswith("kv_")
        return
    assert policy.name == base.name


# Every flag but the files (--kv-fdc, --kv-config: checked by their own tests).
FLAG_NAMES = ["policy", *(name for name in SETTINGS if name != "fdc")]
FLAG_TEXT = st.one_of(st.none(), st.sampled_from(NAMES + ["cache", "original", "full", "streaming", "0.5", "-1", "32",
                                                          "1e9", "nan", "4096"]),
                      st.integers(-5, 10000).map(str), st.text(max_size=6))


@FUZZ
@given(st.fixed_dictionaries({name: FLAG_TEXT for name in FLAG_NAMES}), st.sampled_from([None, 16, 32, 33, 128]))
def test_flags_give_a_policy_or_a_named_error(flags, block_size) -> None:
    namespace = argparse.Namespace(**{f"kv_{name}": value for name, value in flags.items()}, kv_fdc=None,
                                   kv_config=None, additional_config=None, block_size=block_size, model=None)
    try:
        policy = policy_from_args(namespace)
    except KVConfigError as error:
        _named(error)
        assert error.setting.startswith("--kv-") or error.setting == "--block-size", error
        return
    assert policy is None or policy.name in NAMES


@pytest.mark.parametrize("raw", ["12", " 7 ", "-3"])
def test_integer_flags_parse_as_python_does(raw) -> None:
    namespace = argparse.Namespace(**{f"kv_{name}": None for name in FLAG_NAMES}, kv_fdc=None, kv_config=None)
    namespace.kv_budget = raw
    assert flags_from_namespace(namespace).values["budget"] == int(raw)
