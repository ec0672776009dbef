"""Everything `vllm_kvprune:register` installs into vLLM, in every vLLM process.

Front end: the `--kv-*` flags (their own help group), their validation (exit code 2 with
a one-line message), and the engine settings a policy needs (wrapping
`EngineArgs.create_engine_config`). Engine core: the capped KV spec and manager in
vLLM's `KVCacheSpecRegistry`. Worker: our wrapper over the CPU attention backend.
All of it stays a no-op unless a policy other than `none` is configured.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from vllm_kvprune import admission, http_settings, unsupported, vllm_hooks

from vllm_kvprune.config import (
    ADDITIONAL_CONFIG_KEY,
    ALL_POLICIES,
    CLI,
    DICT,
    SETTINGS,
    CLIFlags,
    KVConfigError,
    KVPolicyConfig,
    from_additional_config,
)
from vllm_kvprune.frontend import FRONT_END, count_rejection
from vllm_kvprune.policies import REGISTRY, readers

logger = logging.getLogger("vllm_kvprune")

SCHEDULER_CLS = "vllm_kvprune.engine.scheduler.KVPruneScheduler"
ASYNC_SCHEDULER_CLS = "vllm_kvprune.engine.scheduler.KVPruneAsyncScheduler"
WORKER_CLS = "vllm_kvprune.worker.cpu_worker.KVPruneCPUWorker"
BACKEND_CLS = "vllm_kvprune.worker.backend.KVPruneCPUBackend"
GPU_WORKER_CLS = "vllm_kvprune.worker.gpu_worker.KVPruneGPUWorker"
# vLLM's GPU attention backends our wrapper wraps (the first is the default) -> our class.
GPU_BACKENDS = {
    "TRITON_ATTN": "vllm_kvprune.worker.triton_backend.KVPruneTritonBackend",
    "FLASH_ATTN": "vllm_kvprune.worker.flash_backend.KVPruneFlashBackend",
}
REQUEST_VALIDATOR = "vllm_kvprune.plugin:RequestValidator"
CPU_DEFAULT_BLOCK_SIZE = 128

_installed = False
_install_error: BaseException | None = None


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, cheap, never raises.

    On a vLLM this release does not support (pyproject.toml declares which), nothing is
    installed: `none` is then stock vLLM, and any other policy refuses to start, saying why.
    """
    global _installed, _install_error
    if _installed:
        return
    _installed = True
    _log_like_vllm()
    try:
        problem = vllm_hooks.version_problem()
        if problem is not None:
            _install_error = RuntimeError(problem)
            logger.error("vllm-kvprune: %s; KV policies other than 'none' will refuse to start", problem)
            return
        vllm_hooks.install_cli(_add_kv_flags, _exit_on_bad_flags, _policy_entry, ADDITIONAL_CONFIG_KEY,
                               http_middleware=http_settings.PATH)
        vllm_hooks.install_engine_config(_prepare_engine_args, _adjust_vllm_config)
        _install_kv_spec()
        vllm_hooks.install_memory_hint(_memory_hint)
        vllm_hooks.install_prompt_check(check_prompt)
        vllm_hooks.install_backend(BACKEND_CLS, GPU_BACKENDS)
        _install_metrics()
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not take vLLM down
        _install_error = exc
        logger.exception(
            "vllm-kvprune failed to install into vLLM; every KV policy other than 'none' "
            "will refuse to start until this is fixed"
        )


def _install_metrics() -> None:
    """The snapshot folder the engine processes started from here will write to, and the
    collector that shows their numbers on /metrics (`vllm_kvprune.metrics`)."""
    from vllm_kvprune import metrics
    from vllm_kvprune.metrics.exporter import register_collector

    metrics.metrics_dir(create=True)
    register_collector()


