"""The environment variables vllm-kvprune reads, each named `KVPRUNE_<NAME>`.

vLLM warns at start-up about every `VLLM_*` variable it does not know, so ours do not carry its
prefix. The names of the last release (`VLLM_KVPRUNE_<NAME>`) are still read, for one release,
with one warning per process naming the new name.
"""

from __future__ import annotations

import logging
import os

PREFIX = "KVPRUNE_"
OLD_PREFIX = "VLLM_KVPRUNE_"  # read until the next release

logger = logging.getLogger("vllm_kvprune")
_warned: set[str] = set()


def name(short: str) -> str:
    """The variable's full name (`name("CHECK")` is `KVPRUNE_CHECK`)."""
    return PREFIX + short


def get(short: str, default: str | None = None) -> str | None:
    """`KVPRUNE_<short>`, else its old name `VLLM_KVPRUNE_<short>` (warned about once), else `default`."""
    value = os.environ.get(PREFIX + short)
    if value is not None:
        return value
    value = os.environ.get(OLD_PREFIX + short)
    if value is None:
        return default
    if short not in _warned:
        _warned.add(short)
        logger.warning("kvprune: %s%s is now %s%s; the old name is read until the next release", OLD_PREFIX, short,
                       PREFIX, short)
    return value
