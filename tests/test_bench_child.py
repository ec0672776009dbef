"""The child-process protocol of the benchmarks that run each engine in a process of its own
(`bench ttft`, `bench worker-memory`): the parent gets the child's last result line, and a
child that fails or prints no result is an error naming it."""

from __future__ import annotations

import os
import sys

import pytest

from benchmarks import common

PRINT = "from benchmarks import common; print('noise'); common.print_child_result({r}); {tail}"


def child(result: str, tail: str = "") -> list[str]:
    return [sys.executable, "-c", PRINT.format(r=result, tail=tail)]


def test_the_last_result_line_is_returned() -> None:
    command = [sys.executable, "-c", PRINT.format(r="1", tail="common.print_child_result([{'a': 2}])")]
    assert common.run_child(command, dict(os.environ), "child") == [{"a": 2}]


def test_a_failed_or_silent_child_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"the x run failed \(exit 3\)"):
        common.run_child(child("1", "raise SystemExit(3)"), dict(os.environ), "the x run")
    with pytest.raises(RuntimeError, match=r"silent failed \(exit 0\)"):
        common.run_child([sys.executable, "-c", "print('no result')"], dict(os.environ), "silent")
