"""Every place vllm-kvprune touches vLLM's internals, in one module.

vLLM has no stable API for what a KV-cache policy needs, so the plugin leans on internals
of three kinds, all of them listed in `HOOKS` (`hook_contracts.py`, which also checks them):

- **patches**: vLLM functions wrapped in place (`EngineArgs.add_cli_args`, the start-up
  memory check, ...). They are installed by the `install_*` functions here and nowhere else.
- **overrides**: vLLM methods our subclasses override (`FullAttentionManager.remove_skipped_blocks`,
  `Scheduler._reserve_prefill_lookahead`, ...). The subclasses import their vLLM bases from this
  module (`from vllm_kvprune.vllm_hooks import Scheduler`), so an import of a vLLM internal
  outside it is a review finding.
- **reads**: private attributes read at run time (the runner's input batch, the scheduler's
  managers, the forward context, ...), only through the accessor functions here, which fail
  with a message naming the hook.

`contract_problems()` resolves every hook against the installed vLLM and compares the
parameters we rely on; `require_compatible_vllm()` runs it (once per process) together with
the version check before any policy other than `none` starts. Both live in `hook_contracts`
and are read through this module, as are the RoPE reads (`vllm_hooks_rope`: the layer's
rotary embedding, its rotation by a shift, its table averaged over positions).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_kvprune.hook_contracts import (  # noqa: F401 - the contract API, read through this module
    HOOKS,
    Hook,
    compatibility_problems,
    contract_problems,
    hook_problem,
    installed_vllm,
    require_compatible_vllm,
    _CPU_ATTN,
    resolve,
    supported_vllm,
    version_problem,
)
from vllm_kvprune.vllm_hooks_rope import layer_rope, rope_at_average, rope_rotation  # noqa: F401 - read here

# Classes our code subclasses or names, importable from here (resolved lazily: importing this
# module must stay cheap, it runs in every vLLM process).
_EXPORTS = {hook.name: hook.target for hook in HOOKS if "." not in hook.name}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = resolve(_EXPORTS[name])
        globals()[name] = value
        return value
    raise AttributeError(name)



# ---- patches -----------------------------------------------------------------------------
def install_cli(add_flags: Callable[[Any], Any], check_flags: Callable[[Any], None],
                policy_entry: Callable[[Any], dict | None], config_key: str, http_middleware: str | None = None) -> None:
    """`vllm serve` gains flags (`add_flags(parser)`); `check_flags(namespace)` runs right
    after parsing (so a bad flag stops the CLI before start-up); `policy_entry(namespace)`
    is stored under `additional_config[config_key]` of the namespace and of the engine args
    made from it; `http_middleware`
    (an import path) joins the server's `--middleware` list."""
    from vllm.engine.arg_utils import EngineArgs

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser):
        parser = original_add(parser)
        add_flags(parser)
        parse = parser.parse_known_args

        def parse_known_args(*args, **kwargs):
            namespace, rest = parse(*args, **kwargs)
            check_flags(namespace)
            # In the namespace itself, so that every process handed it builds its engine args
            # with the policy: `--api-server-count N` front ends call `from_cli_args` before
            # they have loaded the plugin (and with it the patch below).
            entry = policy_entry(namespace) if hasattr(namespace, "additional_config") else None
            if entry is not None:
                namespace.additional_config = {**(namespace.additional_config or {}), config_key: entry}
            added = getattr(namespace, "middleware", None)  # only `vllm serve` has it
            if http_middleware and isinstance(added, list) and http_middleware not in added:
                namespace.middleware = [*added, http_middleware]
            return namespace, rest

        parser.parse_known_args = parse_known_args
        return parser

    def from_cli_args(cls, args):
        engine_args = original_from(cls, args)
        entry = policy_entry(args)
        if entry is not None:
            engine_args.additional_config = {**(engine_args.additional_config or {}), config_key: entry}
        return engine_args

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)