class _ToVllmLogger(logging.Handler):
    """Hands our records to vLLM's logger, whose handlers (configured lazily, by vLLM) print
    them in its format and at its level."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_like_vllm() -> None:
    if not any(isinstance(handler, _ToVllmLogger) for handler in logger.handlers):
        logger.addHandler(_ToVllmLogger())
        logger.setLevel(logging.INFO)
        logger.propagate = False


def require_installed(where: str) -> None:
    """Refuse to run a policy on a half-installed plugin or on a vLLM whose internals moved
    (never fall back to `none`)."""
    if _install_error is not None:
        raise RuntimeError(f"vllm-kvprune is not installed correctly ({where}): {_install_error}")
    vllm_hooks.require_compatible_vllm(where)


# ---- front end: flags (derived from the registry's settings) ------------------------------
FLAG_GROUP = "KV policy (vllm-kvprune)"


def _add_kv_flags(parser):
    """`--kv-policy`, `--kv-config` and one flag per registered setting: the ones several
    policies read in the main group, a policy's own in a group of its own."""
    main = parser.add_argument_group(FLAG_GROUP, "Prune or compress the paged KV cache. See the README.")
    main.add_argument("--kv-policy", type=str, default=None, metavar="{" + ",".join(ALL_POLICIES) + "}",
                      help="KV-cache policy (default: none, vLLM unchanged).")
    groups = {}
    for setting in SETTINGS.values():
        owners = readers(setting.name)
        group = main
        if len(owners) == 1:
            owner = owners[0]
            if owner not in groups:
                groups[owner] = parser.add_argument_group(f"{FLAG_GROUP}: {owner}", f"Settings of --kv-policy {owner}.")
            group = groups[owner]
        group.add_argument(setting.flag, type=str, default=None, metavar=setting.flag_metavar(),
                           help=flag_help(setting))
    main.add_argument("--kv-config", type=str, default=None, metavar="FILE.yaml",
                      help="YAML file of KV policy settings; --kv-* flags override it.")
    return parser


def flag_help(setting) -> str:
    """A flag's help: what it is, its default, which policies read it and what it means to each."""
    default = setting.shown_default or (f"{setting.default}" if setting.default is not None else None)
    parts = [setting.help]
    if default is not None:
        parts.append(f"Default: {default.strip('`')}.")
    parts.append(f"Read by: {', '.join(readers(setting.name))}.")
    parts += [REGISTRY[name].notes[setting.name].replace("`", "") + "." for name in readers(setting.name)
              if setting.name in REGISTRY[name].notes]
    return " ".join(parts).replace("%", "%%")


def flags_from_namespace(args) -> CLIFlags:
    """The `--kv-*` values of a parsed namespace, each parsed as its setting's type."""
    values = {}
    for name, setting in SETTINGS.items():
        raw = getattr(args, f"kv_{name}", None)
        values[name] = setting.parse_flag(raw) if raw is not None else None
    return CLIFlags(policy=getattr(args, "kv_policy", None), config=getattr(args, "kv_config", None), values=values)


def policy_from_args(args) -> KVPolicyConfig | None:
    """Validate the flags of a parsed `vllm serve` command line (None: no policy given)."""
    base = from_additional_config(getattr(args, "additional_config", None) or {})
    policy = flags_from_namespace(args).merged_with(base if base.active else None)
    if policy is None:
        return None
    policy.check_engine(getattr(args, "block_size", None) or CPU_DEFAULT_BLOCK_SIZE, CLI,
                        getattr(args, "tensor_parallel_size", None) or 1)
    check_fdc_file(policy, getattr(args, "model", None), CLI)
    check_fdc_projections(policy)
    unsupported.check(policy.name, args)
    return policy


def check_fdc_file(policy: KVPolicyConfig, model: str | None, surface=DICT) -> None:
    """An FDC calibration must exist, load, and be the model's own (checked where the model is
    a local folder; the worker checks again against the weights it loads)."""
    if policy.fdc is None:
        return
    if not Path(policy.fdc).is_file():
        raise KVConfigError(surface.name("fdc"), f"file not found: {policy.fdc}")
    from vllm_kvprune.fdc import calibration

    try:
        calibration.load(policy.fdc, model if model is not None and Path(model).is_dir() else None)
    except calibration.FdcFileError as error:
        raise KVConfigError(surface.name("fdc"), str(error)) from None


def check_fdc_projections(policy: KVPolicyConfig) -> None:
    """KVPRUNE_FDC_PROJECTIONS before the engine starts, as the flags are: a value that names
    no runner always; a runner this platform cannot run where the policy uses FDC (the worker
    checks again on the cache's device, and loads CUTLASS's op)."""
    from vllm.platforms import current_platform

    from vllm_kvprune.worker import fdc_projections

    platform = None
    if policy.fdc is not None:
        platform = "cpu" if current_platform.is_cpu() else "rocm" if current_platform.is_rocm() else "cuda"
    problem = fdc_projections.refusal(fdc_projections.requested_kind(), platform)
    if problem is not None:
        raise KVConfigError(fdc_projections.ENV_VARIABLE, problem)


