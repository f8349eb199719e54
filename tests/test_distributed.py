"""quantize_master_weights on simulated CPU devices: bit-exact against single-tensor quantization.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set here when not set already).
"""

import functools
import os
import re
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxquant as jq
from jaxquant.zero import distributed as D
from jaxquant.primitives import ops
from jaxquant.primitives.ops import table as gtable
from jaxquant.zero.group_split import GatheredWeights
from support.meshes import fsdp_tp_mesh
from jaxquant.zero.layout import FlatLayout
from jaxquant.primitives.quantize import quantize_fp8, quantize_nvfp4
from jaxquant.primitives.tensors import NVFP4Tensor

IMPL = os.environ.get("JAXQUANT_TEST_IMPL", "auto")

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices: "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _weights(rng, shapes):
    out = []
    for m, k in shapes:
        w = rng.standard_normal((m, k)).astype(np.float32)
        # per-tile magnitudes over several decades, and some all-zero tiles
        mag = 10.0 ** rng.uniform(-4, 3, size=(m // 16, 1, k // 16, 1))
        mag[rng.random(mag.shape) < 0.1] = 0
        out.append((w.reshape(m // 16, 16, k // 16, 16) * mag).reshape(m, k).astype(np.float32))
    return out


def _random_shapes(rng, n):
    return [(16 * int(rng.integers(1, 7)), 16 * int(rng.choice([1, 2, 3, 5, 6]))) for _ in range(n)]


def _put(layout, ws, mesh):
    return jax.device_put(layout.flatten(ws), NamedSharding(mesh, P("fsdp")))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _reference_jit(w, recipe, columnwise):
    fn = quantize_nvfp4 if recipe == "nvfp4" else quantize_fp8
    return fn(w, compute_dtype=jnp.bfloat16, columnwise=columnwise, impl="reference")


def _reference(w, recipe, columnwise=False):
    """Single-tensor quantization of the whole weight (the contract), jitted: eager is slow."""
    return _reference_jit(jnp.asarray(w), recipe, columnwise)


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _assert_same(q, ref):
    assert type(q) is type(ref)
    if isinstance(q, NVFP4Tensor):
        assert q.shape == ref.shape
    for name in ("data", "scale_inv", "amax", "data_t") + (("scale_inv_t",) if isinstance(q, NVFP4Tensor) else ()):
        a, b = getattr(q, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg=name)


def _run_and_compare(layout, ws, mesh, recipe, **kw):
    out = D.quantize_master_weights(_put(layout, ws, mesh), layout, mesh=mesh, recipe=recipe, impl=IMPL, **kw)
    assert len(out) == len(ws)
    for q, w in zip(out, ws):
        _assert_same(q, _reference(w, recipe))
    return out


# ----------------------------------------------------------------------------------------------
# bit-exactness over layouts
# ----------------------------------------------------------------------------------------------


def _layout(kind, shapes, S, rng):
    if kind == "align1":
        return FlatLayout(shapes, S)
    if kind == "align128":
        return FlatLayout(shapes, S, align=128)
    if kind == "sparse":        # big alignment: some shards own only padding
        return FlatLayout(shapes, S, align=2048)
    if kind == "odd":           # odd parameter offsets: packed bytes misaligned with the flat stream
        offs, pos = [], 0
        for m, k in shapes:
            pos += int(rng.integers(0, 4)) | 1
            offs.append(pos)
            pos += m * k
        return FlatLayout.from_param_offsets(shapes, offs, S)
    if kind == "te":            # random gaps, then rebuilt from TransformerEngine-style start offsets
        offs, pos = [], 0
        for m, k in shapes:
            pos += int(rng.integers(0, 300))
            offs.append(pos)
            pos += m * k
        lay = FlatLayout.from_param_offsets(shapes, offs, S)
        te = [lay.te_start_offsets(r) for r in range(S)]
        return FlatLayout.from_start_offsets(shapes, [t[0] for t in te], [t[1] for t in te])
    raise ValueError(kind)


CASES = [  # (S, layout kind, number of params, seed)
    (1, "align1", 3, 0),
    (2, "align1", 3, 1),
    (3, "align1", 4, 2),
    (4, "align128", 3, 3),
    (8, "align1", 4, 4),
    (3, "odd", 3, 5),
    (8, "sparse", 3, 6),
    (4, "te", 4, 7),
    (8, "te", 3, 8),
]


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.parametrize("S,kind,n,seed", CASES)
@pytest.mark.fast_cases("3-odd-3-5-fp8", "8-te-3-8-nvfp4")  # the other cases: slow
def test_bit_exact(S, kind, n, seed, recipe):
    rng = np.random.default_rng(seed)
    shapes = _random_shapes(rng, n)
    layout = _layout(kind, shapes, S, rng)
    _run_and_compare(layout, _weights(rng, shapes), fsdp_tp_mesh(S), recipe)


def test_cases_cover_the_hard_layouts():
    """The CASES above do hit odd boundaries, shared bytes, many-shard params and empty shards."""
    odd_start = shared_byte = many_owners = empty_shard = one_owner = False
    for S, kind, n, seed in CASES:
        rng = np.random.default_rng(seed)
        shapes = _random_shapes(rng, n)
        lay = _layout(kind, shapes, S, rng)
        for r in range(S):
            empty_shard |= not lay.pieces(r)
            for pc in lay.pieces(r):
                odd_start |= pc.start % 2 == 1
                shared_byte |= pc.start % 2 == 1 and pc.start > 0
        for p in range(lay.num_params):
            many_owners |= len(lay.owners(p)) >= 3
            one_owner |= len(lay.owners(p)) == 1
        odd_start |= any(o % 2 for o in lay.param_offsets)
    assert odd_start and shared_byte and many_owners and empty_shard and one_owner


@pytest.mark.slow
def test_tp_mesh_and_columnwise():
    """Mesh with another axis ('tp', replicated), columnwise data built automatically."""
    rng = np.random.default_rng(10)
    shapes = [(32, 48), (16, 80), (48, 16)]
    ws = _weights(rng, shapes)
    mesh = fsdp_tp_mesh(4, tp=2)
    layout = FlatLayout(shapes, 4)
    for recipe in ("nvfp4", "fp8"):
        out = D.quantize_master_weights(_put(layout, ws, mesh), layout, mesh=mesh, recipe=recipe, impl=IMPL,
                                        columnwise=True, manual_post_all_gather_processing=False)
        for q, w in zip(out, ws):
            _assert_same(q, _reference(w, recipe, columnwise=True))


@pytest.mark.slow
def test_manual_post_all_gather_processing():
    rng = np.random.default_rng(11)
    shapes = [(16, 48), (32, 32)]
    ws = _weights(rng, shapes)
    mesh = fsdp_tp_mesh(2)
    layout = FlatLayout(shapes, 2)
    out = D.quantize_master_weights(_put(layout, ws, mesh), layout, mesh=mesh, impl=IMPL, columnwise=True)
    assert all(q.data_t is None and q.scale_inv_t is None for q in out)
    out = jax.jit(lambda ws: D.post_all_gather_processing(ws, impl=IMPL))(out)
    for q, w in zip(out, ws):
        _assert_same(q, _reference(w, "nvfp4", columnwise=True))
    assert D.post_all_gather_processing(out[0], impl=IMPL) is out[0]
    out = D.quantize_master_weights(_put(layout, ws, mesh), layout, mesh=mesh, recipe="fp8", impl=IMPL,
                                    columnwise=True)
    out = D.post_all_gather_processing(out, impl=IMPL)      # one grouped transpose for the list
    for q, w in zip(out, ws):
        _assert_same(q, _reference(w, "fp8", columnwise=True))


@pytest.mark.slow
def test_compute_dtype_none_and_fp8_options():
    rng = np.random.default_rng(12)
    shapes = [(16, 16), (32, 48)]
    ws = _weights(rng, shapes)
    mesh = fsdp_tp_mesh(3)
    layout = FlatLayout(shapes, 3)
    flat = _put(layout, ws, mesh)
    out = D.quantize_master_weights(flat, layout, mesh=mesh, compute_dtype=None, impl=IMPL)
    for q, w in zip(out, ws):
        _assert_same(q, jax.jit(lambda w: quantize_nvfp4(w, compute_dtype=None, impl="reference"))(w))
    out = D.quantize_master_weights(flat, layout, mesh=mesh, recipe="fp8", fp8_dtype=jnp.float8_e5m2,
                                    amax_epsilon=1e-3, force_pow_2_scales=True, impl=IMPL)
    for q, w in zip(out, ws):
        _assert_same(q, jax.jit(lambda w: quantize_fp8(
            w, dtype=jnp.float8_e5m2, amax_epsilon=1e-3, force_pow_2_scales=True,
            compute_dtype=jnp.bfloat16, impl="reference"))(w))


@pytest.mark.slow
def test_per_device_form_in_user_shard_map():
    rng = np.random.default_rng(13)
    shapes = [(16, 80), (32, 16)]
    ws = _weights(rng, shapes)
    mesh = fsdp_tp_mesh(4, tp=2)
    layout = FlatLayout(shapes, 4)

    @jax.jit
    def step(flat):
        def body(shard):
            q, rep = D.quantize_master_weights_local(shard * 2, layout, axis="fsdp", check_finite=True, impl=IMPL)
            return q, rep
        # check_vma (the default) holds: custom-call results vary over the axes their inputs vary over
        return jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P())(flat)

    out, rep = step(_put(layout, ws, mesh))
    assert rep.counts.shape == (4, 2) and not bool(rep.any())
    for q, w in zip(out, ws):
        _assert_same(q, _reference(w * 2, "nvfp4"))


# ----------------------------------------------------------------------------------------------
# non-finite check
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.fast_cases("fp8")  # the other cases: slow
def test_check_finite(recipe):
    shapes = [(16, 32), (32, 48), (16, 16)]
    layout = FlatLayout(shapes, 4, names=["wq", "wk", "wv"])
    ws = [np.ones(s, np.float32) for s in shapes]
    ws[1][0, 0] = np.nan                   # wk element 0     -> shard of flat 512
    ws[1][31, 47] = np.inf                 # wk last element  -> flat 512+1535
    ws[2][3, 3] = -np.inf
    ws[2][3, 4] = np.nan
    mesh = fsdp_tp_mesh(4)
    out, rep = D.quantize_master_weights(_put(layout, ws, mesh), layout, mesh=mesh, recipe=recipe,
                                         check_finite=True, impl=IMPL)
    counts = np.asarray(rep.counts)
    expect = np.zeros((4, 3), np.int32)
    n = layout.shard_size
    for p, flat_idx in [(1, 512), (1, 512 + 1535), (2, 2048 + 3 * 16 + 3), (2, 2048 + 3 * 16 + 4)]:
        expect[flat_idx // n, p] += 1
    np.testing.assert_array_equal(counts, expect)
    assert bool(rep.any())
    with pytest.raises(FloatingPointError, match=r"wk in shard 0: 1 element.*wk in shard 3: 1 .*wv in shard 3: 2"):
        rep.raise_if_nonfinite()
    # one entry point for both reports: jq.raise_if_nonfinite(report) is the report's own method
    with pytest.raises(FloatingPointError) as by_method:
        rep.raise_if_nonfinite()
    with pytest.raises(FloatingPointError) as by_function:
        jq.raise_if_nonfinite(rep)
    assert str(by_function.value) == str(by_method.value)
    # finite weights are unaffected
    _assert_same(out[0], _reference(ws[0], recipe))
    # clean weights: no report, no error
    ws = [np.ones(s, np.float32) for s in shapes]
    _, rep = D.quantize_master_weights(_put(layout, ws, mesh), layout, mesh=mesh, recipe=recipe,
                                       check_finite=True, impl=IMPL)
    assert not bool(rep.any())
    rep.raise_if_nonfinite()
    jq.raise_if_nonfinite(rep)


# ----------------------------------------------------------------------------------------------
# compiled HLO: what travels
# ----------------------------------------------------------------------------------------------


def _collectives(hlo_text):
    gathers = re.findall(r"= (\w+)\[(\d+)\]\{0\} all-gather\((?:\w+)\[(\d+)\]", hlo_text)
    if not gathers:   # operand shapes are not always printed inline
        gathers = [(t, n, None) for t, n in re.findall(r"= (\w+)\[(\d+)\]\{0\} all-gather\(", hlo_text)]
    reduces = []   # (type, length, reduction) of every reduced vector; XLA may combine all-reduces into a tuple
    all_reduce = r"= \(?((?:\w+\[\d+\]\{0\}(?:, )?)+)\)? all-reduce\(.*to_apply=%?([\w.]+)"
    for shapes, comp in re.findall(all_reduce, hlo_text):
        reduces += [(t, n, comp) for t, n in re.findall(r"(\w+)\[(\d+)\]", shapes)]
    return gathers, reduces


def _reduction_is_max(hlo_text, comp):
    m = re.search(r"^%?" + re.escape(comp) + r" .*?\{(.*?)^\}", hlo_text, re.S | re.M)
    return m is not None and "maximum(" in m.group(1)


@pytest.mark.parametrize("check_finite", [False, True])
def test_hlo_nvfp4_gathers_half_numel_bytes_and_one_pmax(check_finite):
    # 4 shards of 1536 elements; boundaries at even elements, equal bytes per shard.
    shapes = [(32, 48), (16, 80), (48, 16), (64, 32), (16, 16), (16, 64)]
    numel = sum(m * k for m, k in shapes)
    S = 4
    layout = FlatLayout(shapes, S)
    assert layout.total_size == numel and D.gathered_bytes(layout) == numel // 2
    mesh = fsdp_tp_mesh(S)
    flat = _put(layout, [np.zeros(s, np.float32) for s in shapes], mesh)
    f = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, check_finite=check_finite, impl=IMPL))
    hlo = f.lower(flat).compile().as_text()
    gathers, reduces = _collectives(hlo)
    assert len(gathers) == 1, gathers
    dtype, out_len, _ = gathers[0]
    assert dtype == "u8" and int(out_len) == numel // 2          # sum over weights of numel/2 bytes
    # two reduced vectors (XLA:CPU combines them into one all-reduce): what the cast waits for (one amax
    # per parameter, the tiles cut by a shard boundary, the [S, P] non-finite block) and every tile amax
    n_tiles = sum(m * k // 256 for m, k in shapes)
    n_cut = len(D.cut_tiles(gtable.rows_of(D.layout_group_table(layout, True)), layout.shard_size, S))
    assert 0 < n_cut < n_tiles
    want = sorted([len(shapes) + n_cut + (S * len(shapes) if check_finite else 0), n_tiles])
    assert sorted(int(n) for _, n, _ in reduces) == want, reduces
    assert all(t == "s32" and _reduction_is_max(hlo, comp) for t, _, comp in reduces)
    assert "all-to-all" not in hlo and "collective-permute" not in hlo
    # No branch on the shard index: XLA:GPU runs a conditional with a device-to-host copy.
    assert " conditional(" not in hlo


def test_hlo_odd_layout_gather_size():
    """Odd boundaries: the gather carries gathered_bytes(layout): numel/2 plus the shared boundary
    bytes (each counted on both sides) and per-shard padding to the largest chunk."""
    shapes = [(16, 16), (16, 64)]                  # 1280 elements, 3 shards of 427
    layout = FlatLayout(shapes, 3)
    assert layout.shard_size == 427
    expect = D.gathered_bytes(layout)
    assert 640 < expect <= 640 + 3 * 2
    mesh = fsdp_tp_mesh(3)
    flat = _put(layout, [np.zeros(s, np.float32) for s in shapes], mesh)
    hlo = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, impl=IMPL)).lower(flat).compile().as_text()
    gathers, reduces = _collectives(hlo)
    assert [(g[0], int(g[1])) for g in gathers] == [("u8", expect)]
    assert len(reduces) == 2        # the cast's statistics, and every tile amax


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.parametrize("kind,S", [("align1", 4), ("odd", 3), ("te", 8)])
@pytest.mark.slow
def test_gather_pieces_same_bytes(kind, S, recipe):
    """Chunks cast and gathered in 3 pieces (and in 1) give the single-tensor bytes, rowwise (each
    weight read from the pieces) and columnwise (the transposes read the pieces where they lie; NVFP4
    with odd shard boundaries: the assembled space); one all-gather per piece and still one all-reduce."""
    rng = np.random.default_rng(20 + S)
    shapes = [(64, 96), (32, 80), (48, 64), (16, 160)]
    layout = _layout(kind, shapes, S, rng)
    size = D.nvfp4_chunks(layout).size if recipe == "nvfp4" else layout.shard_size
    assert len(D.gather_piece_bounds(size, 3)) == 3, size    # big enough for 3 pieces of >= 128 bytes
    ws = _weights(rng, shapes)
    mesh = fsdp_tp_mesh(S)
    flat = _put(layout, ws, mesh)
    for pieces in (1, 3):
        for columnwise in (False, True):
            f = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, recipe=recipe, columnwise=columnwise,
                                                            manual_post_all_gather_processing=False,
                                                            gather_pieces=pieces, impl=IMPL))
            lowered = f.lower(flat)
            gathers, reduces = _collectives(lowered.compile().as_text())
            assert len(gathers) == pieces and len(reduces) == (2 if recipe == "nvfp4" else 1), (gathers, reduces)
            if IMPL != "reference":   # weights and transposes read from the pieces: one split call a piece
                in_place = recipe == "fp8" or not D.nvfp4_chunks(layout).fix_pos
                text = lowered.as_text()
                assert _jaxquant_split_calls(text) == (pieces if in_place else 1), in_place
                if columnwise:
                    target = "jq_nvfp4_group_columnwise" if recipe == "nvfp4" else "jq_fp8_group_transpose"
                    inputs = _custom_call_operands(text, target)
                    assert inputs == (pieces if in_place else 1) + (2 if recipe == "nvfp4" else 1), inputs
            for q, w in zip(f(flat), ws):
                _assert_same(q, _reference(w, recipe, columnwise=columnwise))


