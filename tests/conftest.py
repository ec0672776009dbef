"""Shared set-up: offline, in-process engines (so tests can read the scheduler and the
worker), invariant checks on, and helpers to build engines from the offline models."""

from __future__ import annotations

import gc
import os
import sys
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("KVPRUNE_CHECK", "1")  # the debug invariant mode (engine/checks.py), everywhere
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# `benchmarks` and `tools` import from the repository root (pyproject's `pythonpath` puts it on
# this process's path): the processes the tests start (`python -m benchmarks ...`, scripts) find
# them there too, wherever pytest was started from.
REPO_ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

import pytest  # noqa: E402
import yaml  # noqa: E402

# Before anything imports Triton: its interpreter must be on when `triton.language` is first
# imported (its own library functions are decorated then), and vLLM imports it (see triton_setup).
import triton_setup  # noqa: E402,F401

VENV_BIN = Path(sys.executable).parent


def pytest_addoption(parser) -> None:
    parser.addoption("--heavy", action="store_true",
                     help="also run the tests marked heavy (checks already made once in the suite, repeated on "
                          "more configurations; minutes each on a 2-core CPU)")
    parser.addoption("--all", action="store_true",
                     help="also run the tests marked tooling (the benchmark scripts, the results page, the GPU "
                          "compile checks, the accuracy tasks: our tools, not what a user's engine does)")


# The modules whose tests check our tools rather than serving (marked `tooling`, run with --all).
TOOLING_MODULES = ("test_bench_", "test_results_", "test_accuracy_", "test_triton_targets", "test_cutlass_check")


def pytest_collection_modifyitems(config, items) -> None:
    """The CI suite runs each check of serving once; `--heavy` adds its repetitions on more
    configurations, `--all` the checks of the benchmarks and tools."""
    heavy = pytest.mark.skip(reason="heavy: a repetition on another configuration; run with --heavy")
    tooling = pytest.mark.skip(reason="tooling: a check of the benchmarks or tools; run with --all")
    for item in items:
        if item.path.name.startswith(TOOLING_MODULES):
            item.add_marker(pytest.mark.tooling)
        if "heavy" in item.keywords and not config.getoption("--heavy"):
            item.add_marker(heavy)
        if "tooling" in item.keywords and not config.getoption("--all"):
            item.add_marker(tooling)
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: one thread is fastest and leaves the other core alone. A module opts in
    with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from tools import assets

    return str(assets.tiny_model_dir())


@pytest.fixture(scope="session")
def reference_model(tiny_model):
    """The tiny model loaded for the reference implementations (read only; shared)."""
    import torch

    from vllm_kvprune.reference.model import load_reference_model

    torch.set_num_threads(2)
    return load_reference_model(tiny_model)


# The conformance cases of every registered policy (tests/policy_cases.yaml: data; read by
# test_policy_conformance.py, test_tensor_parallel.py and test_default_mode.py).
POLICY_CASES = yaml.safe_load((Path(__file__).with_name("policy_cases.yaml")).read_text())


def policy_reference(model, config, block_size: int = BLOCK_SIZE):
    """The policy's own reference (`vllm_kvprune.reference.<module>.from_config`) on `model`
    (a reference model) at `config`'s settings."""
    import importlib

    return importlib.import_module(f"vllm_kvprune.reference.{config.policy.reference}").from_config(
        model, config, block_size)


def policy_settings(name: str, settings: dict, files: dict[str, str]) -> dict:
    """A case's settings as an engine takes them, `$...` placeholders resolved from `files`."""
    return {"name": name, **{key: files.get(value, value) if isinstance(value, str) else value
                             for key, value in settings.items()}}


@pytest.fixture(scope="session")
def fdc_files(tiny_model, tmp_path_factory) -> dict[str, str]:
    """The cases' FDC calibrations of the tiny model: `$calibration` (rate 0.1, heads of unequal
    ranks) and `$full_ranks` (every dimension kept)."""
    from vllm_kvprune.fdc import calibration

    folder = tmp_path_factory.mktemp("fdc")
    adaptive = calibration.calibrate(tiny_model, tokens=256, seq_len=128, seed=0, rate=0.1)
    files = {}
    for name, calibrated in (("$calibration", adaptive),
                             ("$full_ranks", adaptive.with_uniform_ranks(adaptive.head_dim, adaptive.head_dim))):
        files[name] = str(folder / f"{name[1:]}.safetensors")
        calibrated.save(files[name])
    return files


@pytest.fixture(scope="session")
def real_model() -> str:
    from tools import assets

    return str(assets.real_model_dir())


def make_llm(model: str, policy: dict | None = None, *, kv_blocks: int = 512, **kwargs):
    """An in-process engine; `kv_blocks` sizes the KV pool exactly."""
    from vllm import LLM

    options = dict(dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, max_model_len=4096,
                   max_num_seqs=32, enable_prefix_caching=False)
    options.update(kwargs)
    options["kv_cache_memory_bytes"] = kv_blocks * page_bytes(model, options)
    if policy is not None:
        options["additional_config"] = {"kv_policy": policy}
    return LLM(model=model, **options)