def install_engine_config(before: Callable[[Any], Any], after: Callable[[Any, Any], None]) -> None:
    """`before(engine_args)` runs before vLLM builds its config and returns a context for
    `after(vllm_config, context)` (None: leave the engine alone)."""
    from vllm.engine.arg_utils import EngineArgs

    original_create = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        context = before(self)
        vllm_config = original_create(self, *args, **kwargs)
        if context is not None:
            after(vllm_config, context)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


def install_kv_spec(spec_cls: type, manager_cls: type, uniform_base: type | None = None) -> None:
    """Register a spec with its manager; `uniform_base`: the class its layers count as uniform
    with (vLLM's full attention unless given: a layer spec that merges only with itself)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Registering first would leave vLLM's built-in specs unregistered (VLLM_NOTES A8).
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=uniform_base or FullAttentionSpec)


def install_memory_hint(hint: Callable[[Any], str | None]) -> None:
    """vLLM's start-up check that one request at max_model_len fits the pool gets the
    policy's remedy appended (`hint(vllm_config)`, evaluated in the engine core)."""
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils._check_enough_kv_cache_memory
    if getattr(original, "kvprune_wrapped", False):
        return

    def check(available_memory, get_needed_memory, max_model_len, estimate_max_model_len):
        try:
            original(available_memory, get_needed_memory, max_model_len, estimate_max_model_len)
        except ValueError as exc:
            # vLLM binds the config into the callback (a functools.partial); without it, its
            # own message stands.
            vllm_config = next((arg for arg in getattr(get_needed_memory, "args", ())
                                if hasattr(arg, "additional_config")), None)
            extra = hint(vllm_config) if vllm_config is not None else None
            if not extra:
                raise
            raise ValueError(f"{extra} ({exc})") from None

    check.kvprune_wrapped = True
    kv_cache_utils._check_enough_kv_cache_memory = check


