"""Where vLLM's CPU attention backend puts K[o, d] and V[o, d] inside one cache page.

vLLM's CPU paged cache for one attention layer is a tensor
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. The backend never exposes how the
``2 * block_size * head_size`` elements of one (block, head) "page" are arranged: that is a
private detail of ``cpu_attn_reshape_and_cache`` and depends on the kernel ISA it picks
(``vec``/``vec16`` store K transposed, ``amx`` packs K and V in VNNI tiles, ...). Rather than
hard-code guesses, :func:`probe_layout` asks vLLM itself: it writes 0/1 bit patterns through
``cpu_attn_reshape_and_cache`` into a scratch cache and decodes where each bit landed. Every
op in :mod:`vllm_kvprune.kernels` is driven by the resulting index maps, so it stays correct
for any layout vLLM uses; when the maps follow the tiled formula of :func:`tiling_offsets`
(``vec``, ``vec16`` and ``amx`` all do) the C++ ops take a fast path that moves tile rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# Sentinel the scratch cache is filled with before each probe; it is exact in every dtype and
# differs from the 0/1/2 values the probes write, so untouched elements stand out.
_UNWRITTEN = -1.0


@dataclass(frozen=True, eq=False)
class CacheLayout:
    """Index maps of one page of the CPU paged KV cache.

    ``key_offsets[o, d]`` / ``value_offsets[o, d]`` are element offsets, inside the page of
    ``2 * block_size * head_size`` elements that holds (block b, head h), of K and V for the
    token at block offset ``o`` and head dimension ``d``. Pages are laid out back to back in
    ``kv_cache.view(num_blocks, num_kv_heads, -1)``, so page (b, h) starts at element
    ``(b * num_kv_heads + h) * page_elems``.
    """

    dtype: torch.dtype
    block_size: int
    head_size: int
    isa: str
    key_offsets: torch.Tensor  # int64 [block_size, head_size]
    value_offsets: torch.Tensor  # int64 [block_size, head_size]
    # (key_tile, key_pack, value_tile, value_pack) of the tiled formula the maps follow, or
    # None; see tiling_offsets(). It lets the C++ ops move whole tile rows instead of
    # looking up every element.
    tiling: tuple[int, int, int, int] | None

    @property
    def page_elems(self) -> int:
        return 2 * self.block_size * self.head_size

    @property
    def is_vec_layout(self) -> bool:
        """K transposed ``[head_size, block_size]`` then V ``[block_size, head_size]``."""
        return self.tiling == (self.block_size, 1, self.head_size, 1)

    @property
    def tiling_list(self) -> list[int]:
        """The tiling as the C++ ops take it ([] = use the index maps)."""
        return list(self.tiling) if self.tiling is not None else []

    def describe(self) -> str:
        """Short human-readable summary, for logs and benchmark metadata."""
        if self.is_vec_layout:
            kind = "K transposed [D, bs], V [bs, D]"
        elif self.tiling is not None:
            kind = "tiled (key_tile, key_pack, value_tile, value_pack)=%s" % (self.tiling,)
        else:
            kind = "irregular (index maps)"
        return (
            f"{self.isa}/{str(self.dtype).removeprefix('torch.')}/bs{self.block_size}"
            f"/D{self.head_size}: {kind}"
        )


def tiling_offsets(
    block_size: int, head_size: int, tiling: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index maps of the tiled family every x86 layout of vLLM 0.32 belongs to.

    K: tiles of ``key_tile`` tokens, each ``[head_size / key_pack, key_tile, key_pack]``.
    V: strips of ``value_tile`` dims, each ``[block_size / value_pack, value_tile, value_pack]``.
    ``vec``/``vec16`` is ``(block_size, 1, head_size, 1)``; ``amx`` (bf16) is ``(16, 2, 16, 2)``.
    """
    key_tile, key_pack, value_tile, value_pack = tiling
    token = torch.arange(block_size).view(block_size, 1)
    dim = torch.arange(head_size).view(1, head_size)
    key_offsets = (
        (token // key_tile) * key_tile * head_size
        + (dim // key_pack) * key_tile * key_pack
        + (token % key_tile) * key_pack
        + dim % key_pack
    )
    value_offsets = (
        block_size * head_size
        + (dim // value_tile) * block_size * value_tile
        + (token // value_pack) * value_tile * value_pack
        + (dim % value_tile) * value_pack
        + token % value_pack
    )
    return key_offsets.contiguous(), value_offsets.contiguous()


def vec_offsets(block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index maps of the documented ``vec``/``vec16`` layout (VLLM_NOTES D2)."""
    return tiling_offsets(block_size, head_size, (block_size, 1, head_size, 1))


def vec_layout(dtype: torch.dtype, block_size: int, head_size: int, isa: str = "vec") -> CacheLayout:
    """The ``vec`` layout without asking vLLM: for tests and tools that run without vLLM."""
    key_offsets, value_offsets = vec_offsets(block_size, head_size)
    tiling = (block_size, 1, head_size, 1)
    return CacheLayout(dtype, block_size, head_size, isa, key_offsets, value_offsets, tiling)


def gpu_layout(dtype: torch.dtype, block_size: int, head_size: int) -> CacheLayout:
    """The layout of vLLM's GPU backends (``TRITON_ATTN``, ``FLASH_ATTN``) for a contiguous (HND)
    cache: token ``o`` of a page holds its K then its V, ``[2 * head_size]`` contiguous. With it
    the torch references of this package serve the Triton kernels too."""
    token = torch.arange(block_size).view(block_size, 1) * 2 * head_size
    dim = torch.arange(head_size).view(1, head_size)
    return CacheLayout(dtype, block_size, head_size, "gpu", (token + dim).contiguous(),
                       (token + head_size + dim).contiguous(), None)


def detect_tiling(key_offsets: torch.Tensor, value_offsets: torch.Tensor) -> tuple[int, int, int, int] | None:
    """The tiling parameters that reproduce both maps exactly, or None (irregular layout)."""
    block_size, head_size = key_offsets.shape
    key_part = _match_part(key_offsets, block_size, head_size, "key")
    value_part = _match_part(value_offsets, block_size, head_size, "value")
    if key_part is None or value_part is None:
        return None
    return (*key_part, *value_part)


def _match_part(offsets: torch.Tensor, block_size: int, head_size: int, part: str) -> tuple[int, int] | None:
    tiles = _divisors(block_size if part == "key" else head_size)
    packs = [p for p in (1, 2, 4) if (head_size if part == "key" else block_size) % p == 0]
    for tile in reversed(tiles):
        for pack in packs:
            tiling = (tile, pack, head_size, 1) if part == "key" else (block_size, 1, tile, pack)
            candidate = tiling_offsets(block_size, head_size, tiling)[0 if part == "key" else 1]
            if torch.equal(candidate, offsets):
                return tile, pack
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU backend picks for this cache shape on this machine."""
    from vllm_kvprune import vllm_hooks

    isa = vllm_hooks.attention_isa(dtype, block_size, head_size)
    if isa == "amx":
        # AMX tiles need the process's permission (Linux arch_prctl), which torch requests here.
        # An engine's worker has it from oneDNN's first bf16 GEMM; a process that calls vLLM's
        # kernel before any such GEMM (a bench, a test) dies of SIGILL without it.
        torch.cpu._init_amx()
    return isa


def layout_for_cache(kv_cache: torch.Tensor, isa: str | None = None) -> CacheLayout:
    """Layout of a layer cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.

    Pass the ISA the backend stored on the layer (``layer.isa``) when it is at hand: the probe
    must use the same ISA that wrote the cache.
    """
    _, _, block_size, two_head_size = kv_cache.shape
    head_size = two_head_size // 2
    if isa is None:
        isa = default_isa(kv_cache.dtype, block_size, head_size)
    return probe_layout(kv_cache.dtype, block_size, head_size, isa)


@functools.lru_cache(maxsize=None)
def probe_layout(dtype: torch.dtype, block_size: int, head_size: int, isa: str) -> CacheLayout:
    """Derive the page layout by writing bit patterns through vLLM's own cache writer.

    Token offset o and dimension d are encoded as code = o * head_size + d; probe i writes
    bit i of the code as the K and V value of every (o, d), so after ceil(log2(bs * D))
    probes each page element's code says which (o, d) it holds. One more probe writes K = 1,
    V = 2 to tell K elements from V elements. The scratch cache has two blocks and two heads
    and only block 1 is written, which also checks that a token never spills outside its own
    (block, head) page.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    num_codes = block_size * head_size
    num_bits = max(1, math.ceil(math.log2(num_codes)))
    codes = torch.arange(num_codes).view(block_size, head_size)

    role = _run_probe(dtype, block_size, head_size, isa, torch.ones_like(codes), 2 * torch.ones_like(codes))
    decoded = torch.zeros_like(role, dtype=torch.int64)
    for bit in range(num_bits):
        pattern = (codes >> bit) & 1
        page = _run_probe(dtype, block_size, head_size, isa, pattern, pattern)
        decoded += page.to(torch.int64) << bit

    key_offsets = _invert(decoded, role == 1, num_codes, "K", isa).view(block_size, head_size)
    value_offsets = _invert(decoded, role == 2, num_codes, "V", isa).view(block_size, head_size)
    tiling = detect_tiling(key_offsets, value_offsets)
    return CacheLayout(dtype, block_size, head_size, isa, key_offsets, value_offsets, tiling)


def _run_probe(
    dtype: torch.dtype,
    block_size: int,
    head_size: int,
    isa: str,
    key_values: torch.Tensor,
    value_values: torch.Tensor,
) -> torch.Tensor:
    """Write one pattern for all tokens of block 1 (both heads); return head 0's page.

    Raises if vLLM touched block 0, left part of a page unwritten, wrote something other than
    the probe values, or treated the two heads differently: any of those would mean the
    layout is not a per-(block, head) permutation and the index maps cannot describe it.
    """
    from vllm_kvprune import vllm_hooks

    num_heads = 2
    kv_cache = torch.full((2, num_heads, block_size, 2 * head_size), _UNWRITTEN, dtype=dtype)
    key_cache, value_cache = kv_cache.view(2, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
    key = key_values.to(dtype).unsqueeze(1).expand(block_size, num_heads, head_size).contiguous()
    value = value_values.to(dtype).unsqueeze(1).expand(block_size, num_heads, head_size).contiguous()
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)
    vllm_hooks.reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    pages = kv_cache.view(2, num_heads, -1).float()
    where = f"isa={isa} dtype={dtype} block_size={block_size} head_size={head_size}"
    if not bool((pages[0] == _UNWRITTEN).all()):
        raise RuntimeError(f"layout probe ({where}): writing block 1 changed block 0")
    if bool((pages[1] == _UNWRITTEN).any()):
        raise RuntimeError(f"layout probe ({where}): part of a page is never written (padding?)")
    if not torch.equal(pages[1, 0], pages[1, 1]):
        raise RuntimeError(f"layout probe ({where}): heads are not stored in separate pages")
    allowed = torch.tensor([0.0, 1.0, 2.0])
    if not bool(torch.isin(pages[1, 0], allowed).all()):
        raise RuntimeError(f"layout probe ({where}): the cache writer transformed the values")
    return pages[1, 0]


def _invert(decoded: torch.Tensor, is_role: torch.Tensor, num_codes: int, name: str, isa: str) -> torch.Tensor:
    """Turn 'page element -> code' into 'code -> page element', insisting on a bijection."""
    positions = torch.nonzero(is_role).flatten()
    role_codes = decoded[positions]
    if positions.numel() != num_codes or not torch.equal(
        torch.sort(role_codes).values, torch.arange(num_codes)
    ):
        raise RuntimeError(
            f"layout probe (isa={isa}): {name} elements of a page are not a permutation of "
            f"(token, dim); this layout is not supported"
        )
    offsets = torch.empty(num_codes, dtype=torch.int64)
    offsets[role_codes] = positions
    return offsets
