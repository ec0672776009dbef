"""The `vllm-kvprune` command: bad flags, the help and the version, in real processes.

Every bad flag goes through the command's own entry point (`vllm_kvprune.cli.main`, what the
console script calls), all of them in one process (`BATCH_DRIVER`): a process per flag costs
vLLM's CLI import each time, a minute of the suite on a slow machine. The console script
itself runs for the first bad flag, the help and the version.
"""

import json
import subprocess
import sys

import pytest

from conftest import VENV_BIN

CLI = str(VENV_BIN / "vllm-kvprune")


def run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout)


BAD_FLAGS = [
    (["--kv-policy", "bogus"], "--kv-policy: unknown policy 'bogus'"),
    (["--kv-policy", "streaming", "--kv-budget", "0"], "--kv-budget: must be positive"),
    (["--kv-policy", "streaming", "--kv-budget", "-3"], "--kv-budget: must be positive"),
    (["--kv-policy", "streaming", "--kv-budget", "lots"], "--kv-budget: must be an integer"),
    (["--kv-policy", "streaming", "--kv-budget", "64", "--kv-sinks", "64"], "--kv-sinks: must be smaller than the budget"),
    (["--kv-policy", "streaming", "--kv-budget", "16", "--block-size", "32"], "--kv-budget: 16 tokens cannot hold one KV block"),
    (["--kv-policy", "streaming", "--kv-budget", "64", "--block-size", "48"], "--block-size: must be a multiple of 32"),
    (["--kv-policy", "streaming", "--kv-budget", "64", "--kv-positions", "absolute"], "--kv-positions: must be one of"),
    (["--kv-config", "/does/not/exist.yaml"], "--kv-config: file not found"),
    (["--kv-config", "BAD_YAML"], "sink (in BAD_YAML): unknown setting"),  # the fixture's file: `sink` for `sinks`
    (["--kv-policy", "paged_eviction", "--kv-budget", "256"], "--kv-budget: paged_eviction needs at least 384 tokens"),
    (["--kv-policy", "paged_eviction", "--kv-budget", "512", "--kv-prefill", "streaming"],
     "--kv-prefill: policy 'paged_eviction' supports only 'full'"),
    (["--kv-policy", "h2o", "--kv-budget", "256", "--kv-recent", "300"], "--kv-recent: must be at most budget - 1 - sinks"),
    (["--kv-policy", "h2o", "--kv-budget", "256", "--kv-prefill", "streaming"],
     "--kv-prefill: policy 'h2o' supports only 'full'"),
    (["--kv-policy", "fdc"], "--kv-fdc: policy 'fdc' needs a calibration file"),
    (["--kv-policy", "fdc", "--kv-fdc", "/does/not/exist.safetensors"], "--kv-fdc: file not found"),
    (["--kv-policy", "h2o", "--kv-budget", "64", "--kv-fdc", "x.safetensors"],
     "--kv-fdc: FDC does not compose with h2o"),
    (["--kv-policy", "streaming", "--kv-budget", "64", "--kv-fdc", "x.safetensors", "--kv-positions", "cache"],
     "--kv-positions: policy 'streaming' with FDC supports only 'original'"),
    (["--kv-policy", "fdc", "--kv-fdc", "/etc/hostname"], "--kv-fdc: /etc/hostname: not a safetensors file"),
    (["--kv-policy", "gvote", "--kv-gvote-p", "1.5"], "--kv-gvote-p: must be a number in (0, 1]"),
    (["--kv-policy", "gvote", "--kv-gvote-p", "most"], "--kv-gvote-p: must be a number"),
    (["--kv-policy", "gvote", "--kv-gvote-samples", "0"], "--kv-gvote-samples: must be positive"),
    (["--kv-policy", "gvote", "--kv-gvote-future", "2.5"], "--kv-gvote-future: must be an integer"),
    (["--kv-policy", "gvote", "--kv-gvote-seed", "-1"], "--kv-gvote-seed: must be >= 0"),
    (["--kv-policy", "gvote", "--kv-budget", "256"], "--kv-budget: policy 'gvote' chooses its own footprint"),
    (["--kv-policy", "gvote", "--kv-prefill", "streaming"], "--kv-prefill: policy 'gvote' supports only 'full'"),
    (["--kv-policy", "snapkv"], "--kv-budget: policy 'snapkv' needs a budget"),
    (["--kv-policy", "snapkv", "--kv-budget", "256", "--kv-snapkv-kernel", "4"], "--kv-snapkv-kernel: must be odd"),
    (["--kv-policy", "snapkv", "--kv-budget", "64", "--kv-snapkv-window", "64"],
     "--kv-snapkv-window: must be at most budget - 1 = 63"),
    # vLLM features no policy runs with: refused at the flags too, not by a traceback at start-up.
    (["--kv-policy", "streaming", "--kv-budget", "256", "--pipeline-parallel-size", "2"],
     "--pipeline-parallel-size: kv_policy 'streaming' cannot run with pipeline parallelism"),
    (["--kv-policy", "h2o", "--kv-budget", "256", "--decode-context-parallel-size", "2"],
     "--decode-context-parallel-size: kv_policy 'h2o' cannot run with context parallelism"),
    (["--kv-policy", "h2o", "--kv-budget", "256", "--kv-offloading-size", "4"],
     "--kv-offloading-size: kv_policy 'h2o' cannot run with a KV connector"),
    (["--kv-policy", "gvote", "--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
     "--kv-transfer-config: kv_policy 'gvote' cannot run with a KV connector"),
    (["--kv-policy", "paged_eviction", "--kv-budget", "512", "--speculative-config",
      '{"method": "ngram", "num_speculative_tokens": 2}'],
     "--speculative-config: kv_policy 'paged_eviction' cannot run with speculative decoding"),
    (["--kv-policy", "streaming", "--kv-budget", "256", "--runner", "pooling"],
     "--runner: kv_policy 'streaming' cannot run with a pooling model"),
]


# Runs `vllm-kvprune serve MODEL FLAGS...` for each argv of a JSON list, in this one process,
# and prints [{"code": exit code, "stderr": ...}] as JSON.
BATCH_DRIVER = """
import contextlib, io, json, sys, traceback
from vllm_kvprune.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(stderr):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stderr": stderr.getvalue()})
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_yaml(tmp_path_factory) -> str:
    """A --kv-config file with a misspelt key."""
    path = tmp_path_factory.mktemp("config") / "kv.yaml"
    path.write_text("name: streaming\nbudget: 64\nsink: 4\n")
    return str(path)


def with_yaml(text: str, bad_yaml: str) -> str:
    return text.replace("BAD_YAML", bad_yaml)


@pytest.fixture(scope="module")
def bad_flag_results(tmp_path_factory, bad_yaml) -> list[dict]:
    model = str(tmp_path_factory.mktemp("model"))
    argvs = [["serve", model, *(with_yaml(flag, bad_yaml) for flag in flags)] for flags, _ in BAD_FLAGS]
    done = subprocess.run([sys.executable, "-c", BATCH_DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


def assert_one_line_error(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-kvprune: error: ") and message in last, last
    assert "Traceback" not in stderr


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_exits_2_with_one_line(bad_flag_results, bad_yaml, case):
    assert_one_line_error(bad_flag_results[case]["code"], bad_flag_results[case]["stderr"],
                          with_yaml(BAD_FLAGS[case][1], bad_yaml))


def test_bad_flag_through_the_console_script(tmp_path):
    flags, message = BAD_FLAGS[0]
    result = run("serve", str(tmp_path), *flags)
    assert_one_line_error(result.returncode, result.stderr, message)


def test_serve_help_shows_the_kv_flags():
    result = run("serve", "--help=all")
    assert result.returncode == 0, result.stderr[-2000:]
    from vllm_kvprune.config import SETTINGS
    from vllm_kvprune.plugin import flag_help

    # Every registered setting's flag, with its help (the registry is the one list of them).
    for flag in ["--kv-policy", "--kv-config", *(setting.flag for setting in SETTINGS.values())]:
        assert flag in result.stdout
    words = " ".join(result.stdout.split())
    for setting in SETTINGS.values():
        assert " ".join(flag_help(setting).replace("%%", "%").split()) in words, setting.name
    assert "KV policy (vllm-kvprune)" in result.stdout


def test_version():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.startswith("vllm-kvprune ")
    assert "vllm" in result.stdout.split("(", 1)[1]


def test_bad_fdc_projections_variable_exits_2(tmp_path, monkeypatch):
    # The variable is checked with the flags, before vLLM starts anything.
    monkeypatch.setenv("KVPRUNE_FDC_PROJECTIONS", "cublas")
    result = run("serve", str(tmp_path), "--kv-policy", "streaming", "--kv-budget", "256")
    assert_one_line_error(result.returncode, result.stderr,
                          "KVPRUNE_FDC_PROJECTIONS: 'cublas' is not one of torch, triton, cutlass")