def _jaxquant_split_calls(lowered_text) -> int:
    return lowered_text.count("stablehlo.custom_call @jq_group_split")


def _custom_call_operands(lowered_text, target) -> int:
    """Operand count of the one call of ``target`` in lowered StableHLO text."""
    [line] = [ln for ln in lowered_text.splitlines() if f"stablehlo.custom_call @{target}(" in ln]
    args = line.split(f"@{target}(", 1)[1].split(")", 1)[0]
    return len([a for a in args.split(",") if a.strip()])


def test_gather_piece_bounds():
    assert D.gather_piece_bounds(1000, 3) == ((0, 384), (384, 384), (768, 232))
    assert D.gather_piece_bounds(100, 3) == ((0, 100),)            # pieces of at least 128 bytes
    assert D.gather_piece_bounds(0) == ((0, 0),)
    assert D.gather_piece_bounds(1 << 30) == ((0, 1 << 30),)                 # default: one piece
    with pytest.raises(ValueError, match="gather_pieces"):
        D.quantize_master_weights(jnp.zeros(16 * 16), FlatLayout([(16, 16)], 1), mesh=fsdp_tp_mesh(1), gather_pieces=0)


def test_hlo_fp8_gathers_one_byte_per_element():
    shapes = [(32, 48), (16, 80)]
    layout = FlatLayout(shapes, 2)
    mesh = fsdp_tp_mesh(2)
    flat = _put(layout, [np.zeros(s, np.float32) for s in shapes], mesh)
    step = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, recipe="fp8", impl=IMPL))
    hlo = step.lower(flat).compile().as_text()
    gathers, reduces = _collectives(hlo)
    assert [(g[0], int(g[1])) for g in gathers] == [("u8", layout.total_size)]
    assert len(reduces) == 1 and reduces[0][0] == "s32" and int(reduces[0][1]) == 2


