"""A KV setting, written once: its field, default, check and help, and the names every surface
derives from it.

A `Setting` is declared where it belongs: the ones several policies share below, a policy's own
in its module (`gvote_p` in `policies/gvote.py`). The registry (`policies/__init__.py`) collects
them; the config's fields (`config.KVPolicyConfig`), the `--kv-*` flags and their `--help` group
(`plugin.py`), the YAML and `additional_config` keys, the per-request `vllm_xargs` keys and the
README's configuration table are all read off these objects. Every check raises
`KVConfigError`, whose message names the setting as the user spelled it on that surface
(`--kv-budget`, `budget` in a YAML file, `kv_budget` in a request).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

ADDITIONAL_CONFIG_KEY = "kv_policy"


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


def yaml_surface(path: Any) -> Surface:
    return Surface(suffix=f" (in {path})")


@dataclass(frozen=True)
class Setting:
    """One knob. `kind` is int, float or str; an int has a `minimum`, a float may be a
    `fraction` in (0, 1], a str may have `choices`. `default` None means "not given" (its
    policy derives it, or it is optional). `per_request`: a request may override it
    (`vllm_xargs: {"kv_<name>": ...}`). `help` is the flag's help and the docs' meaning;
    `shown_default` what the docs say when the default is derived."""

    name: str
    kind: type
    default: Any
    help: str
    minimum: int | None = None
    fraction: bool = False
    choices: tuple[str, ...] = ()
    per_request: bool = False
    metavar: str = "N"
    shown_default: str | None = None

    @property
    def flag(self) -> str:
        return CLI.name(self.name)

    @property
    def request_key(self) -> str | None:
        return REQUEST.name(self.name) if self.per_request else None

    def parse_flag(self, raw: str) -> Any:
        """A flag's text as this setting's type; a KVConfigError naming the flag if it is not one."""
        if self.kind is int:
            try:
                return int(raw)
            except ValueError:
                raise KVConfigError(self.flag, f"must be an integer, got {raw!r}") from None
        if self.kind is float:
            try:
                return float(raw)
            except ValueError:
                raise KVConfigError(self.flag, f"must be a number, got {raw!r}") from None
        return raw

    def check(self, value: Any, surface: Surface) -> None:
        """The value's type and range (None passes where the default is None: not given)."""
        if value is None and self.default is None:
            return
        named = surface.name(self.name)
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVConfigError(named, f"must be an integer, got {value!r}")
            if self.minimum is not None and value < self.minimum:
                bound = "positive" if self.minimum == 1 else f">= {self.minimum}"
                raise KVConfigError(named, f"must be {bound}, got {value}")
        elif self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    self.fraction and not 0 < value <= 1):
                raise KVConfigError(named, f"must be a number in (0, 1], got {value!r}")
        elif self.choices and value not in self.choices:
            raise KVConfigError(named, f"must be one of {', '.join(self.choices)}, got {value!r}")
        elif not self.choices and not isinstance(value, (str, os.PathLike)):
            raise KVConfigError(named, f"must be a string, got {value!r}")

    def flag_metavar(self) -> str:
        return "{" + ",".join(self.choices) + "}" if self.choices else self.metavar


# ---- the settings several policies share ---------------------------------------------------
BUDGET = Setting(
    "budget", int, None, "Tokens a request keeps in its KV cache: the most a decode query attends to, itself "
    "included.", minimum=1, per_request=True, metavar="TOKENS")
SINKS = Setting("sinks", int, 4, "First tokens never evicted.", minimum=0, per_request=True)
WINDOW = Setting("window", int, None, "Recent tokens kept beside the sinks; budget = sinks + window (give one of "
                 "the two).", minimum=1, per_request=True, shown_default="`budget - sinks`")
RECENT = Setting("recent", int, None, "Newest tokens never evicted.", minimum=0, per_request=True)
PRUNE_INTERVAL = Setting("prune_interval", int, 1, "Lazy pruning: the cache grows to budget + R - 1, then drops R "
                         "tokens at once.", minimum=1, per_request=True, metavar="R")
POSITIONS = Setting("positions", str, "original", "RoPE positions of kept keys: original (kept keys keep their "
                    "positions) or cache (StreamingLLM's positions inside the cache; only the sinks are re-rotated).",
                    choices=("original", "cache"))
PREFILL = Setting("prefill", str, "full", "full: prefill the whole prompt, then prune; streaming: prune between "
                  "prompt chunks, so a prompt of any length runs in budget + prefill_chunk tokens.",
                  choices=("full", "streaming"))
PREFILL_CHUNK = Setting("prefill_chunk", int, 256, "Chunk size of a streaming prefill.", minimum=1,
                        metavar="TOKENS")
ALLOCATION = Setting(
    "allocation", str, "uniform", "How the budget is spread over layers and KV heads: uniform (every head of every "
    "layer keeps budget - 1 prompt tokens), pyramid (PyramidKV: more in the lower layers, the same total) or adaptive "
    "(AdaKV: each layer's total split over its heads by one top-k of their scores, a floor per head). pyramid and "
    "adaptive keep each head's tokens in head-pages with a KV-cache group per layer and compress the prompt only "
    "(generated tokens are all kept, as in kvpress); a request may switch between them, not to or from uniform "
    "(another cache layout). docs/PER_LAYER.md.", choices=("uniform", "pyramid", "adaptive"), per_request=True)
FDC = Setting("fdc", str, None, "FDC calibration file of the model (vllm-kvprune calibrate fdc MODEL --out FILE), "
              "checked against the model at start-up: narrower KV heads.", metavar="FILE")
