"""Grouped ops over one shard of a ZeRO flat buffer: custom call == reference, bit for bit, and
assembled over all shards == single-tensor quantization. Runs on the default backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxquant as jq
from jaxquant.primitives import _ffi, formats, ops, reference
from jaxquant.primitives.ops import table as gtable
from jaxquant.primitives.ops.grouped import int64_words
from jaxquant.primitives.ops.table import FIELD
from conftest import assert_bytes_equal


def _layout(rng, num_params, num_shards, odd):
    """Random group: shapes on the 16-grid, optional odd gaps between parameters, odd shard size."""
    shapes = [(16 * int(rng.integers(1, 5)), 16 * int(rng.choice([1, 2, 3, 5]))) for _ in range(num_params)]
    offsets, pos = [], 0
    for m, k in shapes:
        pos += int(rng.integers(1, 6)) if odd else 0
        offsets.append(pos)
        pos += m * k
    shard_size = -(-(pos + int(rng.integers(0, 7))) // num_shards)
    return shapes, offsets, shard_size


def _chunk_plan(shapes, offsets, num_shards, shard_size):
    """Each shard's range [lo, hi) in the group's param-byte space, and the common chunk size."""
    base = np.concatenate([[0], np.cumsum([m * k // 2 for m, k in shapes])])
    los, his = [], []
    for r in range(num_shards):
        lo = hi = None
        for p, (off, (m, k)) in enumerate(zip(offsets, shapes)):
            s, e = max(off, r * shard_size), min(off + m * k, (r + 1) * shard_size)
            if s < e:
                lo = base[p] + (s - off) // 2 if lo is None else lo
                hi = base[p] + (e - off + 1) // 2
        los.append(int(lo or 0))
        his.append(int(hi or 0))
    return los, his, max(h - l for l, h in zip(los, his))


def _flat(rng, shapes, offsets, num_shards, shard_size):
    flat = np.zeros(num_shards * shard_size, np.float32)
    for off, (m, k) in zip(offsets, shapes):
        w = rng.standard_normal((m // 16, 16, k // 16, 16)) * 10.0 ** rng.uniform(-3, 3, (m // 16, 1, k // 16, 1))
        flat[off:off + m * k] = w.reshape(-1)
    return flat


def _jitted(op, **kw):
    """``op`` with the keyword options ``kw`` fixed, jitted: the arrays are its operands."""
    return jax.jit(functools.partial(op, **kw))


CASES = [(1, 1, False), (2, 3, True), (3, 4, False), (4, 2, True), (5, 3, True)]


# fp32 input on every layout; bf16 input (which changes only the handlers' element load, not their indexing) on
# one parameter without gaps and on several parameters with odd gaps over 3 shards: both keep bf16's rounding
# ties and overflow thresholds, for the first parameter and a later one
GROUP_CASES = [(jnp.float32, *c) for c in CASES] + [(jnp.bfloat16, 1, 1, False), (jnp.bfloat16, 5, 3, True)]


@pytest.mark.parametrize("dtype,num_params,num_shards,odd", GROUP_CASES,
                         ids=[f"{jnp.dtype(d).name}-{p}-{s}-{o}" for d, p, s, o in GROUP_CASES])
@pytest.mark.fast_cases("bfloat16-1-1-False")  # the other cases: slow
def test_group_ops_custom_call_equals_reference(num_params, num_shards, odd, dtype):
    rng = np.random.default_rng(num_params * 10 + num_shards)
    shapes, offsets, n = _layout(rng, num_params, num_shards, odd)
    flat = _flat(rng, shapes, offsets, num_shards, n)
    flat[offsets[0] + 3] = np.nan  # non-finite values are counted per parameter
    flat[offsets[-1]] = -np.inf
    table = ops.group_table(offsets, shapes, num_shards=num_shards, shard_size=n, nvfp4=True)
    los, _, size = _chunk_plan(shapes, offsets, num_shards, n)
    tiles = int(table[:, FIELD["numel"]].sum() // 256)
    enc = jnp.asarray(rng.uniform(0.25, 8.0, tiles).astype(np.float32))
    scale = jnp.asarray(rng.uniform(0.25, 8.0, num_params).astype(np.float32))
    kw = dict(table=table, num_shards=num_shards)
    impl_pair = ("reference", "custom_call")
    # compute_dtype bfloat16 rounds inside the ops: ties of the fp32 -> bf16 rounding, and a value
    # that overflows to inf there
    flat[offsets[0] + 5] = np.float32(1.0 + 2.0 ** -8)
    flat[offsets[0] + 6] = np.float32(1.0 + 3 * 2.0 ** -8)
    flat[offsets[-1] + 7] = np.float32(3.4e38)
    # the bf16 overflow threshold (0x7F7F8000 rounds to inf, the float below it to the largest bf16):
    # the kernels round one max instead of each value, and count what rounds to inf by |x| >= it
    flat[offsets[0] + 9] = np.array(0x7F7F7FFF, np.uint32).view(np.float32)
    if num_params > 1:
        flat[offsets[1] + 9] = -np.array(0x7F7F8000, np.uint32).view(np.float32)
    # one jitted program per op, options and impl, run on every shard (the index is an operand, as under
    # lax.axis_index): the reference is compiled whole instead of op by op
    ranges = ((0, n // 3), (16 * (n // 48), n - 16 * (n // 48)), (5, n - 12), (n, 0))
    for cd in (None, jnp.bfloat16):
        ckw = dict(kw, compute_dtype=cd)
        pair = lambda op, **okw: [_jitted(op, impl=i, **ckw, **okw) for i in impl_pair]
        tile_amax = pair(ops.nvfp4_group_tile_amax, return_nonfinite=True)
        nvfp4_cast = pair(ops.nvfp4_group_cast, chunk_lo=los, chunk_size=size)
        fp8_amax = pair(ops.fp8_group_amax, return_nonfinite=True)
        fp8_cast = {fp8: pair(ops.fp8_group_cast, dtype=fp8) for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2)}
        fp8_range = {fc: pair(ops.fp8_group_cast, first=fc[0], count=fc[1]) for fc in ranges}
        for r in range(num_shards):
            shard, index = jnp.asarray(flat[r * n:(r + 1) * n]).astype(dtype), jnp.int32(r)
            a, b = (f(shard, index) for f in tile_amax)
            for name, x, y in zip(("tile amax", "amax", "counts"), b, a):
                assert_bytes_equal(x, y, f"{name} shard {r} compute_dtype {cd}")
            a, b = (f(shard, index, enc) for f in nvfp4_cast)
            assert_bytes_equal(b, a, f"nvfp4 chunk shard {r} compute_dtype {cd}")
            a, b = (f(shard, index) for f in fp8_amax)
            assert_bytes_equal(b[0], a[0], f"fp8 amax shard {r}")
            assert_bytes_equal(b[1], a[1], f"fp8 counts shard {r}")
            for fp8 in (jnp.float8_e4m3fn, jnp.float8_e5m2):
                a, b = (f(shard, index, scale) for f in fp8_cast[fp8])
                assert_bytes_equal(b, a, f"fp8 data shard {r} compute_dtype {cd}")
            # element ranges of the shard (the master-weight step's gather pieces): on and off the 16-grid
            for first, count in ranges:
                a, b = (f(shard, index, scale) for f in fp8_range[first, count])
                assert b.shape == (count,)
                assert_bytes_equal(b, a, f"fp8 data shard {r} elements [{first}, {first + count})")
    # Whole-group stages: scales (tile amaxes over decades, zero tiles, a NaN-free amax per parameter)
    # and the grouped transposes.
    tile_amax = rng.uniform(0, 1, tiles).astype(np.float32) * 10.0 ** rng.uniform(-6, 4, tiles).astype(np.float32)
    tile_amax[rng.random(tiles) < 0.1] = 0
    amax = np.stack([tile_amax[row.tile_base:row.tile_base + row.numel // 256].max()
                     for row in gtable.rows_of(table)]).astype(np.float32)
    amax[0] = 0   # degenerate amax: scale 1
    a, b = (_jitted(ops.nvfp4_group_scale, table=table, impl=i)(jnp.asarray(tile_amax), jnp.asarray(amax))
            for i in impl_pair)
    assert_bytes_equal(b[0], a[0], "group scale_inv")
    assert_bytes_equal(b[1], a[1], "group enc")
    sizes = gtable.sizes(table)
    data = jnp.asarray(rng.integers(0, 256, sizes.data_bytes).astype(np.uint8))
    a, b = (_jitted(ops.nvfp4_group_columnwise, table=table, impl=i)(data, a[0]) for i in impl_pair)
    _assert_each_equal(b[0], a[0], "group data_t")
    _assert_each_equal(b[1], a[1], "group scale_inv_t")
    raw = jnp.asarray(rng.integers(0, 256, num_shards * n).astype(np.uint8))
    a, b = (_jitted(ops.fp8_group_transpose, table=table, impl=i)(raw) for i in impl_pair)
    _assert_each_equal(b, a, "fp8 group transpose")


@pytest.mark.parametrize("num_params", [300, 1100])
@pytest.mark.slow
@pytest.mark.extended   # on the CPU 96 parameters, one handler loop: test_group_ops_custom_call_equals_reference
def test_group_stats_and_casts_many_params_equal_reference(num_params):
    """Many small parameters at odd offsets over 3 shards: the GPU kernels find each thread's
    parameter in a shared-memory copy of the table column up to 1,024 parameters (300) and in the
    global table beyond (1,100); stats and casts equal the reference either way. The two sizes differ only in the
    GPU kernels: elsewhere one handler loops over the table for any count, so 96 parameters stand for both there."""
    if jax.default_backend() != "gpu":
        if num_params > 1024:
            pytest.skip("the global-table branch (> 1,024 parameters) is the GPU kernels'; 96 run on the CPU")
        num_params = 96
    rng = np.random.default_rng(num_params)
    num_shards = 3
    shapes, offsets, n = _layout(rng, num_params, num_shards, True)
    flat = _flat(rng, shapes, offsets, num_shards, n)
    flat[offsets[-1] + 1] = np.nan
    table = ops.group_table(offsets, shapes, num_shards=num_shards, shard_size=n, nvfp4=True)
    los, _, size = _chunk_plan(shapes, offsets, num_shards, n)
    tiles = int(table[:, FIELD["numel"]].sum() // 256)
    enc = jnp.asarray(rng.uniform(0.25, 8.0, tiles).astype(np.float32))
    scale = jnp.asarray(rng.uniform(0.25, 8.0, num_params).astype(np.float32))
    kw = dict(table=table, num_shards=num_shards, compute_dtype=jnp.bfloat16)
    impl_pair = ("reference", "custom_call")
    # On the CPU each op is jitted once per implementation, the shard index an operand (one compile for the three
    # shards instead of the reference's per-parameter ops dispatched one by one); on GPU, eager: 300 and 1,100
    # parameters would make one very large program.
    bind = _jitted if jax.default_backend() != "gpu" else functools.partial
    both = lambda op, **opts: {i: bind(op, impl=i, **kw, **opts) for i in impl_pair}
    tile_amax = both(ops.nvfp4_group_tile_amax, return_nonfinite=True)
    cast = both(ops.nvfp4_group_cast, chunk_lo=los, chunk_size=size)
    amax = both(ops.fp8_group_amax, return_nonfinite=True)
    pieces = ((0, n), (16 * (n // 48), n - 16 * (n // 48)))
    fp8_cast = {piece: both(ops.fp8_group_cast, first=piece[0], count=piece[1]) for piece in pieces}
    for r in range(num_shards):
        shard, index = jnp.asarray(flat[r * n:(r + 1) * n]), jnp.int32(r)
        a, b = (tile_amax[i](shard, index) for i in impl_pair)
        for name, x, y in zip(("tile amax", "amax", "counts"), b, a):
            assert_bytes_equal(x, y, f"{name} shard {r}")
        a, b = (cast[i](shard, index, enc) for i in impl_pair)
        assert_bytes_equal(b, a, f"nvfp4 chunk shard {r}")
        a, b = (amax[i](shard, index) for i in impl_pair)
        assert_bytes_equal(b[0], a[0], f"fp8 amax shard {r}")
        assert_bytes_equal(b[1], a[1], f"fp8 counts shard {r}")
        for first, count in pieces:
            a, b = (fp8_cast[first, count][i](shard, index, scale) for i in impl_pair)
            assert_bytes_equal(b, a, f"fp8 data shard {r} elements [{first}, {first + count})")


def _assert_each_equal(got, want, what):
    """Per-parameter results (lists) equal byte for byte."""
    assert len(got) == len(want), what
    for p, (g, w) in enumerate(zip(got, want)):
        assert_bytes_equal(g, w, f"{what} of param {p}")


@pytest.mark.parametrize("gap", [0, 3])
def test_fp8_group_transpose_any_shape(gap):
    """FP8 weights have any shape: blocks cut by the weight's edge, rows or columns that are not
    multiples of the vector widths, rank-1 parameters (numel x 1), odd offsets; the custom call
    equals the reference byte for byte, one [cols, rows] array per parameter."""
    rng = np.random.default_rng(5 + gap)
    shapes = [(64, 64), (65, 63), (3, 200), (200,), (128, 136), (1, 1), (130, 8), (16, 24), (96, 40)]
    offsets, pos = [], gap
    for shape in shapes:
        offsets.append(pos)
        pos += int(np.prod(shape)) + gap
    table = ops.group_table(offsets, shapes, num_shards=1, shard_size=pos + 5, nvfp4=False)
    raw = jnp.asarray(rng.integers(0, 256, pos + 5).astype(np.uint8))
    a, b = (ops.fp8_group_transpose(raw, table=table, impl=i) for i in ("reference", "custom_call"))
    _assert_each_equal(b, a, "fp8 group transpose")
    for got, off, shape in zip(b, offsets, shapes):
        m, k = shape if len(shape) == 2 else (shape[0], 1)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(raw)[off:off + m * k].reshape(m, k).T)


def _gathered(rng, space, num_shards, num_pieces, aligned):
    """``space`` (uint8) cut into shard parts and gather pieces as the master-weight step lays them
    out (gtable.GatheredSpace): random part boundaries (multiples of 8 when ``aligned``, with an
    empty shard from 3 shards on), a chunk longer than the longest part, and random bytes wherever a
    piece holds no byte of the space (the transposes must not read them)."""
    size, unit = space.size, 8 if aligned else 1
    lo = [0] + sorted(int(c) * unit for c in rng.integers(0, size // unit + 1, num_shards - 1))
    if num_shards >= 3:
        lo[2] = lo[1]
    ends = lo[1:] + [size]
    chunk = max(e - a for a, e in zip(lo, ends)) + int(rng.integers(0, 3)) * unit
    step = -(-chunk // num_pieces)
    step = -(-step // 128) * 128 if aligned else step
    bounds = tuple((s, min(step, chunk - s)) for s in range(0, chunk, step)) or ((0, 0),)
    pieces = []
    for start, length in bounds:
        piece = rng.integers(0, 256, num_shards * length).astype(np.uint8)
        for r, (a, e) in enumerate(zip(lo, ends)):
            o0, o1 = start, min(start + length, e - a)
            if o0 < o1:
                piece[r * length:r * length + o1 - o0] = space[a + o0:a + o1]
        pieces.append(jnp.asarray(piece))
    return pieces, gtable.GatheredSpace(size=size, chunk=chunk, lo=tuple(lo), bounds=bounds)


@pytest.mark.parametrize("num_shards,num_pieces,aligned", [(1, 1, True), (2, 4, True), (3, 3, False), (8, 5, False),
                                                           (4, 16, True)])
@pytest.mark.slow
def test_group_transposes_read_gathered_pieces(num_shards, num_pieces, aligned):
    """The grouped transposes read the space from gather pieces (shard parts at any byte, an empty
    shard, odd piece steps, junk past every part) and give the bytes of the assembled space, custom
    call and reference."""
    rng = np.random.default_rng(100 * num_shards + num_pieces)
    shapes = [(256, 512), (16, 48), (64, 160), (128, 64)]
    offsets = list(np.cumsum([0] + [m * k for m, k in shapes[:-1]]))
    total = sum(m * k for m, k in shapes)
    table = ops.group_table(offsets, shapes, num_shards=1, shard_size=total, nvfp4=True)
    sizes = gtable.sizes(table)
    scale_inv = jnp.asarray(rng.integers(0, 256, sizes.scale_bytes).astype(np.uint8))
    space = rng.integers(0, 256, sizes.data_bytes).astype(np.uint8)
    pieces, spread = _gathered(rng, space, num_shards, num_pieces, aligned)
    np.testing.assert_array_equal(np.asarray(spread.assemble(pieces)), space)
    want = ops.nvfp4_group_columnwise(jnp.asarray(space), scale_inv, table=table, impl="reference")
    for impl in ("reference", "custom_call"):
        got = ops.nvfp4_group_columnwise(pieces, scale_inv, table=table, space=spread, impl=impl)
        _assert_each_equal(got[0], want[0], f"data_t from pieces ({impl})")
        _assert_each_equal(got[1], want[1], f"scale_inv_t from pieces ({impl})")
    fp8_shapes = [(64, 64), (65, 63), (200,), (128, 136), (3, 200)]
    fp8_offsets, pos = [], 3
    for shape in fp8_shapes:
        fp8_offsets.append(pos)
        pos += int(np.prod(shape)) + 3
    fp8_table = ops.group_table(fp8_offsets, fp8_shapes, num_shards=1, shard_size=pos, nvfp4=False)
    flat = rng.integers(0, 256, pos).astype(np.uint8)
    pieces, spread = _gathered(rng, flat, num_shards, num_pieces, aligned)
    want = ops.fp8_group_transpose(jnp.asarray(flat), table=fp8_table, impl="reference")
    for impl in ("reference", "custom_call"):
        got = ops.fp8_group_transpose(pieces, table=fp8_table, space=spread, impl=impl)
        _assert_each_equal(got, want, f"fp8 data_t from pieces ({impl})")


def test_group_transposes_reject_bad_pieces():
    shapes = [(32, 64)]
    table = ops.group_table([0], shapes, num_shards=1, shard_size=2048, nvfp4=True)
    scale_inv = jnp.zeros((gtable.sizes(table).scale_bytes,), jnp.uint8)
    space = gtable.GatheredSpace(size=1024, chunk=512, lo=(0, 512), bounds=((0, 256), (256, 256)))
    with pytest.raises(ValueError, match="gathered in 2 pieces, got 1"):
        ops.nvfp4_group_columnwise([jnp.zeros((1024,), jnp.uint8)], scale_inv, table=table, space=space)
    with pytest.raises(ValueError, match=r"data\[1\]: shape must be \(512,\)"):
        ops.nvfp4_group_columnwise([jnp.zeros((512,), jnp.uint8)] * 1 + [jnp.zeros((500,), jnp.uint8)], scale_inv,
                                   table=table, space=space)
    with pytest.raises(ValueError, match="space: holds 512 bytes, the table's data needs 1024"):
        ops.nvfp4_group_columnwise([jnp.zeros((512,), jnp.uint8)], scale_inv, table=table,
                                   space=gtable.GatheredSpace.whole(512))
    with pytest.raises(ValueError, match="data: has 1024 elements, the table's last parameter ends at 2048"):
        ops.fp8_group_transpose([jnp.zeros((512,), jnp.uint8)] * 2,
                                table=ops.group_table([0], shapes, num_shards=1, shard_size=2048, nvfp4=False),
                                space=space)
    many = gtable.GatheredSpace(size=1024, chunk=1024, lo=(0,), bounds=tuple((s, 32) for s in range(0, 1024, 32)))
    assert not many.readable_in_place
    with pytest.raises(ValueError, match="at most 128 shards and 16 gather pieces"):
        ops.nvfp4_group_columnwise([jnp.zeros((32,), jnp.uint8)] * 32, scale_inv, table=table, space=many)
    with pytest.raises(ValueError, match="equal steps"):
        gtable.GatheredSpace(size=1024, chunk=512, lo=(0, 512), bounds=((0, 256), (256, 200)))
    with pytest.raises(ValueError, match="must follow the previous one from 0"):
        gtable.GatheredSpace(size=1024, chunk=256, lo=(0, 512), bounds=((0, 256),))


def test_group_transpose_handlers_reject_bad_space():
    """The C++ checks behind the Python ones: a space whose shard parts or pieces do not fit."""
    shapes = [(32, 64)]
    table = ops.group_table([0], shapes, num_shards=1, shard_size=2048, nvfp4=False)
    words = int64_words(table)
    out = [jax.ShapeDtypeStruct((64, 32), jnp.uint8)]
    piece = jnp.zeros((2048,), jnp.uint8)
    ranges = np.array([0, 0, 1, 0], np.int64)
    call = lambda space, *ps, r=ranges, o=out: jax.block_until_ready(_ffi.call(
        "jq_fp8_group_transpose", o, words, *ps, ranges=r, space=np.asarray(space, np.int64)))
    call([2048, 2048, 2048, 0], piece)   # the plain buffer is fine
    with pytest.raises(Exception, match="ranges: must hold"):
        call([2048, 2048, 2048, 0], piece, r=np.array([0, 0], np.int64))
    with pytest.raises(Exception, match="one data_t per parameter"):
        call([2048, 2048, 2048, 0], piece, o=out * 2)
    with pytest.raises(Exception, match="shard 0's part must start"):
        call([2048, 2048, 2048, 5], piece)
    with pytest.raises(Exception, match="needs 2 gather pieces, got 1"):
        call([2048, 2048, 1024, 0], piece)
    with pytest.raises(Exception, match=r"pieces\[0\]: must be uint8 \[3072\]"):
        call([2048, 1024, 1024, 0, 1024, 2048], piece)


@pytest.mark.parametrize("impl", ["reference", "custom_call"])
@pytest.mark.fast_cases("custom_call")  # the other cases: slow
def test_group_ops_assemble_to_single_tensor_quantization(impl):
    """Max of the shards' statistics, then the chunks ORed into place == quantize_nvfp4 / quantize_fp8."""
    rng = np.random.default_rng(7)
    num_shards = 3
    shapes, offsets, n = _layout(rng, 3, num_shards, odd=True)
    flat = _flat(rng, shapes, offsets, num_shards, n)
    table = ops.group_table(offsets, shapes, num_shards=num_shards, shard_size=n, nvfp4=True)
    los, his, size = _chunk_plan(shapes, offsets, num_shards, n)
    kw = dict(table=table, num_shards=num_shards, impl=impl)
    shards = [(jnp.asarray(flat[r * n:(r + 1) * n]), jnp.int32(r)) for r in range(num_shards)]
    tile_amax, fp8_amax = _jitted(ops.nvfp4_group_tile_amax, **kw), _jitted(ops.fp8_group_amax, **kw)  # all shards
    stats = [tile_amax(s, i) for s, i in shards]
    tiles = jnp.max(jnp.stack([t for t, _ in stats]), axis=0)
    amax = jnp.max(jnp.stack([a for _, a in stats]), axis=0)
    amaxes = jnp.max(jnp.stack([fp8_amax(s, i) for s, i in shards]), axis=0)
    np.testing.assert_array_equal(amax, amaxes)
    scale_inv, enc = _jitted(ops.nvfp4_group_scale, table=table, impl=impl)(tiles, amax)
    space = np.zeros(int(table[:, FIELD["numel"]].sum() // 2), np.uint8)
    cast = _jitted(ops.nvfp4_group_cast, chunk_lo=los, chunk_size=size, **kw)
    for (s, i), lo, hi in zip(shards, los, his):
        chunk = np.asarray(cast(s, i, enc))
        space[lo:hi] |= chunk[:hi - lo]
    data_t, scale_inv_t = _jitted(ops.nvfp4_group_columnwise, table=table, impl=impl)(jnp.asarray(space), scale_inv)
    scale, _ = formats.fp8_scale_from_amax(amaxes, 448.0)
    cast = _jitted(ops.fp8_group_cast, **kw)
    fp8 = np.concatenate([np.asarray(cast(s, i, scale)).view(np.uint8) for s, i in shards])
    fp8_t = _jitted(ops.fp8_group_transpose, table=table, impl=impl)(jnp.asarray(fp8))
    for p, row in enumerate(gtable.rows_of(table)):
        m, k, off = row.rows, row.cols, row.offset
        w = jnp.asarray(flat[off:off + m * k].reshape(m, k))
        want = jq.quantize_nvfp4(w, compute_dtype=None, columnwise=True, impl="reference")
        got = space[row.byte_base:row.byte_base + m * k // 2].reshape(m, k // 2)
        assert_bytes_equal(got, want.data, f"nvfp4 data of param {p}")
        sr, sc = formats.nvfp4_scale_shape(m, k)
        assert_bytes_equal(scale_inv[row.scale_base:row.scale_base + sr * sc].reshape(sr, sc), want.scale_inv,
                           f"nvfp4 scale_inv of param {p}")
        assert_bytes_equal(data_t[p], want.data_t, f"nvfp4 data_t of param {p}")
        assert_bytes_equal(scale_inv_t[p], want.scale_inv_t, f"nvfp4 scale_inv_t of param {p}")
        want8 = jq.quantize_fp8(w, compute_dtype=None, columnwise=True, impl="reference")
        assert_bytes_equal(fp8[off:off + m * k].reshape(m, k), np.asarray(want8.data).view(np.uint8), f"fp8 {p}")
        assert_bytes_equal(fp8_t[p], np.asarray(want8.data_t).view(np.uint8), f"fp8 data_t {p}")


@pytest.mark.skipif("cpu" not in _ffi.built_platforms(), reason="needs the compiled CPU extension")
def test_group_table_fields_are_the_compiled_ones():
    """Python's field names are the ones csrc/jaxquant/group_table.h defines, in the same order (and
    the GatheredSpace limits those of gathered_space.h)."""
    import jaxquant._jaxquant_cpu as ext

    assert tuple(ext.group_table_fields()) == gtable.GROUP_TABLE_FIELDS
    assert tuple(ext.gathered_space_limits()) == (gtable.MAX_GATHER_PIECES, gtable.MAX_GATHER_SHARDS)
    table = ops.group_table([3, 600], [(16, 32), (48, 16)], num_shards=2, shard_size=700, nvfp4=True)
    assert table.shape == (2, len(gtable.GROUP_TABLE_FIELDS))
    second = gtable.rows_of(table)[1]
    assert (second.offset, second.numel, second.rows, second.cols) == (600, 768, 48, 16)
    assert (second.tile_base, second.byte_base, second.scale_base) == (2, 256, 128 * 4)
    assert second.scale_t_base == formats.round_up(32, 128) * formats.round_up(1, 4)
    assert second.block_base == 1


def test_group_table_rejects_bad_layouts():
    with pytest.raises(ValueError, match="offsets\\[1\\]"):
        ops.group_table([0, 100], [(16, 16), (16, 16)], num_shards=2, shard_size=512, nvfp4=True)
    with pytest.raises(ValueError, match="outside the flat buffer"):
        ops.group_table([0], [(32, 32)], num_shards=2, shard_size=256, nvfp4=True)
    with pytest.raises(ValueError, match="shapes\\[0\\]"):
        ops.group_table([0], [(20, 16)], num_shards=1, shard_size=512, nvfp4=True)
    with pytest.raises(ValueError, match="num_shards"):
        ops.group_table([0], [(16, 16)], num_shards=0, shard_size=512, nvfp4=True)


def test_fp8_group_cast_range_equals_slice_of_whole():
    table = ops.group_table([0, 300], [(16, 16), (16, 32)], num_shards=2, shard_size=500, nvfp4=False)
    shard = jnp.asarray(np.random.default_rng(0).standard_normal(500).astype(np.float32))
    scale = jnp.asarray([2.0, 0.5], jnp.float32)
    whole = ops.fp8_group_cast(shard, jnp.int32(1), scale, table=table, num_shards=2)
    part = ops.fp8_group_cast(shard, jnp.int32(1), scale, table=table, num_shards=2, first=128, count=200)
    assert_bytes_equal(part, whole[128:328], "range")
    for bad in (dict(first=-1), dict(first=400, count=200), dict(count=True)):
        with pytest.raises(ValueError, match="first|count"):
            ops.fp8_group_cast(shard, jnp.int32(1), scale, table=table, num_shards=2, **bad)


def test_group_ops_reject_bad_arguments():
    table = ops.group_table([0], [(16, 16)], num_shards=2, shard_size=128, nvfp4=True)
    shard = jnp.zeros((128,), jnp.float32)
    with pytest.raises(ValueError, match="shard: must have shape"):
        ops.nvfp4_group_tile_amax(jnp.zeros((16, 8)), jnp.int32(0), table=table, num_shards=2)
    with pytest.raises(TypeError, match="shard_index"):
        ops.nvfp4_group_tile_amax(shard, 0.5, table=table, num_shards=2)
    with pytest.raises(ValueError, match="table"):
        ops.fp8_group_amax(shard, jnp.int32(0), table=np.zeros((1, 5), np.int64), num_shards=2)
    with pytest.raises(ValueError, match="tile_amax: shape"):
        ops.nvfp4_group_scale(jnp.zeros((2,)), jnp.zeros((1,)), table=table)
    with pytest.raises(ValueError, match="amax: shape"):
        ops.nvfp4_group_scale(jnp.zeros((1,)), jnp.zeros((2,)), table=table)
    with pytest.raises(ValueError, match="data: shape"):
        ops.nvfp4_group_columnwise(jnp.zeros((7,), jnp.uint8), jnp.zeros((512,), jnp.uint8), table=table)
    with pytest.raises(TypeError, match="data: must be a rank-1"):
        ops.fp8_group_transpose(jnp.zeros((256,), jnp.float32), table=table)
    with pytest.raises(ValueError, match="enc: shape"):
        ops.nvfp4_group_cast(shard, jnp.int32(0), jnp.zeros((3,)), table=table, num_shards=2, chunk_lo=[0, 64],
                             chunk_size=64)
    with pytest.raises(ValueError, match="chunk_lo"):
        ops.nvfp4_group_cast(shard, jnp.int32(0), jnp.zeros((1,)), table=table, num_shards=2, chunk_lo=[0],
                             chunk_size=64)
    with pytest.raises(ValueError, match="scale: shape"):
        ops.fp8_group_cast(shard, jnp.int32(0), jnp.zeros((2,)), table=table, num_shards=2)
    with pytest.raises(ValueError, match="impl"):
        ops.fp8_group_cast(shard, jnp.int32(0), jnp.zeros((1,)), table=table, num_shards=2, impl="fast")


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="the CPU handler reads the index on the host; GPU kernels treat it as owning nothing")
def test_group_handler_rejects_out_of_range_shard_index_on_cpu():
    table = ops.group_table([0], [(16, 16)], num_shards=2, shard_size=128, nvfp4=True)
    with pytest.raises(Exception, match="shard_index"):
        jax.block_until_ready(ops.nvfp4_group_cast(jnp.zeros((128,)), jnp.int32(5), jnp.zeros((1,)), table=table,
                                                   num_shards=2, chunk_lo=[0, 64], chunk_size=64,
                                                   impl="custom_call"))


# ----------------------------------------------------------------------------------------------
# group_split: every per-parameter output from the packed vectors in one call
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", pytest.param("custom_call", marks=pytest.mark.skipif(
    not _ffi.built_platforms(), reason="needs the compiled extension"))])
