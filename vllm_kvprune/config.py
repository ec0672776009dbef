"""One validated configuration for a KV policy, whatever surface it came from.

Surfaces: `--kv-*` flags, a `--kv-config` YAML file, `additional_config["kv_policy"]`
(offline `LLM(...)` or `--additional-config`), and per-request `extra_args` /
`vllm_xargs` (`kv_budget`, `kv_sinks`, `kv_window`). Every check raises
`KVConfigError`, whose message names the setting the way the user spelled it on
that surface (`--kv-budget`, `budget` in a YAML file, `kv_budget` in a request).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ALL_POLICIES = ("none", "streaming", "h2o", "paged_eviction", "gvote", "fdc")
# Policies whose mechanism is built; the others fail at start-up, never silently run as `none`.
AVAILABLE_POLICIES = ("none", "streaming", "h2o", "paged_eviction", "gvote", "fdc")
# Policies with a token budget; GVote picks its own per request, FDC keeps every token.
BUDGETED_POLICIES = ("streaming", "h2o", "paged_eviction")
# Policies that evict whole blocks at decode, each layer its own (the rest evict tokens).
BLOCK_POLICIES = ("paged_eviction",)
# Policies that score tokens from the whole prompt and keep original positions.
SCORED_POLICIES = ("h2o", "paged_eviction")
POSITION_MODES = ("original", "cache")
PREFILL_MODES = ("full", "streaming")
ADDITIONAL_CONFIG_KEY = "kv_policy"
# Policies whose footprint the worker learns from the data and reports to the scheduler
# (per-head kept lengths in head-pages); they have no budget and no fixed cap.
FOOTPRINT_POLICIES = ("gvote",)
# Policies that keep every token (FDC narrows each one instead): no budget, no cap.
KEEP_ALL_POLICIES = ("fdc",)
# Eviction policies FDC's narrow heads compose with (`--kv-fdc FILE` beside them), and why the
# others do not: each needs something of the full-width cache that the reduced one lacks.
FDC_COMPOSABLE = ("fdc", "streaming", "paged_eviction")
FDC_REFUSALS = {
    "none": "a calibration without eviction is --kv-policy fdc",
    "h2o": "h2o's attention mass would have to come from the reduced-space kernel, which does not compute it",
    "gvote": "gvote's per-head lengths (head-pages) and FDC's per-head widths (packed rows) are two layouts "
             "that are not combined",
}
# Per-request override keys (SamplingParams.extra_args / OpenAI vllm_xargs) -> config field.
REQUEST_KEYS = {"kv_budget": "budget", "kv_sinks": "sinks", "kv_window": "window", "kv_recent": "recent",
                "kv_prune_interval": "prune_interval", "kv_gvote_p": "gvote_p", "kv_gvote_samples": "gvote_samples"}
# A request that sets it gets its KV statistics back when it finishes, in its output's
# `kv_transfer_params["kvprune"]` (`KVPruneScheduler.kv_report`); not a policy setting.
REPORT_KEY = "kv_report"


class KVConfigError(ValueError):
    """A bad KV policy setting; the message names the setting and what is allowed."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem


@dataclass(frozen=True)
class Surface:
    """How the settings are spelled where they came from, so errors name them right."""

    prefix: str = ""
    suffix: str = ""
    dashes: bool = False

    def name(self, field_name: str) -> str:
        shown = field_name.replace("_", "-") if self.dashes else field_name
        return f"{self.prefix}{shown}{self.suffix}"


CLI = Surface(prefix="--kv-", dashes=True)
DICT = Surface(prefix=f"{ADDITIONAL_CONFIG_KEY}.")
REQUEST = Surface(prefix="kv_")


def yaml_surface(path: str | Path) -> Surface:
    return Surface(suffix=f" (in {path})")


