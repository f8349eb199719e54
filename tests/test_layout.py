"""FlatLayout: offsets, shard ownership, flatten/unflatten, TransformerEngine-style start offsets."""

import math

import numpy as np
import pytest

from jaxquant.zero.layout import FlatLayout


def _check_invariants(lay: FlatLayout):
    """Every element of every parameter is owned by exactly one shard, at the right local place."""
    assert lay.total_size == lay.num_shards * lay.shard_size
    covered = [np.zeros(m, np.int32) for m in lay.numels]
    for r in range(lay.num_shards):
        prev_end = 0
        for pc in lay.pieces(r):
            assert pc.shard == r and pc.length > 0
            assert pc.local_offset >= prev_end and pc.local_offset + pc.length <= lay.shard_size
            prev_end = pc.local_offset + pc.length
            # flat position agrees with the parameter offset
            assert r * lay.shard_size + pc.local_offset == lay.param_offsets[pc.param] + pc.start
            covered[pc.param][pc.start:pc.end] += 1
            assert lay.owned_range(r, pc.param) == (pc.start, pc.end)
            assert lay.local_range(r, pc.param) == (pc.local_offset, pc.local_offset + pc.length)
    for p, c in enumerate(covered):
        assert np.all(c == 1), f"param {p} not tiled exactly once"
        owners = lay.owners(p)
        assert list(owners) == sorted(owners)
        if lay.numels[p]:
            assert owners == tuple(range(owners[0], owners[-1] + 1))


def test_basic_offsets_and_ranges():
    lay = FlatLayout([(4, 4), (3, 5), (2,)], num_shards=4, align=8)
    assert lay.param_offsets == (0, 16, 32)
    assert lay.numels == (16, 15, 2)
    assert lay.total_size == 36 and lay.shard_size == 9
    assert lay.owned_range(0, 0) == (0, 9)
    assert lay.owned_range(1, 0) == (9, 16)
    assert lay.owned_range(1, 1) == (0, 2)
    assert lay.owned_range(3, 1) == (11, 15)
    assert lay.owned_range(3, 2) == (0, 2)
    assert lay.owned_range(0, 2) == (0, 0)          # not owned: empty range
    assert lay.local_range(3, 2) == (5, 7)
    assert lay.owners(1) == (1, 2, 3)
    assert lay.te_start_offsets(1) == ([9, 0, None], [7, 2, 0])
    _check_invariants(lay)


def test_align_one_odd_boundaries():
    lay = FlatLayout([(3, 3), (5,), (2, 2)], num_shards=3)
    assert lay.param_offsets == (0, 9, 14)
    assert lay.total_size == 18 and lay.shard_size == 6
    assert lay.owned_range(1, 0) == (6, 9)
    assert lay.owned_range(1, 1) == (0, 3)
    _check_invariants(lay)


def test_flatten_unflatten_roundtrip():
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (7,), (2, 3), (0, 5), (1, 1)]
    lay = FlatLayout(shapes, num_shards=5, align=4)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    flat = np.asarray(lay.flatten(arrays))
    assert flat.shape == (lay.total_size,) and flat.dtype == np.float32
    mask = np.zeros(lay.total_size, bool)
    for o, m in zip(lay.param_offsets, lay.numels):
        mask[o:o + m] = True
    assert np.all(flat[~mask] == 0)
    for a, b in zip(arrays, lay.unflatten(flat)):
        np.testing.assert_array_equal(a, np.asarray(b))
    np.testing.assert_array_equal(np.asarray(lay.shard_of(flat, 2)), flat[2 * lay.shard_size:3 * lay.shard_size])
    _check_invariants(lay)


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    shapes = [tuple(int(d) for d in rng.integers(0, 9, size=rng.integers(1, 3))) for _ in range(n)]
    S = int(rng.choice([1, 2, 3, 4, 5, 8, 16]))
    align = int(rng.choice([1, 2, 3, 16, 128]))
    lay = FlatLayout(shapes, S, align)
    for o in lay.param_offsets:
        assert o % align == 0
    assert lay.total_size - S < sum(lay.numels) + align * n or lay.total_size == 0
    _check_invariants(lay)
    # explicit offsets with random gaps
    offs, pos = [], 0
    for s in shapes:
        pos += int(rng.integers(0, 5))
        offs.append(pos)
        pos += math.prod(s)
    lay2 = FlatLayout.from_param_offsets(shapes, offs, S)
    assert lay2.param_offsets == tuple(offs)
    _check_invariants(lay2)
    # TE per-rank start offsets reproduce the same per-rank pieces
    te = [lay2.te_start_offsets(r) for r in range(S)]
    lay3 = FlatLayout.from_start_offsets(shapes, [t[0] for t in te], [t[1] for t in te],
                                         shard_size=lay2.shard_size)
    _check_invariants(lay3)
    for r in range(S):
        assert lay3.te_start_offsets(r) == te[r]


def test_from_start_offsets_align1_roundtrip():
    lay = FlatLayout([(16, 16), (16, 48), (32, 16)], num_shards=3)
    te = [lay.te_start_offsets(r) for r in range(3)]
    lay2 = FlatLayout.from_start_offsets(lay.shapes, [t[0] for t in te], [t[1] for t in te])
    assert lay2 == lay
    assert hash(lay2) == hash(lay)