def test_group_split_equals_slices(impl):
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, 400_003).astype(np.uint8)
    small = rng.integers(0, 256, 333).astype(np.uint8)
    f32 = rng.standard_normal(37).astype(np.float32)
    pieces = [((10, 7), ((0, 3, 70),)),                      # unaligned start: byte path
              ((2,), ((1, 5, 2),)),                          # fp32 elements
              ((), ((1, 36, 1),)),                           # a scalar
              ((4, 50), ((0, 900, 100), (2, 0, 100))),       # two segments from two sources
              ((300_000,), ((0, 64, 300_000),)),             # aligned: 16-byte vectors, four in flight
              ((17,), ((2, 316, 17),))]                      # ends at the source's end
    want = [big[3:73].reshape(10, 7), f32[5:7], f32[36], np.concatenate([big[900:1000], small[:100]]).reshape(4, 50),
            big[64:300_064], small[316:333]]
    got = jax.jit(lambda a, b, c: ops.group_split([a, b, c], pieces, impl=impl))(
        jnp.asarray(big), jnp.asarray(f32), jnp.asarray(small))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_bytes_equal(np.asarray(g), w)



@pytest.mark.parametrize("impl", ["reference", pytest.param("custom_call", marks=pytest.mark.skipif(
    not _ffi.built_platforms(), reason="needs the compiled extension"))])
