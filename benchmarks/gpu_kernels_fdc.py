"""FDC's cases of `bench gpu-kernels`: the reduced-dimension decode attention (`fdc`), its tile
sweep (`fdc-tiles`), and one layer's whole FDC decode step as the GPU wrapper runs it
(`fdc-layer`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.gpu_timing import TINY, Case, Shapes, max_abs_error
from vllm_kvprune.worker.fdc_projections import EinsumProjections


# ---- fdc ----------------------------------------------------------------------------------------
def case_fdc(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    """Batch x seq_len as every case, then few long sequences (batch / 8, 4 x seq_len), where the
    tasks alone leave multiprocessors idle and splitting the keys (flash-decoding) matters."""
    _fdc_case("fdc decode", shapes.batch, shapes.seq_len, shapes, dtype, device, rows, every_rank_set=True)
    _fdc_case("fdc decode, few long", max(1, shapes.batch // 8), 4 * shapes.seq_len, shapes, dtype, device, rows,
              every_rank_set=False)


@dataclass
class _DecodeInputs:
    """One decode step's dense queries, keys and values ``[batch, heads, length, dim]`` on the
    device, the vLLM metadata of its packed caches, and the generator that drew them (cases
    draw their ranks from it next)."""

    query: torch.Tensor
    dense_k: torch.Tensor
    dense_v: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    generator: torch.Generator

    @classmethod
    def draw(cls, batch: int, length: int, shapes: Shapes, dtype: torch.dtype, device: str, seed: int) -> "_DecodeInputs":
        generator = torch.Generator().manual_seed(seed)
        heads, dim = shapes.kv_heads, shapes.head_dim
        query = torch.randn(batch, heads * shapes.group, dim, generator=generator).to(device, dtype)
        dense_k = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
        dense_v = torch.randn(batch, heads, length, dim, generator=generator).to(device, dtype)
        return cls(query, dense_k, dense_v, torch.arange(batch + 1, dtype=torch.int32, device=device),
                   torch.full((batch,), length, dtype=torch.int32, device=device), dim ** -0.5, generator)

    def sdpa(self) -> torch.Tensor:
        """Torch's attention at full width: the baseline and the expected output."""
        return torch.nn.functional.scaled_dot_product_attention(
            self.query[:, :, None, :], self.dense_k, self.dense_v, scale=self.scale, enable_gqa=True)[:, :, 0, :]

    def packed(self, k_ranks: list[int], v_ranks: list[int], block_size: int):
        """(cache, heads on the device, block table): the keys and values cut to the ranks, in a
        packed FDC cache whose blocks are laid out request after request."""
        from vllm_kvprune.kernels.reduced_attention import PackedHeads

        batch, heads, length, _ = self.dense_k.shape
        device, dtype = self.dense_k.device, self.dense_k.dtype
        layout = PackedHeads.from_ranks(k_ranks, v_ranks)
        per_request = length // block_size
        table = torch.arange(batch * per_request, dtype=torch.int32, device=device).view(batch, per_request)
        cache = torch.empty(batch * per_request, block_size * layout.row_width, dtype=dtype, device=device)
        layout.write(cache, torch.arange(batch * length, device=device),
                     self.dense_k.permute(0, 2, 1, 3).reshape(-1, heads, self.dense_k.shape[-1]),
                     self.dense_v.permute(0, 2, 1, 3).reshape(-1, heads, self.dense_v.shape[-1]), block_size)
        on_device = PackedHeads(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in (
            layout.k_ranks, layout.v_ranks, layout.k_offsets, layout.v_offsets, layout.row_width)))
        return cache, on_device, table


