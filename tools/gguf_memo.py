"""Each GGUF parsed once per asset build.

transformers reads a GGUF's metadata in full for each of the tokenizer, the config and the
weights of one conversion, and rebuilds gguf's tensor-name map for every module it maps (about 400
times for SmolLM2). Both are pure functions of their arguments: a GGUF file is never written
during a build. Parsing Gemma-3-270M's metadata (262,144 tokens with their scores and types) takes
about 20 s on a 2-core machine, three times over; inside `gguf_parsed_once()` each file is parsed
once and each map built once. `python -m tools.assets` from an empty cache, on a 2-core AVX2
machine: 121 s before, 62 s with it (Gemma 85 -> 46 s, SmolLM2 35 -> 16 s), every file built
byte for byte the same. Nothing is cached beyond the outermost block.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` returns one reader per (path, mode) and
    ``gguf.get_tensor_name_map(arch, n_blocks)`` one map per argument pair. transformers imports
    both from the ``gguf`` module at call time, so replacing the module's names reaches it. A
    nested block (SmolLM2's model builds its tokenizer first) finds them replaced already and
    shares the outer block's memo; the outer block restores them."""
    try:
        import gguf
    except ImportError:  # nothing to memoize; the build reports the missing module itself
        yield
        return
    if getattr(gguf.GGUFReader, "parsed_once", False):
        yield
        return
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike | str, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    reader.parsed_once = True  # type: ignore[attr-defined]
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
        readers.clear()