def _exit_on_bad_flags(namespace) -> None:
    """Bad --kv-* flags exit 2 with one line, before start-up."""
    if not hasattr(namespace, "kv_policy"):
        return
    try:
        policy_from_args(namespace)
    except KVConfigError as exc:
        print(f"vllm-kvprune: error: {exc}", file=sys.stderr)
        sys.exit(2)


def _policy_entry(args) -> dict | None:
    """What the flags put under `additional_config["kv_policy"]` (None: no flags given)."""
    policy = policy_from_args(args) if hasattr(args, "kv_policy") else None
    return policy.to_dict() if policy is not None else None


# ---- front end: engine settings --------------------------------------------------------
def _prepare_engine_args(engine_args) -> KVPolicyConfig | None:
    """Before vLLM builds its config: the settings a policy needs (None: no policy)."""
    policy = from_additional_config(engine_args.additional_config)
    if not policy.active:
        return None
    require_installed("front end")
    try:
        unsupported.check(policy.name, engine_args)
    except KVConfigError as exc:
        raise ValueError(exc.problem) from None
    if policy.policy.eager and not engine_args.enforce_eager:
        logger.info("kvprune: %s runs the model eagerly (--enforce-eager): %s", policy.name, policy.policy.eager)
        engine_args.enforce_eager = True
    if engine_args.enable_prefix_caching is not False:
        logger.info("kvprune: prefix caching turned off (pruned blocks must never be shared)")
        engine_args.enable_prefix_caching = False
    return policy


def _adjust_vllm_config(vllm_config, policy: KVPolicyConfig) -> None:
    from vllm.platforms import current_platform

    unsupported.check_model(policy.name, vllm_config.model_config)
    if current_platform.is_cpu():
        worker_cls, stock_worker = WORKER_CLS, "vllm.v1.worker.cpu_worker.CPUWorker"
        if vllm_hooks.gpu_wrapper_on_cpu() is not None:  # tests: a GPU wrapper on the CPU
            _check_gpu_policy(policy)
    elif current_platform.is_cuda_alike():
        worker_cls, stock_worker = GPU_WORKER_CLS, "vllm.v1.worker.gpu_worker.Worker"
        _check_gpu_policy(policy)
        _use_gpu_attention(vllm_config)
        _check_graphs(policy, vllm_config)
    else:
        raise ValueError(f"kv_policy {policy.name!r} is not available on {current_platform.device_name} "
                         "(CPU, CUDA and ROCm only)")
    block_size = vllm_config.cache_config.block_size
    policy.check_engine(block_size, tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size)
    tail, step_tokens = policy.policy.prompt_tail(policy), vllm_config.scheduler_config.max_num_batched_tokens
    if tail > step_tokens:
        raise ValueError(f"kv_policy {policy.name!r} computes the last {tail} tokens of a prompt in one step, more than "
                         f"--max-num-batched-tokens {step_tokens}; raise it or lower the policy's setting")
    check_fdc_file(policy, vllm_config.model_config.model)
    check_fdc_projections(policy)
    parallel = vllm_config.parallel_config
    if parallel.worker_cls not in ("auto", stock_worker, worker_cls):
        raise ValueError(f"kv_policy needs its own worker; --worker-cls {parallel.worker_cls} is not supported")
    parallel.worker_cls = worker_cls
    vllm_config.scheduler_config.scheduler_cls = scheduler_cls(vllm_config.scheduler_config.async_scheduling)
    model_config = vllm_config.model_config
    model_config.logits_processors = [*(model_config.logits_processors or []), REQUEST_VALIDATOR]
    vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = policy.to_dict()
    FRONT_END.serve(policy, block_size, vllm_config)


def scheduler_cls(async_scheduling: bool | None) -> str:
    """Our scheduler over the one vLLM would run: vLLM has resolved `async_scheduling` by the
    time the engine config is adjusted (on unless something rules it out; off on a CPU)."""
    return ASYNC_SCHEDULER_CLS if async_scheduling else SCHEDULER_CLS