@pytest.mark.fast_cases("custom_call")  # the other cases: slow
def test_group_split_many_segments_equals_slices(impl):
    """2,101 results (more than one GPU launch's 1,000 segments: three launches), each a segment or
    two at random offsets: tiny ones, ones crossing the kernel's 32 KiB chunks at offsets that do
    and do not agree modulo 16 with their destination, and a 2-segment result whose pieces come from
    two sources; every result equals its slices. The reference (slices, no launches) runs the first 701 of
    them: every kind of result, at a third of the compile time."""
    rng = np.random.default_rng(21)
    src = [rng.integers(0, 256, 3_000_003).astype(np.uint8), rng.integers(0, 256, 50_001).astype(np.uint8)]
    pieces, want = [], []
    for r in range(2_101 if impl == "custom_call" else 701):
        kind = r % 7
        if kind == 6:                                   # two segments from both sources
            a, b = int(rng.integers(1, 3_000)), int(rng.integers(1, 3_000))
            oa, ob = int(rng.integers(0, len(src[0]) - a)), int(rng.integers(0, len(src[1]) - b))
            pieces.append(((a + b,), ((0, oa, a), (1, ob, b))))
            want.append(np.concatenate([src[0][oa:oa + a], src[1][ob:ob + b]]))
            continue
        n = int(rng.integers(70_000, 140_000)) if kind == 0 else int(rng.integers(1, 48))
        off = int(rng.integers(0, len(src[0]) - n))
        if kind == 0 and r % 2:
            off -= off % 16                             # vectors: 16-byte aligned source
        pieces.append(((n,), ((0, off, n),)))
        want.append(src[0][off:off + n])
    got = jax.jit(lambda a, b: ops.group_split([a, b], pieces, impl=impl))(*map(jnp.asarray, src))
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, r
        assert_bytes_equal(np.asarray(g), w, f"result {r}")