@dataclass(frozen=True)
class KVPolicyConfig:
    """A KV-cache policy and its knobs.

    `budget` is the most tokens a decode query attends to, counting itself; for
    `streaming` it is `sinks + window`. `prune_interval` R lets the cache grow to
    `budget + R - 1` and then evicts in one batch (lazy pruning). `recent` (`h2o`) is the
    window of newest tokens every head keeps; the rest of `budget - 1 - sinks` goes to
    heavy hitters (default: half of `budget - sinks` each). For `paged_eviction`, `recent` is
    the newest tokens never evicted: the prompt's last `recent` at prefill, the blocks holding
    the newest `recent` at decode (default: one block); `recent: 0` with `sinks: 0` is the
    paper's own rule, where every block is a candidate.

    `gvote_*` (GVote, budget-free): `gvote_p` the nucleus threshold whose top-p set of the
    last prompt token's query sets each query head's step budget, `gvote_samples` the
    synthetic queries that vote, `gvote_future` the future positions whose RoPE cos/sin
    they are rotated with (averaged), `gvote_seed` the seed of their sampling (per layer).

    `fdc` (FDC): the calibration file (`vllm-kvprune calibrate fdc`) whose rotations and
    per-head ranks narrow the cached heads; `--kv-policy fdc` keeps every token.
    """

    name: str = "none"
    budget: int | None = None
    sinks: int = 4
    window: int | None = None
    recent: int | None = None
    prune_interval: int = 1
    positions: str = "original"
    prefill: str = "full"
    prefill_chunk: int = 256
    gvote_p: float = 0.95
    gvote_samples: int = 8
    gvote_future: int = 16
    gvote_seed: int = 0
    fdc: str | None = None

    @property
    def active(self) -> bool:
        return self.name != "none"

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], surface: Surface = DICT) -> "KVPolicyConfig":
        """Build and validate from a mapping of field names (YAML, additional_config)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            allowed = ", ".join(sorted(known))
            raise KVConfigError(surface.name(unknown[0]), f"unknown setting; allowed: {allowed}")
        return cls(**dict(raw)).validated(surface)

    def with_overrides(self, overrides: Mapping[str, Any], surface: Surface) -> "KVPolicyConfig":
        """A copy with the given fields replaced, validated as a whole."""
        merged = dataclasses.replace(self, **dict(overrides))
        # budget = sinks + window: whichever of budget and window is overridden alone wins,
        # and the other is re-derived from it.
        if "budget" in overrides and "window" not in overrides:
            merged = dataclasses.replace(merged, window=None)
        elif "window" in overrides and "budget" not in overrides:
            merged = dataclasses.replace(merged, budget=None)
        return merged.validated(surface)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- validation ---------------------------------------------------------------
    def validated(self, surface: Surface = DICT) -> "KVPolicyConfig":
        """Check every field; return the config with derived fields filled in."""
        name_of = surface.name
        if self.name not in ALL_POLICIES:
            raise KVConfigError(
                name_of("policy") if surface is CLI else name_of("name"),
                f"unknown policy {self.name!r}; choose one of {', '.join(ALL_POLICIES)}",
            )
        _check_int(self.sinks, name_of("sinks"), minimum=0)
        _check_int(self.prune_interval, name_of("prune_interval"), minimum=1)
        _check_int(self.prefill_chunk, name_of("prefill_chunk"), minimum=1)
        _check_choice(self.positions, name_of("positions"), POSITION_MODES)
        _check_choice(self.prefill, name_of("prefill"), PREFILL_MODES)
        if self.budget is not None:
            _check_int(self.budget, name_of("budget"), minimum=1)
        if self.window is not None:
            _check_int(self.window, name_of("window"), minimum=1)
        if self.recent is not None:
            _check_int(self.recent, name_of("recent"), minimum=0)
        _check_fraction(self.gvote_p, name_of("gvote_p"))
        _check_int(self.gvote_samples, name_of("gvote_samples"), minimum=1)
        _check_int(self.gvote_future, name_of("gvote_future"), minimum=1)
        _check_int(self.gvote_seed, name_of("gvote_seed"), minimum=0)
        if self.name in FOOTPRINT_POLICIES:
            if self.budget is not None or self.window is not None:
                given = "budget" if self.budget is not None else "window"
                raise KVConfigError(name_of(given), f"policy {self.name!r} chooses its own footprint; remove it")
            if self.positions != "original":
                raise KVConfigError(name_of("positions"), f"policy {self.name!r} supports only 'original'")
            if self.prefill != "full":
                raise KVConfigError(name_of("prefill"), f"policy {self.name!r} supports only 'full' (it votes "
                                    "once over the whole prompt)")
        if self.name == "fdc" or self.fdc is not None:
            self._check_fdc(name_of)
        if self.name not in BUDGETED_POLICIES:
            return self
        budget = self._resolved_budget(name_of)
        if self.sinks >= budget:
            raise KVConfigError(
                name_of("sinks"), f"must be smaller than the budget ({budget}), got {self.sinks}"
            )
        if self.name in SCORED_POLICIES:
            # Scores come from keys cached at their original positions, after a whole prompt.
            if self.positions != "original":
                raise KVConfigError(name_of("positions"), f"policy {self.name!r} supports only 'original'")
            if self.prefill != "full":
                raise KVConfigError(name_of("prefill"), f"policy {self.name!r} supports only 'full'")
        resolved = dataclasses.replace(self, budget=budget)
        if self.name == "h2o" and self.sinks + resolved.recent_size > budget - 1:
            raise KVConfigError(
                name_of("recent"),
                f"must be at most budget - 1 - sinks = {budget - 1 - self.sinks} (room for the new "
                f"token), got {self.recent}",
            )
        return resolved

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

    def _check_fdc(self, name_of) -> None:
        """FDC narrows heads: alone (`fdc`, every token kept) or under the eviction of a policy in
        `FDC_COMPOSABLE`."""
        if self.name not in FDC_COMPOSABLE:
            why = FDC_REFUSALS.get(self.name, "not built")
            raise KVConfigError(name_of("fdc"), f"FDC does not compose with {self.name}: {why}; it composes "
                                "with streaming and paged_eviction, or runs alone as --kv-policy fdc")
        if not isinstance(self.fdc, (str, Path)) or not str(self.fdc):
            who = "policy 'fdc'" if self.name == "fdc" else f"{self.name} with FDC"
            raise KVConfigError(name_of("fdc"), f"{who} needs a calibration file "
                                "(make one with: vllm-kvprune calibrate fdc MODEL --out FILE)")
        if self.name == "fdc" and (self.budget is not None or self.window is not None):
            given = "budget" if self.budget is not None else "window"
            raise KVConfigError(name_of(given), "policy 'fdc' keeps every token; remove it")
        if self.positions != "original":
            raise KVConfigError(name_of("positions"), f"policy {self.name!r} with FDC supports only 'original' "
                                "(keys are projected after RoPE and are never rotated again)")

    @property
    def narrow_heads(self) -> bool:
        """FDC's calibration narrows the cached heads (`fdc`, or an eviction policy with `fdc`)."""
        return self.fdc is not None

    def _resolved_budget(self, name_of) -> int:
        if self.budget is None and self.window is None:
            raise KVConfigError(name_of("budget"), f"policy {self.name!r} needs a budget (tokens kept)")
        if self.budget is None:
            return self.sinks + self.window
        if self.window is not None and self.window != self.budget - self.sinks:
            raise KVConfigError(
                name_of("window"),
                f"window {self.window} + sinks {self.sinks} must equal the budget {self.budget}",
            )
        return self.budget

    def check_engine(self, block_size: int, surface: Surface = DICT) -> None:
        """Checks that need the engine's block size."""
        if block_size % 32:
            raise KVConfigError("--block-size", f"must be a multiple of 32 on CPU, got {block_size}")
        if self.budget is not None and self.name in BUDGETED_POLICIES and self.budget < block_size:
            raise KVConfigError(
                surface.name("budget"),
                f"{self.budget} tokens cannot hold one KV block (block size {block_size}); "
                f"use at least {block_size} or a smaller --block-size",
            )
        if self.name in BLOCK_POLICIES:
            # Sink blocks and the newest blocks are never evicted; at least one other block must be.
            tail_blocks = self.protected_tail_blocks(block_size)
            needed = (self.protected_blocks(block_size) + tail_blocks + 1) * block_size
            if self.budget < needed:
                raise KVConfigError(
                    surface.name("budget"),
                    f"{self.name} needs at least {needed} tokens with {self.sinks} sinks, {tail_blocks} protected "
                    f"newest block(s) and block size {block_size} (sink blocks + one evictable block + the "
                    f"newest), got {self.budget}",
                )

    # ---- capacity (the same pure function on scheduler and worker) ------------------
    @property
    def uncapped(self) -> bool:
        """Whether nothing bounds a request's blocks below `max_model_len` (no budget)."""
        return self.reports_footprint or self.name in KEEP_ALL_POLICIES

    @property
    def reports_footprint(self) -> bool:
        """Whether the worker tells the scheduler what each request needs (no fixed cap)."""
        return self.name in FOOTPRINT_POLICIES

    def cap_blocks(self, block_size: int) -> int:
        """Blocks a request keeps after prefill: the budget plus the lazy-pruning slack
        (R - 1 spare blocks for block policies, which evict R blocks every R block fills)."""
        if self.name in BLOCK_POLICIES:
            return math.ceil(self.budget / block_size) + self.prune_interval - 1
        return math.ceil((self.budget + self.prune_interval) / block_size)

    def protected_blocks(self, block_size: int) -> int:
        """Leading blocks a block policy never evicts: those holding the sinks."""
        return math.ceil(self.sinks / block_size)

    def protected_tail(self, block_size: int) -> int:
        """Newest tokens a block policy never evicts (`recent`; default one block)."""
        return block_size if self.recent is None else self.recent

    def protected_tail_blocks(self, block_size: int) -> int:
        """Trailing blocks a block policy never evicts at decode: those holding the newest
        `protected_tail` tokens (its blocks are full when it evicts)."""
        return math.ceil(self.protected_tail(block_size) / block_size)

    def prefill_cap_blocks(self, block_size: int) -> int | None:
        """Blocks a request may hold while its prompt is prefilled (None: unbounded)."""
        if self.prefill == "full":
            return None
        streaming_tokens = self.budget - 1 + self.prefill_chunk
        return max(self.cap_blocks(block_size), math.ceil(streaming_tokens / block_size))

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

    def for_request(self, extra_args: Mapping[str, Any] | None) -> "KVPolicyConfig":
        """This config with a request's `kv_*` overrides applied and validated."""
        overrides = request_overrides(extra_args)
        if not overrides:
            return self
        # gvote's knobs are gvote's only, and gvote has no budget, sinks or window.
        foreign = [key for key, field in REQUEST_KEYS.items()
                   if field in overrides and field.startswith("gvote_") != (self.name == "gvote")]
        if foreign:
            raise KVConfigError(foreign[0], f"does not apply to kv_policy {self.name}")
        return self.with_overrides(overrides, REQUEST)


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