def install_prompt_check(check: Callable[[Any, int], None]) -> None:
    """Every decoder prompt's length also goes through `check(vllm_config, num_tokens)` in
    the front end, with the config of the engine it is for; a `KVConfigError` it raises
    becomes vLLM's validation error (HTTP 400 for that request)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_prompt_len
    if getattr(original, "kvprune_wrapped", False):
        return

    def validate_prompt_len(self, prompt_len, prompt_type, *args, **kwargs):
        original(self, prompt_len, prompt_type, *args, **kwargs)
        if prompt_type == "decoder":
            from vllm_kvprune.config import KVConfigError

            try:
                check(self.vllm_config, prompt_len)
            except KVConfigError as exc:
                raise VLLMValidationError(str(exc), parameter=exc.setting) from None

    validate_prompt_len.kvprune_wrapped = True
    InputProcessor._validate_prompt_len = validate_prompt_len


# Tests only: the GPU backend (TRITON_ATTN, FLASH_ATTN) whose wrapper a CPU engine registers in
# place of the CPU one, and what readies vLLM's CPU build for it first. None (always, in a user's
# engine): the CPU wrapper. Set by `run_gpu_wrapper_on_cpu`.
_gpu_wrapper_on_cpu: tuple[str, Callable[[], None]] | None = None


def run_gpu_wrapper_on_cpu(backend: str, prepare: Callable[[], None]) -> None:
    """Tests only: the CPU engines this process builds from now on run `backend`'s GPU wrapper in
    place of the CPU one, so the GPU path is tested on a machine without a GPU. Call it before
    the plugin registers (at the process's first engine); `prepare` runs then, just before the
    wrapper is registered, and makes vLLM's CPU build able to run that backend's classes on CPU
    tensors (tests/support/gpu_on_cpu.py: vLLM's Triton kernels in Triton's interpreter,
    FlashAttention's ops by torch references)."""
    global _gpu_wrapper_on_cpu
    if backend not in ("TRITON_ATTN", "FLASH_ATTN"):
        raise ValueError(f"no GPU wrapper for backend {backend!r} (TRITON_ATTN or FLASH_ATTN)")
    _gpu_wrapper_on_cpu = (backend, prepare)


def gpu_wrapper_on_cpu() -> str | None:
    """The GPU backend whose wrapper a CPU engine runs (`run_gpu_wrapper_on_cpu`), else None."""
    return None if _gpu_wrapper_on_cpu is None else _gpu_wrapper_on_cpu[0]


def install_backend(cpu_class_path: str, gpu_class_paths: dict[str, str]) -> None:
    """Our wrappers in place of vLLM's backends: CPU_ATTN on a CPU; on CUDA/ROCm each GPU
    backend we wrap (`gpu_class_paths`: vLLM's backend name -> our class). In tests a CPU
    engine may run a GPU wrapper instead (`run_gpu_wrapper_on_cpu`)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        # CpuPlatform ignores --attention-backend; overriding the CPU_ATTN member is the way in.
        if _gpu_wrapper_on_cpu is not None:
            wrapped, prepare = _gpu_wrapper_on_cpu
            prepare()
            register_backend(AttentionBackendEnum.CPU_ATTN, gpu_class_paths[wrapped])
        else:
            register_backend(AttentionBackendEnum.CPU_ATTN, cpu_class_path)
    elif current_platform.is_cuda_alike():
        for name, class_path in gpu_class_paths.items():
            register_backend(AttentionBackendEnum[name], class_path)


def graphed_cache_write(vllm_config) -> str | None:
    """What would put the layers' cache write inside a captured CUDA graph (None: it runs
    eagerly, through the impl, each step). By default vLLM splits its piecewise graphs at
    `unified_kv_cache_update` as at attention; Inductor graph partition or a hand-set
    `splitting_ops` without it would capture the write, and with it the policy's host logic."""
    compilation = vllm_config.compilation_config
    if getattr(compilation.cudagraph_mode, "name", "NONE") == "NONE":
        return None
    if compilation.use_inductor_graph_partition:
        return "use_inductor_graph_partition"
    if "vllm::unified_kv_cache_update" not in (compilation.splitting_ops or []):
        return "splitting_ops without vllm::unified_kv_cache_update"
    return None


def async_scheduling(vllm_config) -> bool:
    """Whether vLLM schedules a step while the previous one runs (resolved by vLLM before
    the workers start; always off on its CPU platform)."""
    return bool(vllm_config.scheduler_config.async_scheduling)


def attention_backend_choice(vllm_config) -> Any:
    """The attention backend the user asked for (None: vLLM chooses)."""
    return vllm_config.attention_config.backend


def choose_attention(vllm_config, name: str) -> None:
    """Serve with vLLM's attention backend `name` (one our GPU wrapper wraps)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_config.attention_config.backend = AttentionBackendEnum[name]


# ---- reads -------------------------------------------------------------------------------
def _read(what: str, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except AttributeError as exc:
        raise RuntimeError(f"vllm-kvprune: vLLM changed under hook {what!r}: {exc}") from exc


def batch_rows(runner: Any, num_reqs: int, groups: list[int]) -> tuple[list[str], Any, Any, Any, list]:
    """(request ids, computed tokens, prompt tokens, block-table rows, extra args) of the first
    `num_reqs` rows of the runner's input batch. The rows are those of KV-cache group
    `groups[0]`, `[rows, width]`, when one group serves the policy's layers, else every group's
    stacked, `[groups, rows, width]` (one group per layer: `docs/PER_LAYER.md`)."""

    import numpy as np

    def read():
        batch = runner.input_batch
        req_ids = [rid for rid in batch.req_ids[:num_reqs] if rid is not None]
        extra_args = []
        for rid in req_ids:
            state = runner.requests.get(rid)
            params = state.sampling_params if state is not None else None
            extra_args.append(params.extra_args if params is not None else None)
        tables = [batch.block_table[group] for group in groups]
        if len(tables) == 1:
            rows = tables[0].block_table.np[:num_reqs]
        else:  # stacked up to the widest row's blocks, not vLLM's full width (a copy a step)
            width = max(1, max(int(table.num_blocks_per_row[:num_reqs].max(initial=0)) for table in tables))
            rows = np.stack([table.block_table.np[:num_reqs, :width] for table in tables])
        return (req_ids, batch.num_computed_tokens_cpu[:num_reqs], batch.num_prompt_tokens[:num_reqs], rows,
                extra_args)

    return _read("InputBatch", read)


def metadata_builders(runner: Any, group: int) -> list[Any]:
    """Every attention metadata builder of KV-cache group `group` of the runner."""
    return _read("AttentionGroup", lambda: [builder for attention_group in runner.attn_groups[group]
                                            for builder in attention_group.metadata_builders])


def ended_requests(scheduler_output: Any) -> tuple[str, ...]:
    """Requests whose worker state must go: finished, aborted or preempted."""
    return _read("SchedulerOutput", lambda: (*scheduler_output.finished_req_ids,
                                             *(scheduler_output.preempted_req_ids or ())))


def single_type_managers(scheduler: Any) -> list[Any]:
    return _read("KVCacheCoordinator", lambda: list(scheduler.kv_cache_manager.coordinator.single_type_managers))


def fail_at_next_step(scheduler: Any, request_id: str) -> None:
    """Finish a queued request with an error at the scheduler's next output, so that its
    client hears back. vLLM's generic path for that is this set (named for grammars)."""
    _read("Scheduler", lambda: scheduler.grammar_compile_error_reqs.add(request_id))


def without_tokens(output: Any, request_ids: set[str]) -> Any:
    """The step output with no sampled token for these requests (a shallow copy)."""
    import copy

    def read():
        tokens = output.sampled_token_ids
        if not tokens:
            return output
        dropped = {output.req_id_to_index[r] for r in request_ids if r in output.req_id_to_index}
        trimmed = copy.copy(output)
        trimmed.sampled_token_ids = [[] if index in dropped else ids for index, ids in enumerate(tokens)]
        return trimmed

    return _read("ModelRunnerOutput", read)


def name_failures(outputs: Any, failures: dict[str, str]) -> None:
    """Set each failed request's stop reason (what `LLM` outputs show) to why it failed."""
    from vllm.v1.engine import FinishReason

    def read():
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                if output.request_id in failures and output.finish_reason == FinishReason.ERROR:
                    output.stop_reason = failures[output.request_id]

    _read("EngineCoreOutput", read)


def pool_blocks(scheduler: Any) -> int:
    """Usable blocks of the scheduler's pool (block 0 is vLLM's null block)."""
    return _read("BlockPool", lambda: scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)


def reported_pool_blocks(vllm_config: Any) -> int | None:
    """Usable blocks of the pool, as the engine reported it to the front end (None before)."""
    blocks = _read("CacheConfig", lambda: vllm_config.cache_config.num_gpu_blocks)
    return blocks - 1 if blocks else None


def layer_metadata(layer_name: str) -> Any:
    """This step's attention metadata of one layer (None outside a planned forward)."""
    from vllm.forward_context import get_forward_context

    attn_metadata = _read("get_forward_context", lambda: get_forward_context().attn_metadata)
    return attn_metadata.get(layer_name) if isinstance(attn_metadata, dict) else None


def current_vllm_config() -> Any:
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def attention_layers(vllm_config: Any) -> dict[str, Any]:
    """Layer name -> vLLM attention module, for every attention layer of the model."""
    from vllm.model_executor.layers.attention import Attention

    context = _read("static_forward_context", lambda: vllm_config.compilation_config.static_forward_context)
    return {name: module for name, module in context.items() if isinstance(module, Attention)}


def group_spec(group: Any) -> Any:
    """A KV-cache group's spec as the scheduler sees it: for a group of layers of one kind but
    different widths (`UniformTypeKVCacheSpecs`, FDC's per-layer widths) its first layer's,
    which shares the group's class, block size and heads (vLLM's scheduler does the same)."""
    specs = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    return next(iter(specs.values())) if specs else group.kv_cache_spec


def layer_index(layer_name: str) -> int:
    """The decoder layer an attention layer belongs to, as vLLM numbers it from the name."""
    return resolve("vllm.model_executor.models.utils:extract_layer_index")(layer_name)


def attention_schedule(builder: Any, num_reqs: int, num_heads: int, num_kv_heads: int, seq_lens: Any,
                       query_start_loc: Any) -> Any:
    """vLLM's CPU attention schedule for a batch other than the builder's own (head-pages:
    one sequence per request and KV head), with the builder's dtype, ISA and window."""
    from vllm import _custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=builder.head_dim,
        seq_lens=seq_lens, dtype=builder.dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=builder.window_size, isa=builder.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=builder.kv_cache_dtype)