def test_from_start_offsets_explicit():
    # Two 4x4 params over 3 ranks: rank 0 holds p0[0:6], rank 1 p0[6:16] + p1[0:2], rank 2 p1[2:16].
    lay = FlatLayout.from_start_offsets([(4, 4), (4, 4)], [[0, None], [6, 0], [None, 2]],
                                        [[6, 0], [10, 2], [0, 14]], shard_size=14)
    # rank 0's continued piece ends its shard; rank 1's last piece (continued) too, after a gap
    assert lay.param_offsets == (8, 26)
    assert lay.owned_range(0, 0) == (0, 6) and lay.local_range(0, 0) == (8, 14)
    assert lay.local_range(1, 0) == (0, 10) and lay.local_range(1, 1) == (12, 14)
    assert lay.owned_range(2, 1) == (2, 16)
    _check_invariants(lay)


def test_errors():
    with pytest.raises(ValueError, match="num_shards"):
        FlatLayout([(4, 4)], 0)
    with pytest.raises(ValueError, match="align"):
        FlatLayout([(4, 4)], 2, align=0)
    with pytest.raises(TypeError, match=r"shapes\[0\]"):
        FlatLayout([(4, 2.5)], 2)
    with pytest.raises(ValueError, match="overlap"):
        FlatLayout.from_param_offsets([(4,), (4,)], [0, 2], 2)
    with pytest.raises(ValueError, match="shard_size"):
        FlatLayout.from_param_offsets([(4,), (4,)], [0, 4], 2, shard_size=3)
    with pytest.raises(ValueError, match="names"):
        FlatLayout([(4,)], 1, names=["a", "b"])
    lay = FlatLayout([(4, 4)], 2)
    with pytest.raises(ValueError, match="shard"):
        lay.pieces(2)
    with pytest.raises(ValueError, match=r"arrays\[0\]"):
        lay.flatten([np.zeros((4, 3))])
    with pytest.raises(ValueError, match="flat"):
        lay.unflatten(np.zeros(5))
    # pieces that do not tile the parameter
    with pytest.raises(ValueError, match=r"start_offsets"):
        FlatLayout.from_start_offsets([(4, 4)], [[0], [8]], [[6], [8]])
    with pytest.raises(ValueError, match=r"start_offsets\[1\]\[0\]"):
        FlatLayout.from_start_offsets([(4, 4)], [[0], [10]], [[10], [8]])
    with pytest.raises(ValueError, match="no rank holds"):
        FlatLayout.from_start_offsets([(4, 4)], [[None]], [[0]])


def test_tp_layout_local_shapes_identity_and_slices():
    shapes = [(64, 32), (32, 64), (16, 16)]
    lay = FlatLayout(shapes, 3, align=5, tp_size=4, tp_dims=[0, 1, None])
    assert lay.local_shapes == ((16, 32), (32, 16), (16, 16))
    assert lay.numels == (512, 512, 256) and lay.param_offsets == (0, 515, 1030)
    assert lay.total_size == 3 * lay.shard_size >= 1030 + 256
    assert lay != FlatLayout(shapes, 3, align=5, tp_size=4, tp_dims=[1, 0, None])
    assert lay != FlatLayout(shapes, 3, align=5, tp_size=2, tp_dims=[0, 1, None])
    assert lay == FlatLayout(shapes, 3, align=5, tp_size=4, tp_dims=(0, 1, None))
    assert hash(lay) == hash(FlatLayout(shapes, 3, align=5, tp_size=4, tp_dims=(0, 1, None)))
    assert "tp_size=4" in repr(lay)
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    np.testing.assert_array_equal(lay.tp_slice(w, 0, 2), w[32:48])
    flat = np.asarray(lay.flatten([w, w.T.copy(), np.ones((16, 16), np.float32)]))
    np.testing.assert_array_equal(flat[2, :512], w[32:48].reshape(-1))
    np.testing.assert_array_equal(flat[3, 515:1027], w.T[:, 48:64].reshape(-1))
    assert not flat[:, 512:515].any()                       # alignment padding
    with pytest.raises(ValueError, match=r"tp_dims\[0\]: a TP-split parameter must have rank 2"):
        FlatLayout([(64,)], 1, tp_size=2, tp_dims=[0])
    with pytest.raises(ValueError, match="tp_dims: expected 3 entries"):
        FlatLayout(shapes, 1, tp_size=2, tp_dims=[0])


def test_tp_dims_take_the_split_names_col_and_row():
    """"col"/"row" (make_train_step's param_specs names) are 0/1, stored as 0/1: the same layout, hash and bytes."""
    shapes = [(64, 32), (32, 64), (16, 16)]
    by_dim = FlatLayout(shapes, 3, align=5, tp_size=4, tp_dims=[0, 1, None])
    by_name = FlatLayout(shapes, 3, align=5, tp_size=4, tp_dims=["col", "row", None])
    assert by_name.tp_dims == (0, 1, None) and by_name == by_dim and hash(by_name) == hash(by_dim)
    assert by_name.local_shapes == by_dim.local_shapes and by_name.param_offsets == by_dim.param_offsets
    assert FlatLayout(shapes, 3, tp_size=4, tp_dims=("col", 1, None)) == FlatLayout(shapes, 3, tp_size=4,
                                                                                  tp_dims=(0, "row", None))
    ws = [np.arange(np.prod(s), dtype=np.float32).reshape(s) for s in shapes]
    flat = np.asarray(by_name.flatten(ws))
    assert flat.tobytes() == np.asarray(by_dim.flatten(ws)).tobytes()
    for a, b in zip(by_name.unflatten(flat), ws):
        np.testing.assert_array_equal(a, b)
    for bad in ("diag", "COL", 2, True):
        with pytest.raises(ValueError, match=r"tp_dims\[1\]: must be 'col', 'row', None, 0 or 1, got"):
            FlatLayout(shapes, 1, tp_size=2, tp_dims=["col", bad, None])
    with pytest.raises(ValueError, match=r"tp_dims: needed when tp_size > 1 .*'col' \(rows split\), 'row'"):
        FlatLayout(shapes, 1, tp_size=2)