# ----------------------------------------------------------------------------------------------
# jit with donation
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_jit_donating_previous_weights():
    rng = np.random.default_rng(14)
    shapes = [(32, 48), (16, 16)]
    layout = FlatLayout(shapes, 2)
    mesh = fsdp_tp_mesh(2)
    ws = _weights(rng, shapes)
    flat = _put(layout, ws, mesh)

    def step(master, old_weights):
        del old_weights  # its buffers are reused for the new weights
        master = master * 0.5
        return master, D.quantize_master_weights(master, layout, mesh=mesh, impl=IMPL)

    # keep_unused=True: an argument the body never reads is otherwise pruned, and with it the donation
    step = jax.jit(step, donate_argnums=(1,), keep_unused=True)
    weights = D.quantize_master_weights(flat, layout, mesh=mesh, impl=IMPL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # "donated buffers were not usable" would fail
        for _ in range(2):
            old = weights
            flat, weights = step(flat, weights)
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    for q, w in zip(weights, ws):
        _assert_same(q, _reference(w * 0.25, "nvfp4"))


# ----------------------------------------------------------------------------------------------
# argument errors
# ----------------------------------------------------------------------------------------------


def test_errors():
    mesh = fsdp_tp_mesh(2)
    layout = FlatLayout([(16, 32)], 2)
    flat = _put(layout, [np.zeros((16, 32), np.float32)], mesh)
    with pytest.raises(ValueError, match="axis"):
        D.quantize_master_weights(flat, layout, mesh=mesh, axis="dp")
    with pytest.raises(ValueError, match="layout: has 4 shards"):
        D.quantize_master_weights(flat, FlatLayout([(16, 32)], 4), mesh=mesh)
    with pytest.raises(ValueError, match="master_flat: shape"):
        D.quantize_master_weights(flat[:-2], layout, mesh=mesh)
    with pytest.raises(TypeError, match="master_flat: dtype"):
        D.quantize_master_weights(flat.astype(jnp.int32), layout, mesh=mesh)
    with pytest.raises(ValueError, match="recipe"):
        D.quantize_master_weights(flat, layout, mesh=mesh, recipe="mxfp8")
    bad = FlatLayout([(16, 24)], 2)
    with pytest.raises(ValueError, match=r"multiple of 16"):
        D.quantize_master_weights(jnp.zeros(bad.total_size), bad, mesh=mesh)
    with pytest.raises(ValueError, match="rank 2"):
        D.quantize_master_weights(jnp.zeros(256), FlatLayout([(256,)], 2), mesh=mesh)
    with pytest.raises(TypeError, match="compute_dtype"):
        D.quantize_master_weights(flat, layout, mesh=mesh, compute_dtype=jnp.float16)
    with pytest.raises(ValueError, match="impl"):
        D.quantize_master_weights(flat, layout, mesh=mesh, impl="cuda")
    with pytest.raises(TypeError, match="weights"):
        D.post_all_gather_processing([jnp.zeros(3)])


def test_explicit_axis_mesh_and_unsharded_input():
    """jax.make_mesh gives Explicit axes; a host (unsharded) master buffer is resharded to P(axis)."""
    mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), devices=jax.devices()[:4])
    rng = np.random.default_rng(15)
    shapes = [(16, 48), (32, 16)]
    ws = _weights(rng, shapes)
    layout = FlatLayout(shapes, 2)
    out = D.quantize_master_weights(layout.flatten(ws), layout, mesh=mesh, impl=IMPL)
    for q, w in zip(out, ws):
        _assert_same(q, _reference(w, "nvfp4"))


