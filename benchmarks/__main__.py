"""Entry point of `python -m benchmarks`."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# Subcommand modules of this package, in --help order. Registering one is one line here.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "kv_update",
    "attention_mass",
    "throughput",
    "ttft",
    "tpot",
    "lazy_pruning",
    "worker_memory",
    "gvote",
    "fdc_attention",
    "fdc_accuracy",
    "metrics_overhead",
    "load",
    "ray_batch",
    "gpu_kernels",
    "gpu_steps",
    "plan_steps",
    "layer_groups",
    "accuracy",
    "results_page",
)


def register(subparsers: argparse._SubParsersAction, module_name: str) -> None:
    """Let the module add its subparser; modules that only describe their flags
    (`add_arguments(parser)`) get a subparser named after them."""
    module = importlib.import_module(f"benchmarks.{module_name}")
    if hasattr(module, "add_parser"):
        module.add_parser(subparsers)
        return
    summary = (module.__doc__ or module_name).strip().splitlines()[0]
    parser = subparsers.add_parser(module_name.replace("_", "-"), help=summary, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for module_name in SUBCOMMAND_MODULES:
        register(subparsers, module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
