"""Benchmarks: `python -m benchmarks <subcommand> --help`, from the repository root.

Each subcommand is a module here with `add_parser(subparsers)` and `run(args)`; results go to
JSON (with the machine's facts) and a PNG plot. The results page (`python -m benchmarks
results`, docs/RESULTS.md) is rendered here too. Not part of the installed package: nothing in
`vllm_kvprune` imports this folder, which imports the package and `tools` (the test assets).
"""
