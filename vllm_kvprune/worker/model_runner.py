"""The CPU model runner, telling the KV state which requests sit in which rows."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_kvprune.config import policy_from_vllm_config
from vllm_kvprune.worker import runtime
from vllm_kvprune.worker.state import StepRows, WorkerKVState


class KVPruneCPUModelRunner(CPUModelRunner):
    """`CPUModelRunner` that publishes each step's rows and forgets finished requests."""

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self.kv_state = WorkerKVState(policy_from_vllm_config(vllm_config))
        runtime.install(self.kv_state)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if self.kv_state.policy is None:
            return
        [group] = kv_cache_config.kv_cache_groups  # one full-attention group with a policy
        spec = group.kv_cache_spec
        self.kv_state.bind_cache(list(group.layer_names), kv_cache_config.num_blocks, spec.block_size,
                                 self.model_config.get_total_num_kv_heads(), spec.num_kv_heads)

    def _update_states(self, scheduler_output):
        # A preempted request lost its blocks; it re-prefills from scratch when resumed.
        for request_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self.kv_state.drop(request_id)
        return super()._update_states(scheduler_output)

    def _build_attention_metadata(self, num_tokens, num_reqs, max_query_len, *args, **kwargs):
        batch = self.input_batch
        req_ids = [rid for rid in batch.req_ids[:num_reqs] if rid is not None]
        self.kv_state.rows = StepRows(
            req_ids=req_ids,
            num_computed=batch.num_computed_tokens_cpu[:num_reqs],
            num_prompt=batch.num_prompt_tokens[:num_reqs],
            block_rows=batch.block_table[0].block_table.np[:num_reqs],
            extra_args=[self.requests[rid].sampling_params.extra_args if rid in self.requests
                        and self.requests[rid].sampling_params else None for rid in req_ids],
        )
        try:
            return super()._build_attention_metadata(num_tokens, num_reqs, max_query_len, *args, **kwargs)
        finally:
            self.kv_state.rows = None
