"""The GPU worker and runner (set as `worker_cls` on CUDA/ROCm when a policy is on).

vLLM's GPU `Worker` builds its runner in `_make_model_runner`; ours builds vLLM's V1 GPU
runner with the policies' hooks (`KVPruneRunnerMixin`, the same as on CPU). vLLM's V2 GPU
runner (`VLLM_USE_V2_MODEL_RUNNER`) plans steps through other code paths: a policy refuses it
at start-up, naming it.
"""

from __future__ import annotations

from vllm_kvprune import plugin
from vllm_kvprune.vllm_hooks import GPUModelRunner, Worker
from vllm_kvprune.worker.worker_mixin import KVPruneWorkerMixin
from vllm_kvprune.worker.model_runner import KVPruneRunnerMixin


class KVPruneGPUModelRunner(KVPruneRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU runner with the policies' hooks."""


class KVPruneGPUWorker(KVPruneWorkerMixin, Worker):
    def _make_model_runner(self) -> KVPruneGPUModelRunner:
        plugin.require_installed("the worker")
        if self.use_v2_model_runner:
            raise ValueError("kv_policy runs on vLLM's V1 GPU model runner; unset VLLM_USE_V2_MODEL_RUNNER")
        return KVPruneGPUModelRunner(self.vllm_config, self.device)
