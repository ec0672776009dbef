"""The policy registry is the one place a policy and its settings are written: every surface
derives from it (config fields, flags, request keys, the docs' tables), and every registered
policy declares what the rest of the plugin reads."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from vllm_kvprune.config import ALL_POLICIES, REQUEST_KEYS, SETTINGS, KVConfigError, KVPolicyConfig
from vllm_kvprune.policies import LAYOUTS, MODULES, REGISTRY, readers
from vllm_kvprune.worker.features import FEATURES

POLICIES = [name for name in REGISTRY if name != "none"]


def test_every_module_registers_one_policy_under_its_name():
    assert list(REGISTRY) == ["none", *MODULES]
    for module in MODULES:
        assert importlib.import_module(f"vllm_kvprune.policies.{module}").POLICY is REGISTRY[module]


def test_config_fields_are_the_registered_settings():
    assert [field.name for field in dataclasses.fields(KVPolicyConfig)] == ["name", *SETTINGS]
    assert ALL_POLICIES == tuple(REGISTRY)
    assert REQUEST_KEYS == {f"kv_{name}": name for name, setting in SETTINGS.items() if setting.per_request}


@pytest.mark.parametrize("name", POLICIES)
def test_traits_are_declared(name):
    policy = REGISTRY[name]
    assert policy.layout in LAYOUTS and policy.summary
    assert set(policy.model_refusals) <= set(FEATURES)
    assert set(policy.notes) <= {setting.name for setting in policy.settings}, "a note on a setting it does not read"
    assert not set(policy.refused_settings) & {setting.name for setting in policy.settings}
    assert policy.composes_with_fdc == (policy.fdc_refusal is None)
    assert policy.reference is not None and importlib.import_module(f"vllm_kvprune.reference.{policy.reference}")


@pytest.mark.parametrize("name", POLICIES)
def test_a_setting_the_policy_does_not_read_is_refused_on_every_surface(name):
    policy = REGISTRY[name]
    for setting_name, setting in SETTINGS.items():
        if policy.reads(setting_name):
            continue
        value = setting.choices[-1] if setting.choices else ("x.safetensors" if setting.kind is str else
                                                               (0.5 if setting.kind is float else 7))
        with pytest.raises(KVConfigError) as info:
            KVPolicyConfig.from_dict({"name": name, setting_name: value})
        assert info.value.setting == f"kv_policy.{setting_name}"
        if setting.per_request:
            base = KVPolicyConfig.from_dict({"name": name, **_minimal(name)})
            with pytest.raises(KVConfigError) as info:
                base.for_request({setting.request_key: value})
            assert info.value.setting == setting.request_key and "does not" in info.value.problem or \
                name in info.value.problem


def _minimal(name: str) -> dict:
    """Settings that make `name` valid on their own."""
    return {"budget": 512} if REGISTRY[name].budgeted else {"fdc": "x.safetensors"} if name == "fdc" else {}


def test_readers_name_every_setting():
    for setting_name in SETTINGS:
        assert readers(setting_name), f"{setting_name} is read by no policy"


def test_docs_tables_are_rendered_from_the_registry():
    """README's configuration table and docs/MODELS.md's traits table (python -m tools.policy_docs --write)."""
    from tools import policy_docs

    for table, (_, render) in policy_docs.TABLES.items():
        assert policy_docs.written(table) == render(), f"{table} is stale: run python -m tools.policy_docs --write"
