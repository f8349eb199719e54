"""Collective GEMMs for sequence parallelism on NVLink-connected Hopper GPUs (the sp layers'
``overlap="fused"``, docs/sp.md): the GEMM kernel itself moves the sequence chunks between the TP
ranks, with TMA stores into a neighbour's memory, so no NCCL kernel competes with the GEMM for SMs.

Both collectives run round a ring, each rank writing to its left neighbour (rank r-1):

- ``gather_matmul``: ``all_gather(a) @ b``. At step s a rank multiplies chunk (r+s) mod n of the
  sequence and, while its A tiles sit in shared memory for that GEMM, stores them into the left
  neighbour's gathered A (at the chunk's own rows); the neighbour's step s+1 multiplies them. The
  gathered A, in rank order, comes back too (the wgrad GEMM reads it).
- ``matmul_reduce_scatter``: ``reduce_scatter(a @ b)``. At step s a rank computes the partial product of
  chunk (r+s+1) mod n, adds the running sum that arrived in its receive slot s-1 and stores the bf16
  result into the left neighbour's slot s; at the last step the chunk is its own and the sum stays.

Each step's stores are awaited and then signalled on the receiver's semaphore: by default one count per
CTA and warpgroup that stores to the neighbour, and a step that reads what arrived first waits for all
of it; or (the reduce-scatter kernel's ``handoff="tile"``, chosen where ring steps are short) one flag
per output tile, which only the epilogue adding that tile waits for. The
GEMM engine (``_gemm``) is jaxquant's own warp-specialized Hopper GEMM written with Pallas:Mosaic GPU:
TMA loads several K steps ahead, wgmma with fp32 accumulation, B read as ``[K, N]`` or K-major
``[N, K]`` (a weight ``[out, in]`` as stored). Operands are bf16, or FP8 (E4M3 / E5M2, B K-major) whose
products come out unscaled in bf16; outputs and running sums are bf16.

``impl="reference"`` runs the same schedule in plain JAX (``all_gather`` / ``ppermute``, bf16 partial sums
added in fp32 and rounded, chunk for chunk in the kernel's order), on any backend: the CPU tests'
executable spec of the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxquant.primitives.varying import varying_axes, varying_like

DTYPE = jnp.bfloat16   # output and wire dtype of both kernels (their running sums), and 16-bit operands
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))   # 8-bit operands, any pairing
CONSUMERS = 2   # the kernels' GEMM (wgmma) warpgroups, 0 and 1; warpgroup 2 issues the TMA loads


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiling of the GEMM under the collective kernels. Each CTA owns a ``2 * tile_m x tile_n`` output
    tile (``split="m"``) or ``tile_m x 2 * tile_n`` (``split="n"``), one half per consumer warpgroup;
    ``stages`` A/B tiles are in flight; the persistent grid walks output tiles in bands of
    ``band`` tiles along ``walk`` ("m" or "n"); the epilogue stores ``epi x epi`` pieces of a
    warpgroup's tile through two shared-memory slots, or (``epi=None``) the whole tile through one, so
    that its store need not finish before the next tile's GEMM starts. ``spread`` (> 0, with
    ``epi=None``): the epilogue leaves the tile in shared memory and the CTA's next tile stores it during
    its K loop, in ``spread`` row strips evenly apart (a CTA's last tile is stored after its loop), so
    that the stores do not leave every CTA at the same moments (the epilogues of a persistent grid run
    in step). ``handoff`` (the reduce-scatter kernel): how a rank tells its left neighbour that a ring
    step's running sums have landed: ``"step"``, one semaphore count per step that every CTA of the
    neighbour waits for before the step's GEMM; ``"tile"``, one flag per output tile and consumer
    warpgroup, set once the tile's store has landed and waited for only by the epilogue that adds it,
    so no CTA waits for another's stragglers (``SHORT_STEPS``: the choice at tp >= 3 where ring steps are
    short; at tp 2, one hand-off a call with many tiles a step, "step" is faster and stays the default:
    docs/performance.md).
    ``tile_k`` is the K step of 16-bit operands; 8-bit operands step twice as far (``for_operands``:
    the same 128-byte rows)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    walk: str = "n"
    band: int = 16
    split: str = "m"
    epi: int | None = 64
    spread: int = 0
    handoff: str = "step"

    def __post_init__(self):
        if self.spread and (self.epi is not None or self.tile_m % (8 * self.spread)):
            raise ValueError(f"spread: stores spread over the next tile's K loop need epi=None and tile_m "
                             f"({self.tile_m}) a multiple of 8 x spread ({self.spread})")
        if self.handoff not in ("step", "tile"):
            raise ValueError(f"handoff: 'step' or 'tile', got {self.handoff!r}")

    def cta_tile(self) -> tuple[int, int]:
        return (self.tile_m * (2 if self.split == "m" else 1), self.tile_n * (2 if self.split == "n" else 1))

    def walk_dim(self) -> int:
        return {"m": 0, "n": 1}[self.walk]

    def for_operands(self, dtype) -> "TileConfig":
        return dataclasses.replace(self, tile_k=self.tile_k * 2 // jnp.dtype(dtype).itemsize)


# per kernel, the tilings to use, best first (the fastest of benchmarks/bench_collective_gemm.py's sweep at the
# sp benchmark's per-rank shapes, tp 2 and 4, hidden 4096 / 8192; figures in docs/performance.md); the last one
# has the smallest tiles, so a shape that it cannot tile fits none
TILINGS = {
    "gather": (TileConfig(tile_m=64, tile_n=256, walk="m", band=8), TileConfig()),
    # stores spread over the next tile: the remote stores stop leaving every CTA at once, so NVLink no longer
    # takes them in bursts at the end of each tile (docs/performance.md, "What moved them")
    "scatter": (TileConfig(epi=None, stages=3, spread=4), TileConfig()),
}
# the reduce-scatter kernel's tiling, ahead of TILINGS["scatter"], where a call has several hand-offs (tp >= 3)
# and each ring step at most SHORT_STEP_WAVES waves of output tiles: the step-wise hand-off leaves a step's last
# stores exposed at every hand-off, a large share of a short step; tile by tile they are stored under the next
# step's first tile. With many waves a step those last stores are a small share of it and the tile-by-tile
# hand-off is the slower one, so the step-wise hand-off stays there (docs/performance.md, the tp-4 kernel table)
SHORT_STEPS = TileConfig(epi=None, stages=3, spread=8, handoff="tile")
SHORT_STEP_WAVES = 2   # a ring step of at most this many waves of output tiles (tiles / SMs) is short


def _misfit(rows: int, k: int, n_cols: int, config: TileConfig):
    """(what, size, unit) of the first dimension of one rank's ``[rows, k] @ [k, n_cols]`` that ``config``
    cannot tile, or None."""
    cta_m, cta_n = config.cta_tile()
    for what, size, unit in (("rows of one rank's sequence chunk (batch x S/tp)", rows, cta_m),
                             ("contracted features", k, config.tile_k),
                             ("output features of one rank", n_cols, cta_n)):
        if size % unit:
            return what, size, unit
    return None


def _tiles(rows: int, n_cols: int, config: TileConfig) -> int:
    """Output tiles of one rank's ``[rows, n_cols]`` (one ring step) under ``config`` (rounded up)."""
    cta_m, cta_n = config.cta_tile()
    return -(-rows // cta_m) * -(-n_cols // cta_n)


def check_shapes(name: str, rows: int, k: int, n_cols: int, config: TileConfig) -> None:
    """ValueError unless one rank's chunk ``[rows, k] @ [k, n_cols]`` fits the kernels' tiling."""
    bad = _misfit(rows, k, n_cols, config)
    if bad:
        what, size, unit = bad
        cta_m, cta_n = config.cta_tile()
        raise ValueError(f"{name}: overlap='fused' tiles the GEMM in {cta_m}x{cta_n} outputs and "
                         f"{config.tile_k}-wide K steps; the {what} ({size}) must be a multiple of {unit}")


def tiling(kernel: str, name: str, rows: int, k: int, n_cols: int, dtype=DTYPE, n: int = 2) -> TileConfig:
    """The first tiling of ``TILINGS[kernel]`` (for operands of ``dtype``) that fits one rank's
    ``[rows, k] @ [k, n_cols]`` on a ring of ``n`` ranks (``SHORT_STEPS`` first where it applies), or the
    ValueError (naming ``name``) of the most permissive one."""
    configs = TILINGS[kernel]
    if kernel == "scatter" and n >= 3 and _tiles(rows, n_cols, SHORT_STEPS) <= SHORT_STEP_WAVES * _num_sms():
        configs = (SHORT_STEPS,) + configs
    configs = [c.for_operands(dtype) for c in configs]
    fit = next((c for c in configs if _misfit(rows, k, n_cols, c) is None), None)
    if fit is None:
        check_shapes(name, rows, k, n_cols, configs[-1])
    return fit


def device_problem(device) -> str | None:
    """Why the kernels cannot run on ``device`` (they use Hopper's wgmma: sm_90 only), or None."""
    if device.platform != "gpu":
        return f"a mesh of GPUs, not {device.platform}"
    cc = str(getattr(device, "compute_capability", ""))   # unknown: let the kernel compile speak
    if cc and not cc.startswith("9."):
        return f"Hopper GPUs (compute capability 9.x), not {device.device_kind} (compute capability {cc})"
    return None


def process_problem(mesh, axis: str) -> str | None:
    """Why the kernels cannot run between the ranks of mesh axis ``axis``, or None: they store into the
    neighbour's memory, which a kernel reaches only on devices of its own process (a launcher that starts one
    process per GPU puts every TP rank in another process). ``mesh`` None (a layer inside the caller's shard_map):
    one process, or not known."""
    if mesh is None:
        if jax.process_count() == 1:
            return None
        return (f"every rank of the TP axis {axis!r} in one process, which a layer given no mesh cannot check in a "
                f"run of {jax.process_count()} processes (give the layer its mesh)")
    names = tuple(mesh.axis_names)
    groups = np.moveaxis(np.asarray(mesh.devices), names.index(axis), -1).reshape(-1, mesh.shape[axis])
    for group in groups:
        processes = sorted({d.process_index for d in group})
        if len(processes) > 1:
            return (f"every rank of the TP axis {axis!r} in one process (its ranks lie in processes {processes}, "
                    f"e.g. one process per GPU)")
    return None


def _check(name, a, b, contract):
    """The operands' dtypes and layout: both bf16, or both FP8 (E4M3 / E5M2, any pairing) with B K-major
    (``contract=1``: wgmma reads 8-bit operands K-major only)."""
    if contract not in (0, 1):
        raise ValueError(f"contract: the contracted axis of {name} is 0 or 1, got {contract}")
    kinds = [("bf16" if jnp.dtype(v.dtype) == jnp.dtype(DTYPE) else "fp8" if jnp.dtype(v.dtype) in FP8_DTYPES
              else None) for v in (a, b)]
    for arg, v, kind in (("a", a, kinds[0]), (name, b, kinds[1])):
        if v.ndim != 2 or kind is None:
            raise ValueError(f"{arg}: overlap='fused' takes 2-D bf16 or FP8 (float8_e4m3fn / float8_e5m2) GEMM "
                             f"operands, got {v.dtype}{tuple(v.shape)}")
    if kinds[0] != kinds[1]:
        raise ValueError(f"{name}: a is {a.dtype} and {name} is {b.dtype}; both must be bf16 or both FP8")
    if kinds[0] == "fp8" and contract != 1:
        raise ValueError(f"contract: FP8 operands need {name} as [N, K] (contract=1), since wgmma reads 8-bit "
                         "operands K-major only; pass the weight as stored or its byte transpose")
    if a.shape[1] != b.shape[contract]:
        raise ValueError(f"{name}: contracted sizes differ ({a.shape[1]} vs {b.shape[contract]})")


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


# ----------------------------------------------------------------------------------------------
# Pallas:Mosaic GPU kernels (per-rank code, inside shard_map over ``axis``)
# ----------------------------------------------------------------------------------------------


def _kernel_call(body, out_types):
    """A persistent kernel: one CTA per SM, three warpgroups (two GEMM consumers, one TMA producer:
    the Hopper GEMM engine's warp specialization)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.kernel(body, out_type=out_types, grid=(_num_sms(),), grid_names=("cluster_grid",),
                        cluster=(1,), cluster_names=("cluster",), num_threads=CONSUMERS + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _ring(axis, n, ref):
    """Inside a kernel body: (one semaphore per ring hand-off, warpgroup index, rank, the left
    neighbour's device id, ``ref`` on the left neighbour). A hand-off counts on its own semaphore, not
    on one running count: a neighbour's CTAs do not move through the steps together (a CTA with no
    tile, or a fast one, signals step s + 1 while another still stores step s), so a running count can
    reach ``(s + 1) x CTAs`` before every CTA has handed off step s (at tp >= 3 a rank then reads a chunk
    before it has landed: the race in docs/performance.md)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    me = lax.axis_index(axis)
    left = {axis: lax.rem(me + n - 1, n)}
    return (pl.get_global(plgpu.SemaphoreType.REGULAR((max(n - 1, 1),))), lax.axis_index("wg"), me, left,
            plgpu.remote_ref(ref, left))


def _swizzled(dtype, minor):
    """TMA tiles of 8 rows, swizzled by the widest pattern a row of ``minor`` elements allows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    item = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor * item * 8)
    return (plgpu.TilingTransform((8, swizzle // item)), plgpu.SwizzleTransform(swizzle))


def _epilogue_shape(config):
    """(rows, cols, slots) of the epilogue's pieces: two ``epi x epi`` slots, or one whole warpgroup tile."""
    epi_m, epi_n = config.epi or config.tile_m, config.epi or config.tile_n
    return epi_m, epi_n, min(2, (config.tile_m * config.tile_n) // (epi_m * epi_n))


def _epilogue_smem(config, dtype):
    """The epilogue's shared memory: per consumer warpgroup, ``_epilogue_shape(config)``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    epi_m, epi_n, slots = _epilogue_shape(config)
    return plgpu.SMEM((CONSUMERS, slots, epi_m, epi_n), dtype, transforms=_swizzled(dtype, epi_n))


def _spread_of(config, k):
    """``config.spread``, or 0 where a K loop of ``k`` is too short to spread a tile's stores over."""
    return config.spread if k // config.tile_k >= config.spread else 0


def _gemm(a_ref, b_ref, contract, c_ref, out_ref, config, on_a_tile=None, delay_release=0, wait_c=None,
          stored=None, carry=None, keep_last=False, out_smem=None):
    """Inside a kernel body (three warpgroups, a persistent grid): ``out = a @ B (+ c)`` with fp32
    accumulation, ``B`` being ``b`` ``[K, N]`` (``contract=0``) or ``b`` ``[N, K]`` (``contract=1``, e.g.
    a weight ``[out, in]``, read K-major with no transpose in memory). Warp-specialized: one
    warpgroup issues the TMA loads of ``config.stages`` A/B tiles ahead, two consume them with wgmma,
    each owning half of the CTA's output tile. ``on_a_tile(m_idx, n_idx, k_idx, a_smem)`` runs in the
    consumers after each step's wgmma is issued (the all-gather kernel forwards A tiles there; with
    ``delay_release=1`` a tile stays in shared memory until the next step's wgmma). With
    ``config.spread`` a tile's store runs during the CTA's next tile (``TileConfig``). Per consumer
    warpgroup and output tile (its index in the grid's walk): ``wait_c(tile)`` runs before the epilogue
    reads ``c``; ``stored(tile)`` once the warpgroup's store of the tile has landed. Across calls of one
    grid (ring steps), with spread stores and the epilogue's ``out_smem`` given by the caller:
    ``keep_last`` leaves each CTA's last tile in shared memory, and the next call's ``carry=(dst,
    stored)`` stores it into ``dst`` during that CTA's first tile and then calls ``stored(tile)``, so no
    step ends with every CTA storing at once."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, k = a_ref.shape
    cols = b_ref.shape[1 - contract]
    cta_m, cta_n = config.cta_tile()
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    split_m = config.split == "m"
    tile_grid = (rows // cta_m, cols // cta_n)
    n_tiles, ctas = tile_grid[0] * tile_grid[1], _num_sms()
    spread = _spread_of(config, k)   # 0: a K loop too short to spread stores over, store at once
    if (carry is not None or keep_last) and not (spread and out_smem is not None):
        raise ValueError("carry / keep_last: a tile kept across calls needs spread stores and the caller's out_smem")
    strip = tm // max(spread, 1)
    epi_m, epi_n, slots = _epilogue_shape(config)
    in_tf = _swizzled(a_ref.dtype, tk)
    # the epilogue waits until the previous tile's stores have read shared memory, or, when a store is
    # signalled to the neighbour, until they have landed
    signals = stored is not None or (carry is not None and carry[1] is not None)
    b_block, b_index = ((tk, cta_n), lambda s: (s, 0)) if contract == 0 else ((cta_n, tk), lambda s: (0, s))

    def pipeline(body, context):
        spec = lambda block, index: plgpu.BlockSpec(block, index, transforms=in_tf, memory_space=plgpu.SMEM,
                                                    delay_release=delay_release)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tk,), memory_registers=40,
            in_specs=[spec((cta_m, tk), lambda s: (0, s)), spec(b_block, b_index)],
            wg_axis="wg", num_compute_wgs=CONSUMERS, max_concurrent_steps=config.stages, compute_context=context)

    nothing = lambda *_, **__: None

    scoped = dict(allocs=pipeline(nothing, nothing).get_allocations(a_ref, b_ref),
                  c_barrier=None if c_ref is None else plgpu.Barrier(num_barriers=2 * slots))
    if out_smem is None:
        scoped["out_smem"] = _epilogue_smem(config, out_ref.dtype)

    @functools.partial(pl.run_scoped, **scoped, collective_axes="wg")
    def _scope(allocs, c_barrier, out_smem=out_smem):
        wg = lax.axis_index("wg")
        wg_rows = pl.ds(wg * tm, tm) if split_m else slice(None)
        wg_cols = slice(None) if split_m else pl.ds(wg * tn, tn)
        tile_at = lambda index: plgpu.planar_snake(index, tile_grid, config.walk_dim(), config.band)
        if spread:
            cta = lax.axis_index("cluster_grid")
            last = cta + ctas * ((n_tiles - 1 - cta) // ctas)   # the last tile this CTA computes (if any)

        def store_strips(strips, m_i, n_i, dst=out_ref):   # this warpgroup's kept tile (m_i, n_i), these strips
            window = dst.at[pl.ds(m_i * cta_m, cta_m), pl.ds(n_i * cta_n, cta_n)].at[wg_rows, wg_cols]
            for p in strips:
                part = slice(p * strip, (p + 1) * strip)
                plgpu.copy_smem_to_gmem(out_smem.at[wg, 0].at[part], window.at[part])

        @plgpu.nd_loop((n_tiles,), collective_axes="cluster_grid")
        def _tiles(info):
            m_idx, n_idx = tile_at(info.index[0])
            cta_rows, cta_cols = pl.ds(m_idx * cta_m, cta_m), pl.ds(n_idx * cta_n, cta_n)
            if spread:   # the tile this CTA computed before this one (tiles are dealt out round robin)
                first = info.index[0] < ctas
                has_prev = ~first
                prev_m, prev_n = tile_at(jnp.maximum(info.index[0] - ctas, 0))

            def epilogue(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc):
                    run(acc)
                    res = acc[...].astype(out_ref.dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=not signals)
                    if spread and stored is not None:
                        pl.when(has_prev)(lambda: stored(info.index[0] - ctas))
                    if carry is not None and carry[1] is not None:   # the previous call's last tile
                        pl.when(first)(lambda: carry[1](last))
                    if c_ref is not None and wait_c is not None:
                        wait_c(info.index[0])
                    for i in range(tm // epi_m):
                        for j in range(tn // epi_n):
                            piece = (slice(i * epi_m, (i + 1) * epi_m), slice(j * epi_n, (j + 1) * epi_n))
                            slot = (i * (tn // epi_n) + j) % 2 if slots == 2 else 0
                            dst_piece = lambda ref: ref.at[cta_rows, cta_cols].at[wg_rows, wg_cols].at[piece]
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            if c_ref is None:
                                out_smem[wg, slot] = res[piece]
                            else:
                                bar = c_barrier.at[wg * slots + slot]
                                plgpu.copy_gmem_to_smem(dst_piece(c_ref), out_smem.at[wg, slot], bar)
                                plgpu.barrier_wait(bar)
                                out_smem[wg, slot] += res[piece]
                            plgpu.commit_smem()
                            if not spread:   # else kept for the next tile's K loop (or the end)
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst_piece(out_ref))
                    if not spread and stored is not None:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                        stored(info.index[0])

            def mma(idx, a_smem, b_smem, acc):
                b_op = b_smem.at[:, wg_cols] if contract == 0 else plgpu.transpose_ref(b_smem.at[wg_cols], (1, 0))
                plgpu.wgmma(acc, a_smem.at[wg_rows], b_op)
                if on_a_tile is not None:
                    on_a_tile(m_idx, n_idx, idx[0], a_smem)
                for p in range(spread):   # strip p of the previous tile at K step p * (K steps / spread)
                    at_p = idx[0] == p * (k // tk // spread)
                    pl.when(has_prev & at_p)(lambda p=p: store_strips([p], prev_m, prev_n))
                    if carry is not None:   # a CTA's first tile stores the previous call's last one
                        pl.when(first & at_p)(lambda p=p: store_strips([p], *tile_at(last), dst=carry[0]))
                plgpu.wgmma_wait(delay_release)
                return acc

            b_cta = b_ref.at[:, cta_cols] if contract == 0 else b_ref.at[cta_cols, :]
            pipeline(mma, epilogue)(a_ref.at[cta_rows, :], b_cta, allocations=allocs)

        if spread and not keep_last:   # the last tile each CTA computed is still in shared memory
            @pl.when((wg < CONSUMERS) & (cta < n_tiles))
            def _():
                store_strips(range(spread), *tile_at(last))
                if stored is not None:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    stored(last)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gather_matmul_kernel(a, b, contract, axis, n, config):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, k = a.shape
    cols = b.shape[1 - contract]
    cta_m, cta_n = config.cta_tile()
    n_tiles = cols // cta_n
    k_steps = k // config.tile_k
    sms = _num_sms()

    def collective_gather_gemm(a_ref, b_ref, out_ref, full_ref):   # the name profiles show
        sem, wg, me, left, left_full = _ring(axis, n, full_ref)
        for s in range(n):
            chunk = lax.rem(me + s, n)
            chunk_rows = pl.ds(chunk * rows, rows)
            forward = s < n - 1

            def store_tile(m_idx, n_idx, k_idx, a_smem, chunk_rows=chunk_rows, first=s == 0):
                # an A tile (m, k) is stored once, by the CTA that computes output column k mod
                # (column tiles), so that every CTA stores its share while it computes (one column
                # storing them all made its CTAs the stragglers of each step): into the left
                # neighbour's gathered operand (warpgroup 0) and, the rank's own chunk, into its own
                # (warpgroup 1, first step only); every chunk lands at its rank-order rows.
                # The pipeline frees a K step's shared-memory slot after the next step's body, so the
                # store must have read it by then: a storing warpgroup waits at every K step, keeping
                # only a store issued in this step pending (none at the tile's last step). Waiting only
                # where it stored (every n_tiles-th step) let a TMA load overwrite a tile still being sent.
                tile = (pl.ds(m_idx * cta_m, cta_m), pl.ds(k_idx * config.tile_k, config.tile_k))
                mine = n_idx == lax.rem(k_idx, n_tiles)
                keep_pending = mine & (k_idx < k_steps - 1)
                for dst, who in ((left_full, 0), (full_ref, 1)) if first else ((left_full, 0),):
                    @pl.when((wg == who) & mine)
                    def _(dst=dst):
                        plgpu.copy_smem_to_gmem(a_smem, dst.at[chunk_rows].at[tile])

                    @pl.when((wg == who) & keep_pending)
                    def _():
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)

                    @pl.when((wg == who) & ~keep_pending)
                    def _():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            src = a_ref if s == 0 else full_ref.at[chunk_rows]
            _gemm(src, b_ref, contract, None, out_ref.at[chunk_rows], config,
                  on_a_tile=store_tile if forward else None, delay_release=1 if forward else 0)
            if forward:
                @pl.when(wg == 0)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    pl.semaphore_signal(sem.at[s], device_id=left)
                # every CTA of the right neighbour has stored its tiles of the next chunk
                pl.semaphore_wait(sem.at[s], value=sms, decrement=False)

    out, full = _kernel_call(collective_gather_gemm, [jax.ShapeDtypeStruct((n * rows, cols), DTYPE),
                                    jax.ShapeDtypeStruct((n * rows, k), a.dtype)])(a, b)
    # typed as all_gather and a GEMM would be: the gathered A is the same on every rank of ``axis``
    vary = varying_axes(a) | varying_axes(b)
    return varying_like((out,), (), vary | {axis})[0], varying_like((full,), (), vary - {axis})[0]


def _matmul_reduce_scatter_kernel(a, b, contract, axis, n, config):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = a.shape[0] // n
    cols = b.shape[1 - contract]
    sms = _num_sms()
    cta_m, cta_n = config.cta_tile()
    tiles = (rows // cta_m) * (cols // cta_n)   # output tiles of one ring step
    by_tile = config.handoff == "tile"

    # with a tile-by-tile hand-off and spread stores, each CTA's last tile of a step is stored during its
    # first tile of the next step (no step ends with every CTA storing at once)
    keep = by_tile and _spread_of(config, a.shape[1]) > 0

    def collective_gemm_scatter(a_ref, b_ref, out_ref, recv_ref):   # the name profiles show
        sem, wg, me, left, left_recv = _ring(axis, n, recv_ref)
        if by_tile:   # flag (step, tile, warpgroup): that half tile's running sum has landed in slot step
            flags = pl.get_global(plgpu.SemaphoreType.REGULAR((max(n - 1, 1) * tiles * CONSUMERS,)))
            flag = lambda step, tile: flags.at[(step * tiles + tile) * CONSUMERS + wg]
            signal = lambda step: lambda tile: pl.semaphore_signal(flag(step, tile), device_id=left)

        def steps(out_smem=None):
            for s in range(n):
                chunk = lax.rem(me + s + 1, n)
                last = s == n - 1
                hooks = {}
                if by_tile:
                    if s:   # the right neighbour's half of this tile is in slot s-1
                        hooks["wait_c"] = lambda tile, s=s: pl.semaphore_wait(flag(s - 1, tile), value=1,
                                                                              decrement=False)
                    if not last:
                        hooks["stored"] = signal(s)
                    if keep:
                        hooks.update(carry=(left_recv.at[s - 1], signal(s - 1)) if s else None,
                                     keep_last=not last, out_smem=out_smem)
                elif s:
                    # the right neighbour's running sum of this chunk is complete in slot s-1
                    pl.semaphore_wait(sem.at[s - 1], value=CONSUMERS * sms, decrement=False)
                _gemm(a_ref.at[pl.ds(chunk * rows, rows)], b_ref, contract, recv_ref.at[s - 1] if s else None,
                      out_ref if last else left_recv.at[s], config, **hooks)
                if not last and not by_tile:
                    @pl.when(wg < CONSUMERS)   # the consumers store the output tiles
                    def _():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                        pl.semaphore_signal(sem.at[s], device_id=left)

        if keep:   # the epilogue's shared memory outlives each step's GEMM: it carries a tile between them
            pl.run_scoped(steps, out_smem=_epilogue_smem(config, DTYPE), collective_axes="wg")
        else:
            steps()

    out, _ = _kernel_call(collective_gemm_scatter, [jax.ShapeDtypeStruct((rows, cols), DTYPE),
                                 jax.ShapeDtypeStruct((max(n - 1, 1), rows, cols), DTYPE)])(a, b)
    return varying_like((out,), (a, b), (axis,))[0]


# Each kernel call is a jitted function of its static arguments, so that a model's many calls of one
# shape (every layer, forward and backward) share one traced jaxpr and are lowered to Mosaic GPU once per
# compilation, not once per call site (the lowering dominated the training step's compile time).
_GATHER_KERNEL = jax.jit(_gather_matmul_kernel, static_argnums=(2, 3, 4, 5))
_SCATTER_KERNEL = jax.jit(_matmul_reduce_scatter_kernel, static_argnums=(2, 3, 4, 5))


# ----------------------------------------------------------------------------------------------
# Public per-rank functions (inside shard_map): kernel or its plain-JAX schedule
# ----------------------------------------------------------------------------------------------


def _tiling_of(kernel, a, b, contract, rows, n, config):
    """The checked operands' tiling: ``config`` (for their dtype) if given, else ``tiling``'s choice."""
    _check("b", a, b, contract)
    shape = (rows, a.shape[1], b.shape[1 - contract])
    if config is None:
        return tiling(kernel, "b", *shape, a.dtype, n)
    if kernel == "gather" and config.handoff != "step":
        raise ValueError(f"config: handoff={config.handoff!r} is the reduce-scatter kernel's; the all-gather "
                         "kernel hands off whole ring steps")
    config = config.for_operands(a.dtype)
    check_shapes("b", *shape, config)
    return config


def _mm(a, b, contract):
    """bf16 out of fp32 accumulation (the kernels' epilogue: products of the stored values, unscaled)."""
    return lax.dot_general(a, b, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32).astype(DTYPE)


def gather_matmul(a, b, *, axis: str, n: int, contract: int = 0, impl: str = "kernel",
                  config: TileConfig | None = None):
    """This rank's sequence chunk ``a [rows, K]`` all-gathered over ``axis`` (size ``n``) times ``b``
    (``[K, N]`` with ``contract=0``, ``[N, K]`` with ``contract=1``) -> (``out [n*rows, N]`` bf16, the
    gathered ``a [n*rows, K]`` in its own dtype), rows in rank order. FP8 operands (``contract=1``)
    give the products of their stored values: the caller multiplies by the scales. ``config`` None:
    the first of ``TILINGS["gather"]`` that fits."""
    config = _tiling_of("gather", a, b, contract, a.shape[0], n, config)
    if impl == "reference":
        full = lax.all_gather(a, axis, axis=0, tiled=True)
        return _mm(full, b, contract), full
    return _GATHER_KERNEL(a, b, contract, axis, n, config)


def matmul_reduce_scatter(a, b, *, axis: str, n: int, contract: int = 0, impl: str = "kernel",
                          config: TileConfig | None = None):
    """``a [n*rows, K_local] @ b`` (``[K_local, N]`` with ``contract=0``, ``[N, K_local]`` with
    ``contract=1``) summed over ``axis`` and scattered over the rows: this rank's ``[rows, N]`` (rows in
    rank order), bf16 partial sums on the wire. FP8 operands (``contract=1``) give unscaled products,
    so every rank's operands must share their scales (jaxquant's current scaling reduces amax over
    tp). ``config`` None: ``tiling``'s choice (``SHORT_STEPS`` at tp >= 3 with short ring steps, else the
    first of ``TILINGS["scatter"]`` that fits)."""
    if a.shape[0] % n:
        raise ValueError(f"a: its rows ({a.shape[0]}) must be a multiple of the axis size {n}")
    config = _tiling_of("scatter", a, b, contract, a.shape[0] // n, n, config)
    if impl == "reference":
        rows = a.shape[0] // n
        me = lax.axis_index(axis)
        to_left = [(i, (i - 1) % n) for i in range(n)]
        acc = None
        for s in range(n):
            part = _mm(lax.dynamic_slice_in_dim(a, ((me + s + 1) % n) * rows, rows, 0), b, contract)
            acc = part if acc is None else (acc.astype(jnp.float32) + part.astype(jnp.float32)).astype(DTYPE)
            if s < n - 1:
                acc = lax.ppermute(acc, axis, to_left)
        return acc
    return _SCATTER_KERNEL(a, b, contract, axis, n, config)