def _check_int(value: Any, setting: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVConfigError(setting, f"must be an integer, got {value!r}")
    if value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise KVConfigError(setting, f"must be {bound}, got {value}")


def _check_fraction(value: Any, setting: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise KVConfigError(setting, f"must be a number in (0, 1], got {value!r}")


def _check_choice(value: Any, setting: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise KVConfigError(setting, f"must be one of {', '.join(choices)}, got {value!r}")


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


@dataclass
class CLIFlags:
    """The `--kv-*` values as parsed (None: not given)."""

    policy: str | None = None
    budget: int | None = None
    sinks: int | None = None
    window: int | None = None
    recent: int | None = None
    prune_interval: int | None = None
    positions: str | None = None
    prefill: str | None = None
    prefill_chunk: int | None = None
    gvote_p: float | None = None
    gvote_samples: int | None = None
    gvote_future: int | None = None
    gvote_seed: int | None = None
    fdc: str | None = None
    config: str | None = None

    def merged_with(self, base: KVPolicyConfig | None) -> KVPolicyConfig | None:
        """Flags over the YAML file over `additional_config`; None if nothing was given."""
        overrides = {
            ("name" if key == "policy" else key): value
            for key, value in dataclasses.asdict(self).items()
            if key != "config" and value is not None
        }
        if self.config is not None:
            base = load_yaml(self.config)
        if not overrides:
            return base
        return (base or KVPolicyConfig()).with_overrides(overrides, CLI)
