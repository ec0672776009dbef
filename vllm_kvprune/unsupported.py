"""vLLM features no KV policy runs with, refused before start-up and named by their flag.

Each is checked on the user's own settings: the parsed `vllm serve` flags (exit 2 with one
line, before anything starts) and the engine args (`LLM(...)`, and anything that bypassed
the flags, with a ValueError). The names are both `EngineArgs` fields and `vllm serve`
namespace attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvprune.config import KVConfigError

_POOLING = ("a pooling model: it runs each prompt once and decodes nothing, so there is no cache to prune "
            "(and vLLM's pooling runner takes no request checks)")
_CONNECTOR = ("a KV connector: it saves and loads a request's blocks as whole token rows in order, "
              "while under a policy a block holds the slots the policy kept")
_CONTEXT = "context parallelism: a policy's maps hold a request's slots whole on every rank"

@dataclass(frozen=True)
class Feature:
    """One vLLM feature: the `EngineArgs` field that turns it on, its flag, why no policy runs
    with it, and what runs instead (if anything)."""

    field: str
    flag: str
    why: str
    instead: str = ""

    def turned_on(self, value: Any) -> bool:
        """A config or size given (a parallel size counts from 2), or the pooling runner."""
        if self.field == "runner":
            return value == "pooling"
        if isinstance(value, int) and not isinstance(value, bool):
            return value > 1
        return bool(value)


_TP = "tensor parallelism is supported"
FEATURES: tuple[Feature, ...] = (
    Feature("speculative_config", "--speculative-config",
            "speculative decoding: a multi-token decode step would attend over evicted slots"),
    Feature("kv_transfer_config", "--kv-transfer-config", _CONNECTOR),
    Feature("kv_offloading_size", "--kv-offloading-size", _CONNECTOR),
    Feature("pipeline_parallel_size", "--pipeline-parallel-size",
            "pipeline parallelism: only the last stage's step output reaches the scheduler, so the other "
            "stages' reports (a vote's footprints, what each layer kept) would be lost", _TP),
    Feature("decode_context_parallel_size", "--decode-context-parallel-size", _CONTEXT, _TP),
    Feature("prefill_context_parallel_size", "--prefill-context-parallel-size", _CONTEXT, _TP),
    Feature("runner", "--runner", _POOLING),
)


def check(policy_name: str, settings: Any) -> None:
    """Raise `KVConfigError` (the setting is the flag) for the first feature `settings` turn on."""
    for feature in FEATURES:
        value = getattr(settings, feature.field, None)
        if feature.turned_on(value):
            given = f" {value}" if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
            instead = f" ({feature.instead})" if feature.instead else ""
            raise KVConfigError(feature.flag, f"kv_policy {policy_name!r} cannot run with {feature.why}; "
                                              f"remove {feature.flag}{given}{instead}")


def check_model(policy_name: str, model_config: Any) -> None:
    """What the engine config resolved: a pooling model picked by `--runner auto` (an
    embedding model's architecture, or `--convert`) is refused as one asked for; so is MLA
    (DeepSeek-V2/V3 style: one latent vector per token for all heads, in backends our
    wrappers do not wrap; before, the CPU's MLA block size of 16 was refused as if the user
    had asked for it)."""
    if model_config.runner_type == "pooling":
        raise ValueError(f"kv_policy {policy_name!r} cannot run with {_POOLING}")
    if getattr(model_config, "use_mla", False):
        architecture = (getattr(model_config, "architectures", None) or ["this model"])[0]
        raise ValueError(f"kv_policy {policy_name!r} cannot run with MLA attention ({architecture}: a latent "
                         "KV cache shared by all heads, which the policies' attention wrappers do not carry)")
