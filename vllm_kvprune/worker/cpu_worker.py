"""The CPU worker that runs `KVPruneCPUModelRunner` (set as `worker_cls` when a policy is on)."""

from __future__ import annotations

import torch

from vllm_kvprune import plugin
from vllm_kvprune.vllm_hooks import CPUWorker
from vllm_kvprune.worker.model_runner import KVPruneCPUModelRunner
from vllm_kvprune.worker.worker_mixin import KVPruneWorkerMixin


class KVPruneCPUWorker(KVPruneWorkerMixin, CPUWorker):
    def init_device(self) -> None:
        plugin.require_installed("the worker")
        super().init_device()
        # CPUWorker builds its runner by name; rebuild it as ours (construction is cheap,
        # nothing is loaded until load_model).
        self.model_runner = KVPruneCPUModelRunner(self.vllm_config, torch.device("cpu"))