# ----------------------------------------------------------------------------------------------
# FSDP x TP (2-D master weights)
# ----------------------------------------------------------------------------------------------


def _tp_shapes(tp):
    """(shape, tp_dims, aligned) per parameter: aligned and unaligned splits of both kinds, and a
    parameter replicated over TP."""
    return [((tp * 128, 32), 0, True), ((32, tp * 128), 1, True), ((48, 80), None, True),
            ((tp * 16, 48), 0, tp == 1), ((16, tp * 16), 1, tp == 1)]


@functools.partial(jax.jit, static_argnums=(2,))
def _nvfp4_slice_reference(w, amax, columnwise):
    """TE's quantization of a TP rank's slice with the shared global amax."""
    tiles, _, _ = ops.nvfp4_stats(w, impl="reference")
    return ops.nvfp4_quantize(w, tiles, amax, columnwise=columnwise, impl="reference")


def _assert_tp_weight(q, w, recipe, tp_dim, aligned, tp, columnwise):
    if recipe == "fp8" or tp_dim is None or aligned:
        _assert_same(q, _reference(w, recipe, columnwise))
        return
    np.testing.assert_array_equal(q.amax, _reference(w, recipe).amax)
    names = ("data", "scale_inv") + (("data_t", "scale_inv_t") if columnwise else ())
    parts = {n: np.split(np.asarray(getattr(q, n)), tp, axis=tp_dim if n in ("data", "scale_inv") else 1 - tp_dim)
             for n in names}
    for j, wj in enumerate(np.split(np.asarray(w), tp, axis=tp_dim)):
        want = dict(zip(("data", "scale_inv", "data_t", "scale_inv_t"),
                        _nvfp4_slice_reference(jnp.asarray(wj), q.amax, columnwise)))
        for n in names:
            np.testing.assert_array_equal(parts[n][j], np.asarray(want[n]), err_msg=f"{n} of TP rank {j}")


