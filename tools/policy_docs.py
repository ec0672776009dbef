"""The docs' tables that the policy registry defines, rendered from it.

    python -m tools.policy_docs            # print the tables
    python -m tools.policy_docs --write    # put them into README.md and docs/MODELS.md

Each table sits between `<!-- registry:NAME -->` and `<!-- /registry:NAME -->` in its file;
`tests/test_policy_registry.py` checks the files hold what this renders, so the docs cannot
drift from the settings and traits the policies declare (`vllm_kvprune/policies/`).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from vllm_kvprune.config import ALL_POLICIES, SETTINGS
from vllm_kvprune.policies import LAYOUTS, REGISTRY, readers
from vllm_kvprune.policies.fdc import FORMAT_REFUSALS
from vllm_kvprune.worker.features import FEATURES

ROOT = Path(__file__).resolve().parents[1]


def _code(text: str) -> str:
    return f"`{text}`"


def configuration_table() -> str:
    """Every setting: its key, flag, per-request key, default, readers and meaning."""
    rows = ["| key (YAML / `additional_config`) | flag | per request | default | read by | meaning |",
            "|---|---|---|---|---|---|",
            f"| `name` | `--kv-policy` | | `none` | | {', '.join(_code(name) for name in ALL_POLICIES)} |"]
    for name, setting in SETTINGS.items():
        default = setting.shown_default or ("" if setting.default is None else _code(str(setting.default)))
        notes = [REGISTRY[policy].notes[name] for policy in readers(name) if name in REGISTRY[policy].notes]
        meaning = " ".join([setting.help, *(note + "." for note in notes)])
        rows.append(f"| `{name}` | `{setting.flag}` | {_code(setting.request_key) if setting.per_request else ''} "
                    f"| {default} | {', '.join(_code(policy) for policy in readers(name))} | {meaning} |")
    rows.append("| | `--kv-config FILE.yaml` | | | | settings from a file (`configs/*.yaml` are presets) |")
    return "\n".join(rows)


def policies_table() -> str:
    """Every policy and what it keeps (its `summary`)."""
    rows = ["| policy | keeps |", "|---|---|"]
    rows += [f"| `{name}` | {policy.summary} |" for name, policy in REGISTRY.items()]
    return "\n".join(rows)


def traits_table() -> str:
    """Every policy's traits: layout, budget, FDC, GPU, eager, the model features it refuses."""
    rows = ["| policy | layout | budget | with FDC's narrow heads | GPU | eager only | refuses (on the layers it prunes) |",
            "|---|---|---|---|---|---|---|"]
    for name, policy in REGISTRY.items():
        if name == "none":
            continue
        if name == "fdc":
            fdc = "is FDC"
        else:
            fdc = "composes" if policy.composes_with_fdc else f"refused: {policy.fdc_refusal}"
        refuses = "; ".join(f"{FEATURES[feature]}: {why}" for feature, why in policy.model_refusals.items()) or "-"
        rows.append(f"| `{name}` | `{policy.layout}`: {LAYOUTS[policy.layout]} | {'yes' if policy.budgeted else 'no'} "
                    f"| {fdc} | {'yes' if policy.gpu else 'no'} | {policy.eager or 'no'} | {refuses} |")
    format_refusals = "; ".join(f"{FEATURES[feature]}: {why}" for feature, why in FORMAT_REFUSALS.items())
    rows.append(f"| any policy with `--kv-fdc` | | | | | | the layers it prunes (FDC narrows): {format_refusals} |")
    return "\n".join(rows)


TABLES = {"policies-table": (ROOT / "README.md", policies_table),
          "config-table": (ROOT / "README.md", configuration_table),
          "traits-table": (ROOT / "docs" / "MODELS.md", traits_table)}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- registry:{name} -->\n)(.*?)(\n<!-- /registry:{name} -->)", re.S)


def written(name: str) -> str | None:
    """What the docs hold for table `name` now (None: its markers are missing)."""
    path, _ = TABLES[name]
    found = _pattern(name).search(path.read_text())
    return found.group(2) if found else None


def write() -> None:
    for name, (path, render) in TABLES.items():
        text = path.read_text()
        if not _pattern(name).search(text):
            raise SystemExit(f"{path}: no <!-- registry:{name} --> markers")
        path.write_text(_pattern(name).sub(lambda m: m.group(1) + render() + m.group(3), text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.policy_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md and docs/MODELS.md in place")
    args = parser.parse_args(argv)
    if args.write:
        write()
    else:
        for name, (_, render) in TABLES.items():
            print(f"{name}:\n{render()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
