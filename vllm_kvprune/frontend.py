"""The front end's state: the policy the engine was built with, which this process checks every
request against (per-request overrides, prompts, misplaced settings), in one object.

vLLM's hooks that check requests (a logits processor's `validate_params`, the prompt-length
check, the HTTP middleware) are class-level or module-level callbacks with no engine at hand,
so the process keeps one `FrontEnd` (`FRONT_END`), set when the engine config is adjusted
(`plugin._adjust_vllm_config`) and read here; nothing else in the front end is global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvprune import admission, vllm_hooks
from vllm_kvprune.config import REQUEST, KVConfigError, KVPolicyConfig


@dataclass
class FrontEnd:
    """The policy this front end checks requests against (None: no policy runs here), the
    engine's block size, and its config (the pool's size once the engine reported it)."""

    policy: KVPolicyConfig | None = None
    block_size: int | None = None
    vllm_config: Any = None

    def serve(self, policy: KVPolicyConfig, block_size: int, vllm_config: Any) -> None:
        self.policy, self.block_size, self.vllm_config = policy, block_size, vllm_config

    def pool_blocks(self) -> int | None:
        """Usable KV blocks, once the engine has reported its pool (None before)."""
        return vllm_hooks.reported_pool_blocks(self.vllm_config) if self.vllm_config is not None else None

    def check_request(self, extra_args: dict | None) -> None:
        """A request's `kv_*` overrides: valid, and fitting the pool (KVConfigError, counted)."""
        if self.policy is None:
            return
        try:
            policy = self.policy.for_request(extra_args)
            policy.check_engine(self.block_size, REQUEST, self.vllm_config.parallel_config.tensor_parallel_size
                                if self.vllm_config is not None else 1)
            usable = self.pool_blocks()
            if usable is not None:
                admission.check_request_fits(policy, extra_args, self.block_size,
                                             self.vllm_config.model_config.max_model_len, usable)
        except KVConfigError as exc:
            self.count_rejection(exc.setting)
            raise

    def count_rejection(self, setting: str) -> None:
        """A request this front end refused for `setting` (the metrics' HTTP 400s)."""
        if self.vllm_config is not None:
            count_rejection(self.vllm_config, setting)


def count_rejection(vllm_config: Any, setting: str) -> None:
    from vllm_kvprune.metrics.exporter import record_rejection

    record_rejection(vllm_config, setting)


FRONT_END = FrontEnd()  # this process's
