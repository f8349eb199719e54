"""On-disk format pieces: torch.save records, the safe unpickler, .metadata, coverage rules."""

import io
import os
import pickle
import sys
import zipfile

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

common.setup_devices()

from jaxquant.checkpoint import torchsave  # noqa: E402
from jaxquant.checkpoint.errors import CorruptCheckpointError, UnknownDtypeError, UnsafePickleError  # noqa: E402
from jaxquant.checkpoint.layout import coverage_problems  # noqa: E402
from jaxquant.checkpoint.metadata import Chunk, TensorEntry, read_metadata  # noqa: E402
from jaxquant.checkpoint.safepickle import safe_loads  # noqa: E402

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.uint8,
          np.int8, np.int32, np.int64, np.uint16, np.bool_, np.float64]


def _sample(dtype, shape=(5, 3)):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_tensor_record_roundtrips_through_torch_load_bit_identical(dtype):
    torch = common.require_torch()
    for arr in (_sample(dtype), _sample(dtype, ()), _sample(dtype, (0, 4))):
        buf = io.BytesIO()
        buf.write(b"prefix")  # records live at arbitrary offsets inside a .distcp file
        n = torchsave.write_tensor(buf, arr, __import__("jaxquant.checkpoint.dtypes", fromlist=["x"])
                                   .to_torch_name(arr.dtype, what="t"))
        t = torch.load(io.BytesIO(buf.getvalue()[6:6 + n]), weights_only=True)
        assert tuple(t.shape) == arr.shape
        assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == arr.reshape(-1).view(np.uint8).tobytes()
        assert common.same_bytes(torchsave.read_tensor(buf, 6, n, "t"), arr)


def test_reads_torch_save_records_including_strided_tensors():
    torch = common.require_torch()
    src = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    for t in (src, src.t(), src[1:, 2:], torch.ones(3, dtype=torch.bfloat16), torch.tensor(5)):
        buf = io.BytesIO()
        torch.save(t, buf)
        got = torchsave.read_tensor(buf, 0, len(buf.getvalue()), "t")
        want = t.contiguous().view(-1).view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()
        assert np.ascontiguousarray(got).reshape(-1).view(np.uint8).tobytes() == want.tobytes()
        assert got.shape == tuple(t.shape)


def test_record_is_a_valid_zip_and_zip64_records_are_read():
    arr = _sample(np.float32, (4, 4))
    buf = io.BytesIO()
    n = torchsave.write_tensor(buf, arr, "float32")
    assert zipfile.ZipFile(io.BytesIO(buf.getvalue()[:n])).testzip() is None
    # a ZIP64 archive written by Python's zipfile (force_zip64) with torch's entry names
    ref = io.BytesIO()
    torch = common.require_torch()
    torch.save(torch.from_numpy(arr), ref)
    z_in = zipfile.ZipFile(io.BytesIO(ref.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in z_in.namelist():
            with z.open(name, "w", force_zip64=True) as f:
                f.write(z_in.read(name))
    assert common.same_bytes(torchsave.read_tensor(out, 0, len(out.getvalue()), "z64"), arr)


def test_unpickler_refuses_globals_outside_the_allowlist_without_running_them(tmp_path):
    marker = tmp_path / "pwned"
    evil = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    with pytest.raises(UnsafePickleError, match="os.system"):
        safe_loads(evil, {}, what="evil.pkl")
    assert not marker.exists()
    # builtins eval via STACK_GLOBAL (protocol 4) is refused as well
    with pytest.raises(UnsafePickleError, match="builtins.eval"):
        safe_loads(pickle.dumps(eval, protocol=4), {}, what="evil2.pkl")


def test_truncated_and_garbled_records_raise_corrupt_errors():
    arr = _sample(np.float32, (8, 8))
    buf = io.BytesIO()
    n = torchsave.write_tensor(buf, arr, "float32")
    data = buf.getvalue()
    with pytest.raises(CorruptCheckpointError, match="outside the file|truncated"):
        torchsave.read_tensor(io.BytesIO(data[: n // 2]), 0, n, "half")
    flipped = bytearray(data)
    flipped[torchsave.read_archive(buf, 0, n, "t")["archive/data/0"].data_offset + 10] ^= 0xFF  # a data byte
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        torchsave.read_tensor(io.BytesIO(bytes(flipped)), 0, n, "flip")


def test_reads_metadata_written_by_torch_dcp_save(tmp_path):
    torch = common.require_torch()
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "step": 5, "nested": {"a": torch.ones(2)},
          "f8": torch.zeros(2, 2, dtype=torch.float8_e4m3fn), "n": torch.tensor(3)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    md = read_metadata(str(tmp_path / "ck"))
    assert set(md.entries) == {"w", "step", "nested.a", "f8", "n"}
    assert md.entries["w"].dtype == "bfloat16" and md.entries["w"].size == (3, 4)
    assert md.entries["f8"].dtype == "float8_e4m3fn" and md.entries["n"].size == ()
    assert md.entries["w"].chunks[0].storage.relative_path == "__0_0.distcp"
    assert md.planner_data["nested.a"] == ("nested", "a")


def test_coverage_rules_detect_gaps_overlaps_and_out_of_bounds():
    ok = TensorEntry("k", "float32", (4, 4), [Chunk((0, 0), (2, 4)), Chunk((2, 0), (2, 4))])
    assert coverage_problems(ok) == []
    gap = TensorEntry("k", "float32", (4, 4), [Chunk((0, 0), (2, 4))])
    assert "gap" in coverage_problems(gap)[0]
    over = TensorEntry("k", "float32", (4, 4), [Chunk((0, 0), (3, 4)), Chunk((2, 0), (2, 4))])
    assert any("overlap" in p for p in coverage_problems(over))
    oob = TensorEntry("k", "float32", (4, 4), [Chunk((0, 0), (5, 4))])
    assert "outside" in coverage_problems(oob)[0]
    assert coverage_problems(TensorEntry("s", "int64", (), [Chunk((), ())])) == []


def test_unknown_dtype_is_named():
    from jaxquant.checkpoint import dtypes

    with pytest.raises(UnknownDtypeError, match="complex32"):
        dtypes.to_numpy("complex32", what="key 'x'")
    with pytest.raises(UnknownDtypeError, match="int4"):
        dtypes.to_torch_name(ml_dtypes.int4, what="key 'x'")


def test_save_load_inspect_convert_never_import_torch(tmp_path):
    import subprocess

    code = f"""
import sys, numpy as np, jax, jax.numpy as jnp
from jaxquant import checkpoint as ck
p = {str(tmp_path / 'c')!r}
ck.save_dcp(p, {{"w": jnp.ones((4, 4), jnp.bfloat16), "step": 1}})
out = ck.load_dcp(p, {{"w": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16), "step": int}})
assert ck.inspect_dcp(p, verify=True)["ok"] and out["step"] == 1
ck.convert(p, p + "_d", to="dcp", transpose="w")
assert "torch" not in sys.modules, "torch was imported"
"""
    r = subprocess.run([sys.executable, "-c", code], env=common.env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