def test_group_split_rejects_bad_pieces():
    a, b = jnp.zeros(10, jnp.uint8), jnp.zeros(4, jnp.float32)
    with pytest.raises(ValueError, match=r"pieces\[0\].*one dtype"):
        ops.group_split([a, b], [((2,), ((0, 0, 1), (1, 0, 1)))])
    with pytest.raises(ValueError, match=r"pieces\[0\].*needs 3"):
        ops.group_split([a], [((3,), ((0, 0, 2),))])
    with pytest.raises(ValueError, match=r"pieces\[1\].*outside the sources"):
        ops.group_split([a], [((2,), ((0, 0, 2),)), ((4,), ((0, 8, 4),))])


@pytest.mark.skipif(jax.default_backend() != "cpu" or "cpu" not in _ffi.built_platforms(),
                    reason="calls the CPU handler directly with a bad plan")
def test_group_split_handler_rejects_bad_plan():
    a = jnp.zeros(8, jnp.uint8)
    out = [jax.ShapeDtypeStruct((4,), jnp.uint8)]
    for partial in (False, True):
        with pytest.raises(Exception, match="reads or writes outside"):
            jax.block_until_ready(_ffi.call("jq_group_split", out, a, plan=np.array([0, 0, 0, 6, 4], np.int64),
                                            partial=partial))
    with pytest.raises(Exception, match="result 0 gets 2 bytes"):
        jax.block_until_ready(_ffi.call("jq_group_split", out, a, plan=np.array([0, 0, 0, 0, 2], np.int64),
                                        partial=False))
    with pytest.raises(Exception, match="result 0 gets 6 bytes"):   # a stage may cover less, never more
        jax.block_until_ready(_ffi.call("jq_group_split", out, a, plan=np.array([0, 0, 0, 0, 3, 0, 1, 0, 0, 3],
                                                                                np.int64), partial=True))