def page_bytes(model: str, options: dict) -> int:
    """Bytes of one KV block over all layers (what vLLM divides the pool by)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model).get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtype_bytes = 4 if options["dtype"] == "float32" else 2
    return 2 * options["block_size"] * kv_heads * head_dim * dtype_bytes * config.num_hidden_layers


_live_engines: list[str] = []


@contextmanager
def engine(model: str, policy: dict | None = None, **kwargs):
    """One in-process engine at a time: shutting an engine down tears down vLLM's global
    distributed state, which would break any other engine still open in this process."""
    if _live_engines:
        raise RuntimeError(f"an in-process engine ({_live_engines[0]}) is still open; close it first")
    try:
        llm = make_llm(model, policy, **kwargs)
    except BaseException:
        # A start-up that failed (a refused model) leaves vLLM's in-process distributed state
        # behind; the next engine would inherit it. A real engine core process just exits.
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        raise
    _live_engines.append(f"{Path(model).name}, {policy}")
    try:
        yield llm
    finally:
        _live_engines.pop()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        # What survives (torch's, vLLM's and transformers' modules: millions of objects) is
        # moved out of the collector's sight: each of the next engine's full collections (vLLM
        # runs several as it loads a model and at start-up) took about 0.4 s walking them here.
        # The engine's shutdown unfreezes everything (vLLM's `gc.unfreeze()`), so whatever
        # became garbage meanwhile is collected then.
        gc.freeze()


@contextmanager
def served(model: str, *args: str, log_dir: Path, timeout: float = 300, env: dict | None = None):
    """A real `vllm-kvprune serve MODEL ARGS...` on a free port (`env`: added to its
    environment); yields its base URL (the launcher `bench load` uses)."""
    from benchmarks.load import served as serve

    with serve(model, list(args), log_dir / "server.log", env=env, timeout=timeout) as base:
        yield base


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


# scripts/setup_kvpress.sh, started in the background once collection shows a test needs it:
# building the venv the first time is minutes of pip (downloads and unpacking), which the
# tests before the first kvpress one overlap.
_kvpress_setup: dict = {}


def _start_kvpress_setup() -> None:
    import subprocess
    import tempfile
    import time

    from benchmarks import kvpress_runner

    env = dict(os.environ)
    env.setdefault("KVPRUNE_KVPRESS_BASE_PYTHON", getattr(sys, "_base_executable", None) or "python3")
    output = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would stall pip
    _kvpress_setup.update(started=time.perf_counter(), output=output, process=subprocess.Popen(
        ["bash", str(kvpress_runner.SETUP_SCRIPT)], env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
        start_new_session=True))  # a group of its own: stopping it stops its pip too


@pytest.fixture(scope="session")
def kvpress_venv():
    """kvpress's side venv, built (or found) by scripts/setup_kvpress.sh once per session."""
    import time

    from benchmarks import kvpress_runner

    if not _kvpress_setup:
        _start_kvpress_setup()
    waited = time.perf_counter()
    returncode = _kvpress_setup["process"].wait(timeout=1800)
    output = _kvpress_setup["output"]
    output.seek(0)
    text = output.read()
    if returncode != 0:
        pytest.fail(f"scripts/setup_kvpress.sh failed (exit {returncode}):\n{text[-5000:]}")
    now = time.perf_counter()
    print(f"kvpress venv ready in {now - _kvpress_setup['started']:.1f} s ({now - waited:.1f} s waited): "
          f"{text.strip().splitlines()[-1]}")
    return kvpress_runner.kvpress_python()


def pytest_collection_finish(session) -> None:
    """Collection imported the Triton tests with TRITON_INTERPRET=1 (tests/triton_setup.py);
    take it away so engines started by other tests do not inherit it. And kvpress's venv starts
    building now if a selected test needs it."""
    setup = sys.modules.get("triton_setup")
    if setup is not None and setup.INTERPRET_SET_HERE:
        os.environ.pop("TRITON_INTERPRET", None)
    if any("kvpress_venv" in getattr(item, "fixturenames", ()) and item.get_closest_marker("skip") is None
           for item in session.items):  # a test that will run (not one --heavy or --all would add)
        _start_kvpress_setup()


def pytest_sessionfinish(session, exitstatus) -> None:
    """A run stopped before its kvpress tests (-x, Ctrl-C) leaves no pip behind (the script
    resumes where it stopped next time: the venv is stamped only once whole)."""
    import signal

    process = _kvpress_setup.get("process")
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


@pytest.fixture(autouse=True)
def _triton_interpreter(request):
    """Triton's interpreter for the `triton`-marked tests (kernel launches read the variable)."""
    setup = sys.modules.get("triton_setup")
    if request.node.get_closest_marker("triton") is None or setup is None or not setup.INTERPRET_SET_HERE:
        yield
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
