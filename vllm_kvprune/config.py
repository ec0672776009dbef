"""One validated configuration for a KV policy, whatever surface it came from.

Surfaces: `--kv-*` flags, a `--kv-config` YAML file, `additional_config["kv_policy"]`
(offline `LLM(...)` or `--additional-config`), and per-request `extra_args` /
`vllm_xargs` (`kv_budget`, ...). The fields are the settings the registered policies declare
(`vllm_kvprune/policies/`), each written once there; every check raises `KVConfigError`,
whose message names the setting the way the user spelled it on that surface (`--kv-budget`,
`budget` in a YAML file, `kv_budget` in a request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_kvprune.policies import REGISTRY, all_settings, readers
from vllm_kvprune.policies.base import Policy
from vllm_kvprune.policies.fdc import check_format as check_fdc_format
from vllm_kvprune.policies.settings import (
    ADDITIONAL_CONFIG_KEY,
    CLI,
    DICT,
    FDC,
    REQUEST,
    KVConfigError,
    Setting,
    Surface,
    yaml_surface,
)

# Every setting some registered policy reads, by field name (the config's fields after `name`).
SETTINGS: dict[str, Setting] = {setting.name: setting for setting in all_settings()}
ALL_POLICIES = tuple(REGISTRY)
# Per-request override keys (SamplingParams.extra_args / OpenAI vllm_xargs) -> config field.
REQUEST_KEYS = {setting.request_key: name for name, setting in SETTINGS.items() if setting.per_request}
# A request that sets it gets its KV statistics back when it finishes, in its output's
# `kv_transfer_params["kvprune"]` (`KVPruneScheduler.kv_report`); not a policy setting.
REPORT_KEY = "kv_report"

__all__ = ["ADDITIONAL_CONFIG_KEY", "ALL_POLICIES", "CLI", "DICT", "REPORT_KEY", "REQUEST", "REQUEST_KEYS",
           "SETTINGS", "CLIFlags", "KVConfigError", "KVPolicyConfig", "Surface", "from_additional_config",
           "load_yaml", "policy_from_vllm_config", "request_overrides", "yaml_surface"]


class _PolicyConfig:
    """What a `KVPolicyConfig` does (its fields are generated from the registry, below).

    `budget` is the most tokens a decode query attends to, counting itself; for
    `streaming` it is `sinks + window`. `prune_interval` R lets the cache grow to
    `budget + R - 1` and then evicts in one batch (lazy pruning). What each setting means
    under each policy: the setting's help and the policy's notes (README's configuration
    table, rendered from them).
    """

    name: str

    @property
    def policy(self) -> Policy:
        """The policy object this config runs: the registered one, or the variant of it its
        settings select (`Policy.for_config`)."""
        policy = REGISTRY[self.name]
        return policy.for_config(self)

    @property
    def active(self) -> bool:
        return self.name != "none"

    def replace(self, **changes: Any) -> KVPolicyConfig:
        return dataclasses.replace(self, **changes)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], surface: Surface = DICT) -> KVPolicyConfig:
        """Build and validate from a mapping of field names (YAML, additional_config)."""
        unknown = sorted(set(raw) - {"name", *SETTINGS})
        if unknown:
            allowed = ", ".join(sorted(["name", *SETTINGS]))
            raise KVConfigError(surface.name(unknown[0]), f"unknown setting; allowed: {allowed}")
        config = cls(**dict(raw))
        _check_given(config, raw, surface)
        return config.validated(surface)

    def with_overrides(self, overrides: Mapping[str, Any], surface: Surface) -> KVPolicyConfig:
        """A copy with the given fields replaced, validated as a whole."""
        merged = dataclasses.replace(self, **dict(overrides))
        if merged.name in ALL_POLICIES:  # else `validated` names the policy
            _check_given(merged, overrides, surface)
            merged = dataclasses.replace(merged, **merged.policy.merge_overrides(self, overrides))
        return merged.validated(surface)

    def to_dict(self) -> dict[str, Any]:
        """The name and the settings its policy reads (what `from_dict` takes back)."""
        return {"name": self.name, **{setting.name: getattr(self, setting.name) for setting in self.policy.settings}}

    # ---- validation ---------------------------------------------------------------
    def validated(self, surface: Surface = DICT) -> KVPolicyConfig:
        """Check every field; return the config with derived fields filled in."""
        name_of = surface.name
        if self.name not in ALL_POLICIES:
            raise KVConfigError(name_of("policy") if surface is CLI else name_of("name"),
                                f"unknown policy {self.name!r}; choose one of {', '.join(ALL_POLICIES)}")
        for name, setting in SETTINGS.items():
            setting.check(getattr(self, name), surface)
        _check_given(self, {name: getattr(self, name) for name, setting in SETTINGS.items()
                            if getattr(self, name) != setting.default}, surface)
        config = check_fdc_format(self, name_of) if self.fdc is not None else self
        return self.policy.validate(config, name_of)

    def check_engine(self, block_size: int, surface: Surface = DICT, tensor_parallel_size: int = 1) -> None:
        """Checks that need the engine's block size and tensor-parallel size."""
        if block_size % 32:
            raise KVConfigError("--block-size", f"must be a multiple of 32 on CPU, got {block_size}")
        if self.active:
            self.policy.check_engine(self, block_size, surface)
            self.policy.check_parallel(self, tensor_parallel_size, surface)

    # ---- the budget's step rule (the same on scheduler, worker and reference) -------------
    @property
    def max_cached(self) -> int:
        """Most tokens a request caches before lazy pruning evicts (budget + R - 1)."""
        return self.budget + self.prune_interval - 1

    def evicts_before(self, num_cached: int, num_incoming: int) -> bool:
        """The step rule: a step of `num_incoming` tokens on `num_cached` first evicts down
        to `budget - 1` iff the cache would pass `budget + R - 1` and holds more than that."""
        return num_cached + num_incoming > self.max_cached and num_cached > self.budget - 1

    @property
    def recent_size(self) -> int:
        """Newest tokens every head keeps under `h2o` (`recent`, else half of budget - sinks)."""
        return (self.budget - self.sinks) // 2 if self.recent is None else self.recent

    @property
    def window_size(self) -> int:
        """Recent tokens kept next to the sinks."""
        return self.budget - self.sinks

    @property
    def narrow_heads(self) -> bool:
        """FDC's calibration narrows the cached heads (`fdc`, or an eviction policy with `fdc`)."""
        return self.fdc is not None

    # ---- capacity (the same pure functions on scheduler and worker) ------------------
    @property
    def uncapped(self) -> bool:
        """Whether nothing bounds a request's blocks below `max_model_len` (no budget)."""
        return self.policy.uncapped

    @property
    def reports_footprint(self) -> bool:
        """Whether the worker tells the scheduler what each request needs (no fixed cap)."""
        return self.policy.reports_footprint

    def cap_blocks(self, block_size: int) -> int:
        """Blocks a request keeps after prefill (the policy's rule)."""
        return self.policy.cap_blocks(self, block_size)

    def prefill_cap_blocks(self, block_size: int) -> int | None:
        """Blocks a request may hold while its prompt is prefilled (None: unbounded)."""
        if self.prefill == "full":
            return None
        streaming_tokens = self.budget - 1 + self.prefill_chunk
        return max(self.cap_blocks(block_size), -(-streaming_tokens // block_size))

    def prompt_blocks(self, block_size: int, num_prompt_tokens: int) -> int:
        """Most blocks a request holds while its prompt of `num_prompt_tokens` is prefilled:
        the whole prompt with `prefill: full`, at most `prefill_cap_blocks` when streaming."""
        whole = -(-num_prompt_tokens // block_size)
        streaming = self.prefill_cap_blocks(block_size)
        return whole if streaming is None else min(whole, streaming)

    def peak_blocks(self, block_size: int, max_model_len: int, num_prompt_tokens: int | None = None) -> int:
        """Most blocks one request ever holds: its prompt's prefill (unknown prompt: the
        longest the policy bounds, nothing for `prefill: full`) or its cap past the prompt,
        never more than `max_model_len` tokens need. A pool with this many usable blocks
        always serves the request, however long it waits for others to finish."""
        whole_model_len = -(-max_model_len // block_size)
        if self.uncapped:
            # Nothing bounds what a voted request keeps (its prompt and outputs, at most);
            # FDC keeps every token, each narrower (the blocks are narrower, not fewer).
            return whole_model_len
        prefill = self.prefill_cap_blocks(block_size) or 0
        if num_prompt_tokens is not None:
            prefill = self.prompt_blocks(block_size, num_prompt_tokens)
        return min(whole_model_len, max(prefill, self.cap_blocks(block_size)))

    def for_request(self, extra_args: Mapping[str, Any] | None) -> KVPolicyConfig:
        """This config with a request's `kv_*` overrides applied and validated."""
        overrides = request_overrides(extra_args)
        if not overrides:
            return self
        config = self.with_overrides(overrides, REQUEST)
        if self.active:
            self.policy.check_request(self, config, REQUEST.name)
        return config


KVPolicyConfig = dataclasses.make_dataclass(
    "KVPolicyConfig",
    [("name", str, dataclasses.field(default="none"))]
    + [(name, Any, dataclasses.field(default=setting.default)) for name, setting in SETTINGS.items()],
    bases=(_PolicyConfig,), frozen=True)
KVPolicyConfig.__module__ = __name__  # where pickle finds it
KVPolicyConfig.__doc__ = (f"A KV-cache policy (`name`: one of {', '.join(ALL_POLICIES)}) and its settings "
                          f"({', '.join(SETTINGS)}), as the registered policies declare them. "
                          + (_PolicyConfig.__doc__ or ""))


def _check_given(config: KVPolicyConfig, given: Mapping[str, Any], surface: Surface) -> None:
    """Refuse a setting given a value (None is not a value) that `config`'s policy does not read."""
    if config.name not in ALL_POLICIES:
        return  # `validated` names the policy
    policy = config.policy
    for name, value in given.items():
        if name == "name" or value is None or name not in SETTINGS or policy.reads(name):
            continue
        raise KVConfigError(surface.name(name), _not_read(policy, SETTINGS[name]))


def _not_read(policy: Policy, setting: Setting) -> str:
    """Why a setting `policy` does not read is refused, in the words most useful to the user."""
    if setting is FDC:
        composable = [name for name in readers(FDC.name) if name != "fdc"]
        return (f"FDC does not compose with {policy.name}: {policy.fdc_refusal}; it composes with "
                f"{' and '.join(composable)}, or runs alone as --kv-policy fdc")
    reason = policy.refused_settings.get(setting.name)
    if reason is not None:
        return f"policy {policy.name!r} {reason}"
    if setting.choices:
        return f"policy {policy.name!r} supports only {setting.default!r}"
    return f"does not apply to kv_policy {policy.name} (read by {', '.join(readers(setting.name))})"


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config fields a request overrides, from its `kv_*` extra args."""
    if not extra_args:
        return {}
    overrides: dict[str, Any] = {}
    for key, value in extra_args.items():
        if key in REQUEST_KEYS:
            overrides[REQUEST_KEYS[key]] = value
        elif key == REPORT_KEY:
            # vLLM's HTTP front end turns a JSON true in vllm_xargs into 1.
            if not (isinstance(value, (bool, int)) and value in (0, 1)):
                raise KVConfigError(key, f"must be true or false, got {value!r}")
        elif key.startswith("kv_") and key not in ("kv_transfer_params", "kv_cache_report_mode"):
            raise KVConfigError(key, f"unknown per-request setting; allowed: {', '.join([*REQUEST_KEYS, REPORT_KEY])}")
    return overrides


def load_yaml(path: str | Path) -> KVPolicyConfig:
    """Read a `--kv-config` file: a mapping of config fields (optionally under `kv_policy:`)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise KVConfigError("--kv-config", f"file not found: {path}")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise KVConfigError("--kv-config", f"{path} is not valid YAML: {exc}") from None
    if isinstance(raw, dict) and set(raw) == {ADDITIONAL_CONFIG_KEY}:
        raw = raw[ADDITIONAL_CONFIG_KEY]
    if not isinstance(raw, dict):
        raise KVConfigError("--kv-config", f"{path} must hold a mapping of settings")
    return KVPolicyConfig.from_dict(raw, yaml_surface(path))


def from_additional_config(additional_config: Mapping[str, Any] | None) -> KVPolicyConfig:
    """The policy stored in vLLM's `additional_config` (absent means `none`).

    Accepts a dict, a bare policy name, or the dotted CLI form
    (`--additional-config.kv_policy h2o --additional-config.kv_budget 256`).
    """
    raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if raw is None:
        return KVPolicyConfig()
    if isinstance(raw, str):
        flat = {k[3:]: v for k, v in additional_config.items() if k.startswith("kv_") and k != ADDITIONAL_CONFIG_KEY}
        raw = {"name": raw, **flat}
    if not isinstance(raw, Mapping):
        raise KVConfigError(ADDITIONAL_CONFIG_KEY, f"must be a mapping of settings, got {raw!r}")
    return KVPolicyConfig.from_dict(raw, DICT)


def policy_from_vllm_config(vllm_config: Any) -> KVPolicyConfig:
    """The validated policy of a built `VllmConfig` (used by scheduler and worker)."""
    return from_additional_config(getattr(vllm_config, "additional_config", None))


@dataclasses.dataclass
class CLIFlags:
    """The `--kv-*` values as parsed (None: not given): the policy, the YAML file, and each
    setting's value by field name."""

    policy: str | None = None
    config: str | None = None
    values: dict[str, Any] = dataclasses.field(default_factory=dict)

    def merged_with(self, base: KVPolicyConfig | None) -> KVPolicyConfig | None:
        """Flags over the YAML file over `additional_config`; None if nothing was given."""
        overrides = {name: value for name, value in self.values.items() if value is not None}
        if self.policy is not None:
            overrides["name"] = self.policy
        if self.config is not None:
            base = load_yaml(self.config)
        if not overrides:
            return base
        return (base or KVPolicyConfig()).with_overrides(overrides, CLI)