def _check_gpu_policy(policy: KVPolicyConfig) -> None:
    """On a GPU only the policies the GPU wrappers carry out start (their `gpu` trait)."""
    if not policy.policy.gpu:
        gpu_policies = [name for name, each in REGISTRY.items() if each.gpu and name != "none"]
        raise ValueError(f"kv_policy {policy.name!r} does not run on a GPU yet (GPU: {', '.join(gpu_policies)}: "
                         "docs/GPU.md)")


def _check_graphs(policy: KVPolicyConfig, vllm_config) -> None:
    """The impl carries out each step's plan in Python around the kernels: the cache write
    must run eagerly, never replayed from a captured CUDA graph (attention always is: its
    builder reports no full-graph support)."""
    problem = vllm_hooks.graphed_cache_write(vllm_config)
    if problem is not None:
        raise ValueError(f"kv_policy {policy.name!r} writes K/V through its own impl each step; CUDA graphs "
                         f"with {problem} would capture that write (--compilation-config), or run with "
                         "--enforce-eager")


def _use_gpu_attention(vllm_config) -> None:
    """The GPU wrapper wraps TRITON_ATTN (chosen unless the user asked for another backend)
    and FLASH_ATTN (when asked for: `--attention-backend FLASH_ATTN`)."""
    asked = vllm_hooks.attention_backend_choice(vllm_config)
    name = getattr(asked, "name", asked) if asked is not None else next(iter(GPU_BACKENDS))
    if name not in GPU_BACKENDS:
        raise ValueError(f"kv_policy runs on the {' or '.join(GPU_BACKENDS)} attention backends on a GPU; "
                         f"--attention-backend {name} is not supported")
    vllm_hooks.choose_attention(vllm_config, name)


def _memory_hint(vllm_config) -> str | None:
    """The policy's remedy, added to vLLM's start-up error when one request does not fit."""
    policy = from_additional_config(vllm_config.additional_config)
    return admission.memory_hint(policy, vllm_config.cache_config.block_size, vllm_config.model_config.max_model_len)


def check_prompt(vllm_config, num_prompt_tokens: int) -> None:
    """Front end, every prompt of the engine `vllm_config` configures: under `prefill: full`
    it must fit the pool (HTTP 400)."""
    policy = from_additional_config(getattr(vllm_config, "additional_config", None))
    usable = vllm_hooks.reported_pool_blocks(vllm_config)
    if not policy.active or usable is None:
        return
    try:
        admission.check_prompt_fits(policy, num_prompt_tokens, vllm_config.cache_config.block_size, usable)
    except KVConfigError as exc:
        count_rejection(vllm_config, exc.setting)
        raise


# ---- per request: HTTP 400 for a bad override --------------------------------------------
def _request_validator_cls():
    from vllm.exceptions import VLLMValidationError

    from vllm_kvprune.vllm_hooks import LogitsProcessor

    class RequestValidator(LogitsProcessor):
        """Checks a request's `kv_*` overrides in the front end; changes no logits.

        vLLM calls `validate_params` of every configured logits processor before a
        request is admitted and answers HTTP 400 to the VLLMValidationError it raises,
        while the server goes on serving everybody else.
        """

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            try:
                FRONT_END.check_request(sampling_params.extra_args)
            except KVConfigError as exc:
                raise VLLMValidationError(str(exc), parameter=exc.setting) from None

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            return None

        def apply(self, logits):
            return logits

    return RequestValidator


def __getattr__(name: str):
    # Lazy, so importing the plugin does not import vLLM's sampler.
    if name == "RequestValidator":
        cls = _request_validator_cls()
        globals()["RequestValidator"] = cls
        return cls
    raise AttributeError(name)


# ---- engine core and worker --------------------------------------------------------------
def _install_kv_spec() -> None:
    from vllm_kvprune.engine.manager import KVPruneManager
    from vllm_kvprune.engine.spec import FdcSpec, KVPruneSpec, LayerKVPruneSpec, PrunedFdcSpec

    vllm_hooks.install_kv_spec(KVPruneSpec, KVPruneManager)
    vllm_hooks.install_kv_spec(LayerKVPruneSpec, KVPruneManager, uniform_base=LayerKVPruneSpec)
    vllm_hooks.install_kv_spec(FdcSpec, vllm_hooks.FullAttentionManager)
    vllm_hooks.install_kv_spec(PrunedFdcSpec, KVPruneManager)