STEP_REPORT_ATTRIBUTE = "kvprune_step_report"


def is_step_output(output: Any) -> bool:
    """Whether the runner's `sample_tokens` returned a step's output: a `ModelRunnerOutput`,
    or under async scheduling the `AsyncModelRunnerOutput` that yields one later."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    return hasattr(output, "req_ids") or isinstance(output, AsyncModelRunnerOutput)


def attach_step_report(output: Any, report: dict) -> Any:
    """The step output with the worker's step report attached (`WorkerKVState.step_report`:
    kept tokens, policy time, head-page footprints); a shallow copy: vLLM may hand out a
    shared empty output. A plain attribute, so it survives pickling to the engine core. Under
    async scheduling the output is an `AsyncModelRunnerOutput`, resolved later (after the
    device's copy to the host): the report, made now, is attached to what it resolves to."""
    import copy

    from vllm.v1.outputs import AsyncModelRunnerOutput

    if isinstance(output, AsyncModelRunnerOutput):
        return _reported_async_output_cls()(output, report)
    output = copy.copy(output)
    setattr(output, STEP_REPORT_ATTRIBUTE, report)
    return output


@functools.cache
def _reported_async_output_cls() -> type:
    """An `AsyncModelRunnerOutput` (vLLM's executors check for the class) whose output
    carries the step report; made on first use, so importing this module imports no vLLM."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class ReportedAsyncOutput(AsyncModelRunnerOutput):
        def __init__(self, pending: Any, report: dict) -> None:
            self.pending, self.report = pending, report

        def get_output(self) -> Any:
            return attach_step_report(self.pending.get_output(), self.report)

    return ReportedAsyncOutput


def step_report_of(output: Any) -> dict:
    return getattr(output, STEP_REPORT_ATTRIBUTE, None) or {}


def footprints_of(output: Any) -> dict:
    return step_report_of(output).get("footprints") or {}


def attention_isa(dtype: Any, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU backend picks for a cache of this shape (it decides the layout)."""
    return resolve(f"{_CPU_ATTN}:_get_attn_isa")(dtype, block_size, head_size)


def reshape_and_cache(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: Any, isa: str) -> None:
    """vLLM's own CPU cache writer."""
    resolve("vllm._custom_ops:cpu_attn_reshape_and_cache")(key, value, key_cache, value_cache, slots, isa)


def tp_rank_and_size() -> tuple[int, int]:
    """This process's tensor-parallel rank and the group's size ((0, 1) outside an engine)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def tp_all_gather_object(local: Any) -> list[Any]:
    """Every tensor-parallel rank's `local` (picklable), in rank order, over the group's CPU
    (gloo) channel; `[local]` outside an engine or at one rank."""
    import torch.distributed

    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return [local]
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return [local]
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, local, group=group.cpu_group)
    return gathered


def tp_all_reduce(local: Any) -> Any:
    """Sum over tensor-parallel ranks (identity outside an engine)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return local
    return parallel_state.get_tp_group().all_reduce(local)