@pytest.mark.parametrize("align", [1, 3])
@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.parametrize("fsdp,tp", [(8, 1), (4, 2), (2, 4), (1, 8)])
@pytest.mark.fast_cases("4-2-fp8-1")  # the other cases: slow
def test_fsdp_tp_bytes(fsdp, tp, recipe, align):
    rng = np.random.default_rng(100 * fsdp + tp + align)
    spec = _tp_shapes(tp)
    shapes = [s for s, _, _ in spec]
    tp_dims = [d for _, d, _ in spec]
    ws = _weights(rng, shapes)
    layout = FlatLayout(shapes, fsdp, align, tp_size=tp, tp_dims=tp_dims)
    mesh = fsdp_tp_mesh(fsdp, tp)
    master = layout.flatten(ws)
    assert master.shape == (tp, layout.total_size)
    master = jax.device_put(master, D.master_sharding(mesh, "fsdp", tp_axis="tp"))
    columnwise = align == 1          # columnwise built in the step on half of the cases
    out = D.quantize_master_weights(master, layout, mesh=mesh, tp_axis="tp", recipe=recipe, impl=IMPL,
                                    columnwise=columnwise, manual_post_all_gather_processing=not columnwise)
    for (shape, d, aligned), q, w in zip(spec, out, ws):
        if recipe == "nvfp4":
            assert q.shape == shape
        spec_row = P() if d is None else (P("tp", None) if d == 0 else P(None, "tp"))
        assert q.data.sharding.is_equivalent_to(NamedSharding(mesh, spec_row), 2), (shape, q.data.sharding)
        if columnwise:
            spec_col = P() if d is None else (P(None, "tp") if d == 0 else P("tp", None))
            assert q.data_t.sharding.is_equivalent_to(NamedSharding(mesh, spec_col), 2)
        _assert_tp_weight(q, w, recipe, d, aligned, tp, columnwise)