def _fdc_case(name: str, batch: int, length: int, shapes: Shapes, dtype: torch.dtype, device: str, rows: list,
              every_rank_set: bool) -> None:
    from vllm_kvprune.kernels.triton import reduced_attention as triton_fdc

    inputs = _DecodeInputs.draw(batch, length, shapes, dtype, device, seed=3)
    heads, dim, bs = shapes.kv_heads, shapes.head_dim, shapes.block_size
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    chosen = triton_fdc.choose_key_splits(batch * heads, length, multiprocessors)
    case = Case(name, device, rows)
    expected = inputs.sdpa()
    case.time("torch SDPA, full width", inputs.sdpa, baseline=True, kv_kept=1.0)
    adaptive = torch.randint(max(dim // 8, 1), dim + 1, (2, heads), generator=inputs.generator)
    rank_sets = {"full width": ([dim] * heads, [dim] * heads),
                 "50% dims": ([dim // 2] * heads, [dim // 2] * heads)}
    if every_rank_set:
        rank_sets.update({"adaptive ranks": (adaptive[0].tolist(), adaptive[1].tolist()),
                          "adaptive ranks up to a multiple of 8": ((-(-adaptive[0] // 8) * 8).clamp(max=dim).tolist(),
                                                                   (-(-adaptive[1] // 8) * 8).clamp(max=dim).tolist())})
    for label, (k_ranks, v_ranks) in rank_sets.items():
        cache, device_heads, block_table = inputs.packed(k_ranks, v_ranks, bs)
        kept = (sum(k_ranks) + sum(v_ranks)) / (2 * heads * dim)
        # (launch order, key splits, keys token-major): LPT vs natural for adaptive ranks; at full
        # width and 50% every power-of-two split up to 16, the one choose_key_splits picks
        # marked; then the GPU layout (keys token-major) unsplit, split 4 and as chosen.
        variants = [(True, 1, False), (False, 1, False)] if label == "adaptive ranks" else [(True, 1, False)]
        if label in ("full width", "50% dims"):
            variants += [(True, splits, False) for splits in (2, 4, 8, 16) if length >= splits * 64]
            variants += [(True, splits, True) for splits in sorted({1, 4, chosen}) if length >= splits * 64]
        by_token = triton_fdc.keys_by_token(cache, device_heads, bs) if any(v[2] for v in variants) else None
        for balanced, splits, token_major in variants:
            call = lambda balanced=balanced, splits=splits, token_major=token_major: triton_fdc.reduced_attention(  # noqa: E731
                inputs.query, by_token if token_major else cache, block_table, inputs.query_start_loc,
                inputs.seq_lens, device_heads, inputs.scale, dim, balanced, bs, key_splits=splits,
                max_seq_len=length, keys_by_token=token_major)
            error = max_abs_error(call().to(dtype), expected) if label == "full width" else None
            schedule = "" if label != "adaptive ranks" else (", LPT order" if balanced else ", natural order")
            split_label = "" if splits == 1 else f", {splits} key splits" + (" (chosen)" if splits == chosen else "")
            layout = ", keys token-major" if token_major else ""
            case.time(f"Triton reduced, {label}{schedule}{split_label}{layout}", call, error, kv_kept=kept,
                      key_splits=splits, keys_by_token=token_major)


def case_fdc_tiles(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    """Not in the default run: a sweep of the fdc decode kernel's tiles (keys per step, warps,
    pipeline stages), key splits and cache block sizes, at 50% dims and full width, for both
    fdc shapes; each row against SDPA at full width on the same inputs."""
    import itertools

    from vllm_kvprune.kernels.triton import reduced_attention as triton_fdc

    heads, dim = shapes.kv_heads, shapes.head_dim
    tiny = shapes is TINY
    # Key splits fixed per shape (none at batch 32, 4 for the few long: the best of the fdc case).
    for batch, length, splits in ((shapes.batch, shapes.seq_len, 1), (max(1, shapes.batch // 8), 4 * shapes.seq_len, 4)):
        inputs = _DecodeInputs.draw(batch, length, shapes, dtype, device, seed=5)
        case = Case(f"fdc tiles, batch {batch} x {length} keys", device, rows)
        expected = inputs.sdpa()
        case.time("torch SDPA, full width", inputs.sdpa, baseline=True)
        for block_size, width in itertools.product((16,) if tiny else (16, 64), (dim, dim // 2)):
            cache, on_device, table = inputs.packed([width] * heads, [width] * heads, block_size)
            token_major = triton_fdc.keys_by_token(cache, on_device, block_size)
            grid = [(block_n, warps, stages, False) for block_n, warps, stages in
                    itertools.product((64, 128), (4, 8), (2, 3, 4))]
            grid += [(block_n, warps, stages, True) for block_n, warps, stages in
                     itertools.product((64, 128), (4, 8), (2, 3))]
            for block_n, warps, stages, by_token in (grid if not tiny else [(32, 4, 2, False), (32, 4, 2, True)]):
                triton_fdc._TILE_OVERRIDE.update(block_n=block_n, num_warps=warps, num_stages=stages)
                try:
                    call = lambda by_token=by_token: triton_fdc.reduced_attention(  # noqa: E731
                        inputs.query, token_major if by_token else cache, table, inputs.query_start_loc,
                        inputs.seq_lens, on_device, inputs.scale, dim, True, block_size, key_splits=splits,
                        max_seq_len=length, keys_by_token=by_token)
                    error = max_abs_error(call().to(dtype), expected) if width == dim else None
                    case.time(f"{'full width' if width == dim else '50% dims'}, block {block_size}, "
                              f"{block_n} keys/step, {warps} warps, {stages} stages, {splits} splits"
                              + (", keys token-major" if by_token else ""), call, error,
                              kv_kept=width / dim, block_n=block_n, num_warps=warps, num_stages=stages,
                              key_splits=splits, block_size=block_size, keys_by_token=by_token)
                except Exception as failure:  # noqa: BLE001  (a tile that does not compile: say so, go on)
                    print(f"  skipped {block_n}/{warps}/{stages}/{by_token}: {type(failure).__name__}: {failure}"[:300])
                finally:
                    triton_fdc._TILE_OVERRIDE.clear()


# ---- fdc-layer ----------------------------------------------------------------------------------
def case_fdc_layer(shapes: Shapes, dtype: torch.dtype, device: str, rows: list) -> None:
    """One layer's FDC decode step as the GPU wrapper runs it (`FdcLayers` with `TritonKernels`,
    keys token-major, 50% dims): each part alone, then the whole; the narrow write both ways
    (the torch reference after finding the real slots, a host read; the Triton writer, which
    skips vLLM's padding slot -1 itself). Where the step's time goes is what a faster path
    (CUTLASS for the projections' GEMMs, a fused writer) could gain."""
    import tempfile
    from pathlib import Path

    from vllm_kvprune.fdc.calibration import FdcCalibration
    from vllm_kvprune.worker.fdc_layers import FdcLayers, blocks_of
    from vllm_kvprune.worker.kernel_sets import KernelSet, TritonKernels

    inputs = _DecodeInputs.draw(shapes.batch, shapes.seq_len, shapes, dtype, device, seed=7)
    heads, dim, bs, batch = shapes.kv_heads, shapes.head_dim, shapes.block_size, shapes.batch
    generator = inputs.generator
    rotation = torch.linalg.qr(torch.randn(1, heads, dim, dim, generator=generator)).Q
    singular = torch.linspace(1, 0, dim).expand(1, heads, -1).contiguous()
    half = torch.full((1, heads), dim // 2, dtype=torch.int32)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fdc.safetensors"
        FdcCalibration(rotation, singular, rotation.clone(), singular.clone(), half, half.clone(), settings={}).save(path)
        fdc = FdcLayers(str(path), None, keys_by_token=True).to(device)
    kernels = TritonKernels()
    width = fdc.layer_widths[0]
    per_request = shapes.seq_len // bs
    cache = torch.zeros(batch * per_request, heads, bs, width // heads, dtype=dtype, device=device)
    table = torch.arange(batch * per_request, dtype=torch.int32, device=device).view(batch, per_request)
    every = torch.arange(batch * shapes.seq_len, device=device)
    context = [torch.randn(batch * shapes.seq_len, heads, dim, generator=generator).to(device, dtype) for _ in range(2)]
    fdc.write(0, *context, cache, every, bs, writer=kernels.write_narrow)
    # The step: each request's last position written anew, one padding row as vLLM's batches have.
    new_key, new_value = (torch.randn(batch + 1, heads, dim, generator=generator).to(device, dtype) for _ in range(2))
    slots = torch.cat([torch.arange(1, batch + 1, device=device) * shapes.seq_len - 1,
                       torch.tensor([-1], device=device)])
    query = inputs.query
    rows_of = blocks_of(cache)
    layer = fdc.layers[0]
    reduced_k = torch.einsum("thd,hdk->thk", new_key.float(), layer.qk_rotation)
    reduced_v = torch.einsum("thd,hdk->thk", new_value.float(), layer.v_rotation)
    query_rotation, output_rotation = EinsumProjections(fdc.layers).per_query_head(0, query.shape[1])
    reduced_q = torch.einsum("tqd,qdk->tqk", query.float(), query_rotation).to(dtype)

    def attend() -> torch.Tensor:
        return kernels.reduced_attention(reduced_q, rows_of, table, inputs.query_start_loc, inputs.seq_lens,
                                         layer.heads, inputs.scale, layer.v_rotation.shape[-1], bs)

    def step() -> torch.Tensor:
        fdc.write(0, new_key, new_value, cache, slots, bs, writer=kernels.write_narrow)
        return fdc.attend(0, query, cache, table, inputs.query_start_loc, inputs.seq_lens, inputs.scale, bs,
                          attention=kernels.reduced_attention)

    # The two writers must store the same bits: each into its own copy of the cache first.
    by_torch, by_triton = rows_of.clone(), rows_of.clone()
    KernelSet.write_narrow(kernels, layer.heads, by_torch, slots, reduced_k, reduced_v, bs)
    kernels.write_narrow(layer.heads, by_triton, slots, reduced_k, reduced_v, bs)
    writers_differ = max_abs_error(by_triton, by_torch)

    case = Case("fdc-layer at 50% dims", device, rows)
    case.time("torch SDPA, full width (attention only)", inputs.sdpa, baseline=True)
    case.time("narrow write, torch indexing (real slots read on the host)",
              lambda: KernelSet.write_narrow(kernels, layer.heads, rows_of, slots, reduced_k, reduced_v, bs))
    case.time("narrow write, Triton (slot -1 skipped on the device)",
              lambda: kernels.write_narrow(layer.heads, rows_of, slots, reduced_k, reduced_v, bs), writers_differ)
    case.time("key and value projections (2 einsums)", lambda: (
        torch.einsum("thd,hdk->thk", new_key.float(), layer.qk_rotation),
        torch.einsum("thd,hdk->thk", new_value.float(), layer.v_rotation)))
    case.time("query and output projections (2 einsums)", lambda: torch.einsum(
        "tqk,qdk->tqd", torch.einsum("tqd,qdk->tqk", query.float(), query_rotation), output_rotation))
    runners = _gpu_projections(fdc, device)
    if runners:
        einsum_out = torch.einsum("tqk,qdk->tqd", torch.einsum("tqd,qdk->tqk", query.float(), query_rotation),
                                  output_rotation)
    for name, projections in runners.items():
        keys_error = max_abs_error(projections.keys_values(0, new_key, new_value)[0][..., : reduced_k.shape[-1]],
                                   reduced_k)
        out_error = max_abs_error(_query_then_output(projections, query), einsum_out)
        case.time(f"key and value projections ({name}, {_LAUNCHES[name][0]})",
                  lambda p=projections: p.keys_values(0, new_key, new_value), keys_error)
        case.time(f"query and output projections ({name}, {_LAUNCHES[name][1]})",
                  lambda p=projections: _query_then_output(p, query), out_error)
    case.time("reduced attention (Triton)", attend)
    case.time("whole layer step (write, projections, attention)", step)
    einsum = fdc.projections
    for name, projections in runners.items():
        fdc.projections = projections
        case.time(f"whole layer step, {name} projections", step)
    fdc.projections = einsum
    _prefill_projections(fdc, shapes, dtype, device, generator, rows)


# Launches a (keys and values, queries and output) pair of projections takes.
_LAUNCHES = {"Triton": ("2 launches", "2 launches"), "CUTLASS": ("1 grouped launch", "2 grouped launches")}


def _gpu_projections(fdc, device: str) -> dict:
    """The GPU runners of FDC's projections that can run here, by name (what cannot is said once)."""
    from vllm_kvprune.kernels import grouped_gemm
    from vllm_kvprune.kernels.triton import interpreted
    from vllm_kvprune.worker.fdc_projections import GroupedProjections, TritonProjections

    on_gpu = torch.device(device).type == "cuda"
    if not on_gpu and not interpreted():
        return {}
    runners = {"Triton": TritonProjections(fdc.layers)}  # in the interpreter too: the bench's tests
    if not on_gpu:
        return runners
    if grouped_gemm.load_cutlass_ops():
        runners["CUTLASS"] = GroupedProjections(fdc.layers, runner="cutlass")
    else:
        print(f"  CUTLASS projections not timed: {grouped_gemm.cutlass_load_error()}")
    return runners


def _query_then_output(projections, query: torch.Tensor) -> torch.Tensor:
    """The query and output projections with nothing between: the reduced queries stand in for
    the attention's output (zero past the ranks, as that output is; the bench's K and V ranks
    are equal), at the width the output projection takes."""
    reduced = projections.queries(0, query)
    width = projections.output_width(0)
    return projections.outputs(0, torch.nn.functional.pad(reduced, (0, max(0, width - reduced.shape[-1])))[..., :width])


def _prefill_projections(fdc, shapes: Shapes, dtype: torch.dtype, device: str, generator: torch.Generator,
                         rows: list) -> None:
    """The four projections' GEMMs over one prefill chunk (`shapes.prompt // 4` tokens: 2048,
    vLLM's usual chunk): in fp32 as `FdcLayers` runs them, and in the cache's dtype, which runs
    on tensor cores and bounds what a CUTLASS GEMM could win (its relative error is the price)."""
    layer = fdc.layers[0]
    query_rotation, output_rotation = EinsumProjections(fdc.layers).per_query_head(0, shapes.kv_heads * shapes.group)
    tokens = shapes.prompt // 4
    key, value = (torch.randn(tokens, shapes.kv_heads, shapes.head_dim, generator=generator).to(device, dtype)
                  for _ in range(2))
    query = torch.randn(tokens, shapes.kv_heads * shapes.group, shapes.head_dim, generator=generator).to(device, dtype)

    # The rotations in each dtype once, as a layer would hold them: the timed calls are the GEMMs.
    rotations = {cast: [r.to(cast) for r in (layer.qk_rotation, layer.v_rotation, query_rotation, output_rotation)]
                 for cast in (torch.float32, dtype)}

    def project(cast: torch.dtype) -> tuple[torch.Tensor, ...]:
        qk, v, q, out = rotations[cast]
        reduced_q = torch.einsum("tqd,qdk->tqk", query.to(cast), q)
        # The output projection's input has the reduced attention output's shape: [T, Hq, max k_v].
        return (torch.einsum("thd,hdk->thk", key.to(cast), qk), torch.einsum("thd,hdk->thk", value.to(cast), v),
                torch.einsum("tqk,qdk->tqd", reduced_q[..., : out.shape[-1]], out))

    exact = torch.cat([part.flatten() for part in project(torch.float32)])
    relative = float((torch.cat([part.float().flatten() for part in project(dtype)]) - exact).norm() / exact.norm())
    case = Case(f"fdc-prefill projections of {tokens} tokens", device, rows)
    case.time("4 einsums in fp32 (as FdcLayers runs them)", lambda: project(torch.float32), baseline=True)
    case.time(f"4 einsums in {str(dtype).removeprefix('torch.')} (tensor cores)", lambda: project(dtype),
              relative_error=relative)
    for name, projections in _gpu_projections(fdc, device).items():
        def project_on(p=projections) -> tuple[torch.Tensor, ...]:
            return (*p.keys_values(0, key, value), _query_then_output(p, query))

        widths = [part.shape[-1] for part in project(torch.float32)]
        flat = torch.cat([part[..., :w].flatten() for part, w in zip(project_on(), widths)])
        precision = "3xTF32" if name == "CUTLASS" else "3xTF32 where Triton has it"
        case.time(f"{name}, each head at its own rank ({precision})", project_on,
                  relative_error=float((flat - exact).norm() / exact.norm()))
