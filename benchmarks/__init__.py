"""Benchmarks: `python -m vllm_kvprune.bench <subcommand> --help`.

Each subcommand is a module here with `add_parser(subparsers)` and `run(args)`; results go to
JSON (with the machine's facts) and a PNG plot.
"""