def test_fsdp_tp_layout_roundtrip_and_errors():
    rng = np.random.default_rng(3)
    shapes = [(64, 32), (32, 64), (16, 16)]
    ws = _weights(rng, shapes)
    layout = FlatLayout(shapes, 2, tp_size=2, tp_dims=[0, 1, None])
    assert layout.local_shapes == ((32, 32), (32, 32), (16, 16)) and layout.shapes == tuple(shapes)
    flat = layout.flatten(ws)
    np.testing.assert_array_equal(flat[1, :32 * 32], ws[0][32:].reshape(-1))
    for a, b in zip(layout.unflatten(flat), ws):
        np.testing.assert_array_equal(a, b)
    assert FlatLayout(shapes, 2, tp_dims=[0, 1, None]).flatten(ws).shape[0] == 1
    assert FlatLayout(shapes, 2).flatten(ws).ndim == 1
    mesh = fsdp_tp_mesh(4, 2)
    assert D.master_sharding(mesh, "fsdp", tp_axis="tp").spec == P("tp", "fsdp")
    with pytest.raises(ValueError, match=r"tp_dims\[0\]: dimension 0 of shape \(64, 32\) is not divisible"):
        FlatLayout(shapes, 2, tp_size=3, tp_dims=[0, 1, None])
    with pytest.raises(ValueError, match="tp_dims: needed"):
        FlatLayout(shapes, 2, tp_size=2)
    with pytest.raises(ValueError, match=r"tp_dims\[2\]: must be 'col', 'row', None, 0 or 1"):
        FlatLayout(shapes, 2, tp_size=2, tp_dims=[0, 1, 2])
    lay4 = FlatLayout(shapes, 4, tp_size=2, tp_dims=[0, 1, None])
    master = jax.device_put(lay4.flatten(ws), D.master_sharding(mesh, "fsdp", "tp"))
    with pytest.raises(ValueError, match="tp_axis: the layout is split"):
        D.quantize_master_weights(master, lay4, mesh=mesh)
    with pytest.raises(ValueError, match="tp_axis: 'tq' is not an axis"):
        D.quantize_master_weights(master, lay4, mesh=mesh, tp_axis="tq")
    with pytest.raises(ValueError, match="layout: has tp_size=2 but mesh axis 'tp' has 1"):
        D.quantize_master_weights(master, FlatLayout(shapes, 8, tp_size=2, tp_dims=[0, 1, None]), mesh=fsdp_tp_mesh(8),
                                  tp_axis="tp")
    bad = FlatLayout([(32, 16)], 4, tp_size=4, tp_dims=[0])      # 8 local rows: off the 16-grid
    with pytest.raises(ValueError, match=r"TP-local shape \(8, 16\).*multiple of 16"):
        D.quantize_master_weights(jnp.zeros((4, bad.total_size)), bad, mesh=fsdp_tp_mesh(2, 4), tp_axis="tp")