@pytest.mark.parametrize("impl", [
    pytest.param("custom_call",
                 marks=pytest.mark.skipif(not _ffi.built_platforms(), reason="no jaxquant extension built")),
    "reference"])
def test_group_split_stages_same_bytes(rng, impl):
    """Staged copies (one call per stage, results aliased from one call to the next) give the bytes
    of one call, with results spread over sources of several stages, and one call per stage."""
    srcs = [jnp.asarray(rng.integers(0, 256, n, dtype=np.uint8)) for n in (40, 24, 32)]
    srcs.append(jnp.asarray(rng.standard_normal(6).astype(np.float32)))
    pieces = [((2, 8), ((0, 0, 10), (1, 3, 6))),          # stages 0 and 1
              ((5,), ((2, 1, 5),)),                         # stage 2 only
              ((3, 3), ((1, 12, 4), (0, 30, 2), (2, 20, 3))),  # all three
              ((2,), ((3, 1, 2),))]                         # an fp32 result (stage 0)
    single = jax.jit(lambda *s: ops.group_split(s, pieces, impl=impl))(*srcs)
    staged_fn = jax.jit(lambda *s: ops.group_split(s, pieces, stage_of_source=[0, 1, 2, 0], impl=impl))
    staged = staged_fn(*srcs)
    ref = reference.group_split(srcs, pieces)
    for a, b, c in zip(staged, single, ref):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    if impl == "custom_call":
        assert staged_fn.lower(*srcs).as_text().count("stablehlo.custom_call @jq_group_split") == 3
    with pytest.raises(ValueError, match="stage_of_source: one stage per source"):
        ops.group_split(srcs, pieces, stage_of_source=[0, 1], impl=impl)