@pytest.mark.slow
def test_fsdp_tp_check_finite_names_tp_rank_and_shard():
    shapes = [(32, 32), (16, 32)]
    layout = FlatLayout(shapes, 2, tp_size=2, tp_dims=[0, None], names=["wq", "norm"])
    ws = [np.ones(s, np.float32) for s in shapes]
    ws[0][20, 5] = np.nan          # TP rank 1 (rows 16..31), local row 4 -> local element 133 -> shard 0
    mesh = fsdp_tp_mesh(2, 2)
    master = jax.device_put(layout.flatten(ws), D.master_sharding(mesh, "fsdp", "tp"))
    for recipe in ("nvfp4", "fp8"):
        _, rep = D.quantize_master_weights(master, layout, mesh=mesh, tp_axis="tp", recipe=recipe,
                                           check_finite=True, impl=IMPL)
        assert rep.counts.shape == (2, 2, 2)
        assert rep.findings() == [("wq", 1, 0, 1)]
        with pytest.raises(FloatingPointError, match=r"wq in tp rank 1, shard 0: 1 element"):
            rep.raise_if_nonfinite()


def _replica_group_size(line):
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    return len(m.group(1).split(",")) if m else None


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_hlo_fsdp_tp_one_all_reduce_over_both_axes_one_gather_over_fsdp(recipe):
    fsdp, tp = 4, 2
    shapes = [(256, 32), (32, 128), (48, 80)]
    layout = FlatLayout(shapes, fsdp, tp_size=tp, tp_dims=[0, 1, None])
    mesh = fsdp_tp_mesh(fsdp, tp)
    master = jax.device_put(layout.flatten([np.zeros(s, np.float32) for s in shapes]),
                            D.master_sharding(mesh, "fsdp", "tp"))
    f = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, tp_axis="tp", recipe=recipe,
                                                    check_finite=True, impl=IMPL))
    hlo = f.lower(master).compile().as_text()
    reduces = [ln for ln in hlo.splitlines() if " all-reduce(" in ln or " all-reduce-start(" in ln]
    gathers = [ln for ln in hlo.splitlines() if " all-gather(" in ln or " all-gather-start(" in ln]
    assert len(reduces) == 1 and len(gathers) == 1, (reduces, gathers)
    assert _replica_group_size(reduces[0]) == fsdp * tp          # the whole weight mesh
    assert _replica_group_size(gathers[0]) == fsdp               # quantized bytes over fsdp only
    assert "all-to-all" not in hlo and "collective-permute" not in hlo and " conditional(" not in hlo


# ----------------------------------------------------------------------------------------------
# The grouped path does not grow with the number of parameters
# ----------------------------------------------------------------------------------------------


def _jaxquant_custom_calls(lowered_text):
    """jaxquant's custom calls in a lowered (StableHLO) module; shard_map adds its own per output."""
    return re.findall(r"stablehlo.custom_call @(jq_\w+)", lowered_text)


def _entry_kernel_ops(compiled_text):
    """Instructions of the compiled entry computation that run kernels (fusions, copies, slices,
    concatenates, custom calls), by opcode."""
    entry = compiled_text[compiled_text.index("ENTRY"):]
    ops = re.findall(r"= \S+ (fusion|copy|slice|concatenate|custom-call|dynamic-slice)\(", entry)
    return {op: ops.count(op) for op in sorted(set(ops))}


@pytest.mark.skipif(IMPL == "reference", reason="counts the custom calls of the compiled extension")
@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.fast_cases("nvfp4")  # the other cases: slow
def test_custom_call_count_independent_of_parameter_count(recipe):
    calls, kernels = {}, {}
    for n in (7, 301):
        shapes = [(16, 16 * (1 + p % 3)) for p in range(n)]
        layout = FlatLayout(shapes, 4, align=1 if n == 7 else 3)
        # NVFP4: both layouts have tiles cut by a shard boundary (reducing them adds ops, not per parameter)
        assert len(D.cut_tiles(gtable.rows_of(D.layout_group_table(layout, True)), layout.shard_size, 4)) > 0
        mesh = fsdp_tp_mesh(4)
        flat = jax.ShapeDtypeStruct((layout.total_size,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
        f = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, recipe=recipe, columnwise=True,
                                                        manual_post_all_gather_processing=False,
                                                        check_finite=True, impl="custom_call"))
        lowered = f.lower(flat)
        calls[n] = sorted(_jaxquant_custom_calls(lowered.as_text()))
        kernels[n] = _entry_kernel_ops(lowered.compile().as_text())
    want = (["jq_group_split", "jq_nvfp4_group_cast", "jq_nvfp4_group_columnwise", "jq_nvfp4_group_scale",
             "jq_nvfp4_group_scale", "jq_nvfp4_group_tile_amax"]   # scales: the cast's, then the output's
            if recipe == "nvfp4"
            else ["jq_fp8_group_amax", "jq_fp8_group_cast", "jq_fp8_group_transpose", "jq_group_split"])
    assert calls[7] == calls[301] == want, calls
    # No per-parameter slice / copy kernels either: the weights come out of the one split call.
    assert kernels[7] == kernels[301], kernels


# ----------------------------------------------------------------------------------------------
# split=False: GatheredWeights (each weight cut out where it is read)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
@pytest.mark.parametrize("kind,S,pieces", [("align1", 4, 1), ("odd", 3, 3), ("te", 8, 3), ("align1", 1, 1)])
@pytest.mark.slow
def test_split_false_same_bytes_without_a_split_pass(kind, S, pieces, recipe):
    """split=False returns a GatheredWeights whose weights, cut out inside jit (and outside), are the
    single-tensor bytes, rowwise and columnwise, for odd boundaries and gather pieces; the step
    itself has no split call and hands back only the gathered buffers and packed vectors."""
    rng = np.random.default_rng(40 + S)
    shapes = [(64, 96), (32, 80), (48, 64), (16, 160)]
    layout = _layout(kind, shapes, S, rng)
    ws = _weights(rng, shapes)
    mesh = fsdp_tp_mesh(S)
    flat = _put(layout, ws, mesh)
    for columnwise in (False, True):
        f = jax.jit(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, recipe=recipe, columnwise=columnwise,
                                                        manual_post_all_gather_processing=False,
                                                        gather_pieces=pieces, split=False, impl=IMPL))
        gathered = f(flat)
        assert isinstance(gathered, GatheredWeights) and len(gathered) == len(ws)
        assert _jaxquant_split_calls(f.lower(flat).as_text()) == 0
        per_weight = 2 if recipe == "nvfp4" else 1    # columnwise arrays: one per weight, built in the step
        assert len(jax.tree.leaves(gathered)) == len(gathered.sources) + (per_weight * len(ws) if columnwise else 0)
        cut = jax.jit(lambda g: g.tensors())(gathered)
        for q, w in zip(cut, ws):
            _assert_same(q, _reference(w, recipe, columnwise=columnwise))
        _assert_same(gathered[-1], _reference(ws[-1], recipe, columnwise=columnwise))   # outside jit
    with pytest.raises(IndexError, match="parameter 4 of a group of 4"):
        gathered[4]


@pytest.mark.slow
def test_split_false_buffers_do_not_grow_with_parameters_and_check_finite():
    """The GatheredWeights of 7 and of 120 parameters hold the same number of arrays (the split is
    what hands back one array per result); check_finite still returns the report."""
    mesh = fsdp_tp_mesh(4)
    counts = {}
    for n in (7, 120):
        shapes = [(16, 16 * (1 + p % 3)) for p in range(n)]
        layout = FlatLayout(shapes, 4)
        flat = jax.ShapeDtypeStruct((layout.total_size,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
        out = jax.eval_shape(lambda x: D.quantize_master_weights(x, layout, mesh=mesh, split=False, check_finite=True,
                                                                 impl=IMPL), flat)
        gathered, report = out
        assert isinstance(gathered, GatheredWeights) and isinstance(report, D.NonFiniteReport) and len(gathered) == n
        counts[n] = len(jax.tree.leaves(gathered))
    assert counts[7] == counts[120], counts


def test_split_false_errors_and_per_device_form():
    layout = FlatLayout([(32, 32), (16, 48)], 4)
    mesh = fsdp_tp_mesh(4)
    ws = _weights(np.random.default_rng(3), [(32, 32), (16, 48)])
    flat = _put(layout, ws, mesh)
    with pytest.raises(TypeError, match="split: must be a bool"):
        D.quantize_master_weights(flat, layout, mesh=mesh, split="no")
    tp_layout = FlatLayout([(32, 32)], 2, tp_size=2, tp_dims=[0])
    with pytest.raises(ValueError, match="split: False .* 1-D meshes"):
        D.quantize_master_weights(jnp.zeros((2, tp_layout.total_size)), tp_layout, mesh=fsdp_tp_mesh(2, 2),
                                  tp_axis="tp", split=False)
    body = functools.partial(D.quantize_master_weights_local, layout=layout, recipe="fp8", split=False, impl=IMPL)
    gathered = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P()))(flat)
    for q, w in zip(gathered.tensors(), ws):
        _assert_same(q, _reference(w, "fp8"))


@pytest.mark.parametrize("kind,S", [("align1", 2), ("align1", 3), ("odd", 3), ("te", 8), ("sparse", 8),
                                    ("align128", 4)])
def test_cut_tiles_are_the_tiles_on_two_or_more_shards(kind, S):
    """cut_tiles (the tiles whose amaxes the cast's all-reduce carries) against brute force: every
    tile whose elements lie on two or more shards, and no other."""
    rng = np.random.default_rng(60 + S)
    shapes = _random_shapes(rng, 6)
    layout = _layout(kind, shapes, S, rng)
    rows = gtable.rows_of(D.layout_group_table(layout, True))
    want = []
    for row in rows:
        i, j = np.meshgrid(np.arange(row.rows), np.arange(row.cols), indexing="ij")
        shard = ((row.offset + i * row.cols + j) // layout.shard_size).reshape(row.rows // 16, 16, row.cols // 16, 16)
        spread = shard.max(axis=(1, 3)) != shard.min(axis=(1, 3))
        want += list(row.tile_base + np.flatnonzero(spread.reshape(-1)))
    got = D.cut_tiles(rows, layout.shard_size, S)
    assert got.dtype == np.int32 and list(got) == want, (list(got), want)
    assert len(want) > 0 or kind == "sparse"
