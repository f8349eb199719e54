"""The ``ckpt`` CLI as a subprocess: inspect, convert, every bad-input case, and a kill mid-write."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

common.setup_devices()

import jax.numpy as jnp  # noqa: E402

from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.checkpoint import metadata as mdmod  # noqa: E402

CLI = [sys.executable, "-m", "jaxquant", "ckpt"]


def cli(*args, timeout=180):
    return subprocess.run(CLI + [str(a) for a in args], env=common.env(), capture_output=True, text=True,
                          timeout=timeout)


def _digest(path):
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        h.update(name.encode())
        with open(os.path.join(path, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


@pytest.fixture()
def src(tmp_path):
    p = str(tmp_path / "src")
    ck.save_dcp(p, {"w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8).astype(jnp.bfloat16),
                    "u": jnp.arange(16, dtype=jnp.uint8).reshape(4, 4), "step": 3})
    return p


def _rewrite_metadata(path, fn):
    md = mdmod.read_metadata(path)
    fn(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(mdmod.encode_metadata(md, path))


def test_inspect_reports_keys_dtypes_shapes_chunks_and_exits_zero(src):
    r = cli("inspect", src)
    assert r.returncode == 0, r.stderr
    assert "w" in r.stdout and "bfloat16" in r.stdout and "[8, 8]" in r.stdout and "OK" in r.stdout
    r = cli("inspect", src, "--json", "--verify")
    assert r.returncode == 0 and '"ok": true' in r.stdout


def test_convert_both_ways_with_transpose_and_source_untouched(src, tmp_path):
    before = _digest(src)
    r = cli("convert", src, tmp_path / "o", "--to", "orbax", "--transpose-linear", "w")
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"wrote {tmp_path / 'o'}\n"  # no progress bar: stderr is not a terminal
    r = cli("convert", tmp_path / "o", tmp_path / "d", "--to", "dcp", "--transpose-linear", "w", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert _digest(src) == before
    import jax
    out = ck.load_dcp(str(tmp_path / "d"), {"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16),
                                            "u": jax.ShapeDtypeStruct((4, 4), jnp.uint8), "step": int})
    assert common.same_bytes(out["w"], jnp.arange(64, dtype=jnp.float32).reshape(8, 8).astype(jnp.bfloat16))
    assert out["step"] == 3


@pytest.mark.slow
def test_convert_dequantize_flag(tmp_path):
    import jaxquant
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32))
    q = jaxquant.quantize_nvfp4(x, impl="reference")
    ck.save_dcp(str(tmp_path / "q"), {"w": q})
    r = cli("convert", tmp_path / "q", tmp_path / "d", "--to", "dcp", "--dequantize", "bfloat16")
    assert r.returncode == 0, r.stderr
    import jax
    out = ck.load_dcp(str(tmp_path / "d"), {"w": jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)})
    assert common.same_bytes(out["w"], q.dequantize(jnp.bfloat16))


@pytest.mark.slow
def test_truncated_distcp_is_refused(src, tmp_path):
    f = os.path.join(src, "__0_0.distcp")
    os.truncate(f, os.path.getsize(f) // 2)
    r = cli("inspect", src)
    assert r.returncode != 0 and "truncated" in r.stdout
    r = cli("convert", src, tmp_path / "out", "--to", "dcp")
    assert r.returncode != 0 and "truncated" in r.stderr
    assert not os.path.exists(tmp_path / "out") and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.slow
def test_corrupt_distcp_bytes_are_detected(src, tmp_path):
    f = os.path.join(src, "__0_0.distcp")
    md = mdmod.read_metadata(src)
    s = md.entries["w"].chunks[0].storage
    from jaxquant.checkpoint import torchsave
    with open(f, "rb") as fh:
        pos = torchsave.read_archive(fh, s.offset, s.length, "w")["archive/data/0"].data_offset
    with open(f, "r+b") as fh:
        fh.seek(pos + 3)
        b = fh.read(1)
        fh.seek(pos + 3)
        fh.write(bytes([b[0] ^ 0xFF]))
    r = cli("inspect", src, "--verify")
    assert r.returncode != 0 and "CRC" in r.stdout
    r = cli("convert", src, tmp_path / "out", "--to", "orbax")
    assert r.returncode != 0 and "CRC" in r.stderr and not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_missing_metadata_is_refused(src, tmp_path):
    os.unlink(os.path.join(src, ".metadata"))
    r = cli("inspect", src)
    assert r.returncode != 0 and ".metadata" in r.stderr
    r = cli("convert", src, tmp_path / "out", "--to", "orbax")
    assert r.returncode != 0 and not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_missing_chunk_is_a_coverage_gap(tmp_path):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    p = str(tmp_path / "c")
    ck.save_dcp(p, {"x": ck.LocalShards((4, 4), np.float32, [((0, 0), np.zeros((2, 4), np.float32)),
                                                              ((2, 0), np.ones((2, 4), np.float32))])})
    _rewrite_metadata(p, lambda md: md.entries["x"].chunks.pop())
    r = cli("inspect", p)
    assert r.returncode != 0 and "gap" in r.stdout and "'x'" in r.stdout
    with pytest.raises(ck.CoverageError, match="gap"):
        ck.load_dcp(p, {"x": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=NamedSharding(mesh, P()))})


@pytest.mark.slow
def test_overlapping_chunks_are_refused(tmp_path):
    p = str(tmp_path / "c")
    ck.save_dcp(p, {"x": ck.LocalShards((4, 4), np.float32, [((0, 0), np.zeros((2, 4), np.float32)),
                                                              ((2, 0), np.ones((2, 4), np.float32))])})

    def overlap(md):
        c = md.entries["x"].chunks[1]
        md.entries["x"].chunks[1] = mdmod.Chunk((1, 0), (2, 4), c.storage)
        md.entries["x"].chunks.append(mdmod.Chunk((3, 0), (1, 4), c.storage))
    _rewrite_metadata(p, overlap)
    r = cli("inspect", p)
    assert r.returncode != 0 and "overlap" in r.stdout
    r = cli("convert", p, tmp_path / "out", "--to", "dcp")
    assert r.returncode != 0 and "overlap" in r.stderr and not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_unknown_dtype_is_refused(src, tmp_path):
    def bad(md):
        md.entries["u"].dtype = "complex32"
    _rewrite_metadata(src, bad)
    r = cli("inspect", src)
    assert r.returncode != 0 and "complex32" in r.stdout
    r = cli("convert", src, tmp_path / "out", "--to", "dcp")
    assert r.returncode != 0 and "complex32" in r.stderr and not os.path.exists(tmp_path / "out")


def test_disallowed_pickle_content_is_refused_and_never_run(src, tmp_path):
    marker = tmp_path / "pwned"
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    for r in (cli("inspect", src), cli("convert", src, tmp_path / "out", "--to", "orbax")):
        assert r.returncode != 0 and "refusing global os.system" in r.stderr
    assert not marker.exists() and not os.path.exists(tmp_path / "out")


def test_existing_nonempty_destination_is_refused(src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = cli("convert", src, dst, "--to", "dcp")
    assert r.returncode == 2 and "the destination is a directory that is not empty" in r.stderr, r.stderr
    assert os.listdir(dst) == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    with pytest.raises(ck.DestinationExistsError):
        ck.save_dcp(str(dst), {"a": jnp.ones(2)})


@pytest.mark.slow
def test_kill_during_convert_leaves_no_destination(tmp_path):
    big = str(tmp_path / "big")
    rng = np.random.default_rng(0)
    blocks = [((i * 256, 0), rng.integers(0, 255, (256, 4096), dtype=np.uint8)) for i in range(96)]  # 96 MiB
    ck.save_dcp(big, {"x": ck.LocalShards((96 * 256, 4096), np.uint8, blocks)})
    dst = tmp_path / "dst"
    p = subprocess.Popen(CLI + ["convert", big, str(dst), "--to", "dcp"], env=common.env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()   # killed once it writes: its staging directory is there
    while not any(n.startswith("dst.tmp-") for n in os.listdir(tmp_path)) and time.time() - t0 < 120:
        if p.poll() is not None:
            break
        time.sleep(0.01)
    assert p.poll() is None, "convert finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert not dst.exists()
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("dst.tmp-")]
    for n in leftovers:  # a SIGKILLed staging directory is never mistaken for a checkpoint
        r = cli("inspect", tmp_path / n)
        assert r.returncode != 0 and "interrupted" in r.stderr
        with pytest.raises(ck.IncompleteCheckpointError):
            ck.load_dcp(str(tmp_path / n), {"x": int})
    r = cli("inspect", big)  # and the source is intact
    assert r.returncode == 0


@pytest.mark.slow
def test_missing_directory_is_named_as_missing(tmp_path):
    r = cli("inspect", tmp_path / "nope")
    assert r.returncode == 2 and f"{tmp_path / 'nope'}: checkpoint directory does not exist" in r.stderr, r.stderr
    r = cli("convert", tmp_path / "nope", tmp_path / "out", "--to", "dcp")
    assert r.returncode == 2 and "source directory does not exist" in r.stderr and not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("case", [
    "under_a_file",
    pytest.param("sysfs", marks=pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no /sys/kernel here")),
    pytest.param("chmod", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="running as root: chmod does not stop root from writing (the other cases cover it)")),
])
@pytest.mark.slow
def test_unwritable_destination_is_named_with_its_cause(src, tmp_path, case):
    # the command checks the destination's directory before it reads anything (exit 2, bad usage); the library
    # call finds it when it makes the staging directory
    if case == "under_a_file":
        (tmp_path / "afile").write_text("x")
        dst, cause = tmp_path / "afile" / "dst", "a component of the path is not a directory"
        said = f"dst: {tmp_path / 'afile'} is not a directory (the directory {dst} would be made in)"
    elif case == "sysfs":  # the kernel refuses new entries there, root included
        dst, cause = "/sys/kernel/jaxquant-test-dst", "operation not permitted"
        said = f"dst: cannot write in /sys/kernel: {cause}"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        dst, cause = ro / "dst", "permission denied"
        said = f"dst: cannot write in {ro}: {cause}"
    r = cli("convert", src, dst, "--to", "dcp")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"jaxquant ckpt convert: error: {said}; see 'jaxquant ckpt convert --help'"], r.stderr
    with pytest.raises(ck.DestinationError, match=f"cannot write the destination: {cause}") as e:
        ck.save_dcp(str(dst), {"a": np.ones(2)})
    assert f"/.{os.path.basename(dst)}.tmp-" not in str(e.value), e.value  # not the staging dir's hidden first name


def test_read_only_file_system_is_said_in_words(src, tmp_path, monkeypatch):
    import errno

    def read_only(path, *a, **k):  # what mkdir on a read-only mount raises (no such mount as a test fixture)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    monkeypatch.setattr(os, "makedirs", read_only)
    dst = tmp_path / "dst"
    with pytest.raises(ck.DestinationError, match=f"{dst}: cannot write the destination: the file system is "
                                                  f"read-only"):
        ck.convert(src, str(dst), to="dcp")


def _flip_byte(path, key, entry, delta=3):
    """Flip one byte of zip entry ``entry`` (e.g. "data/0", "data.pkl", "byteorder") in the record of ``key``."""
    from jaxquant.checkpoint import torchsave
    s = mdmod.read_metadata(path).entries[key]
    s = (s.chunks[0] if hasattr(s, "chunks") else s).storage
    f = os.path.join(path, s.relative_path)
    with open(f, "r+b") as fh:
        pos = torchsave.read_archive(fh, s.offset, s.length, key)["archive/" + entry].data_offset + delta
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.slow
def test_inspect_verify_says_what_it_read_and_fails_on_a_flipped_byte(src, tmp_path):
    import shutil
    r = cli("inspect", src)
    assert r.returncode == 0 and "not verified" in r.stdout and "--verify" in r.stdout
    r = cli("inspect", src, "--verify")
    assert r.returncode == 0, r.stdout
    assert "verified: 3 of 3 records read (" in r.stdout and "; 1 file)" in r.stdout
    assert "every CRC-32 matched" in r.stdout
    # tensor bytes, a version record of another tensor, and the pickle of a byte entry: each caught by --verify
    for key, entry, delta in (("w", "data/0", 5), ("u", "byteorder", 1), ("step", "data.pkl", 4)):
        bad = str(tmp_path / f"bad_{key}")
        shutil.copytree(src, bad)
        _flip_byte(bad, key, entry, delta)
        r = cli("inspect", bad, "--verify")
        assert r.returncode == 1 and "NOT SOUND" in r.stdout, (key, r.stdout)
        assert "__0_0.distcp" in r.stdout and f"'{key}'" in r.stdout and "CRC-32 mismatch" in r.stdout, r.stdout
        assert f"zip entry archive/{entry}" in r.stdout, r.stdout
        # says how many records were read of how many, never "all"
        assert "verified: 2 of 3 records read with matching CRC-32s" in r.stdout, r.stdout
        assert "1 record failed or could not be read" in r.stdout and "every entry's CRC-32 matched" not in r.stdout
    r = cli("inspect", str(tmp_path / "bad_w"))  # without --verify the data is not read, and it says so
    assert r.returncode == 0 and "not verified" in r.stdout


# Runs the top-level CLI with Orbax and TensorStore made unimportable (None in sys.modules), as on a machine
# without the "orbax" extra.
_WITHOUT_ORBAX = ("import sys\n"
                  "for name in ('tensorstore', 'orbax', 'orbax.checkpoint'):\n"
                  "    sys.modules[name] = None\n"
                  "from jaxquant.cli import main\n"
                  "sys.exit(main(sys.argv[1:]))\n")


def _cli_without_orbax(*args):
    return subprocess.run([sys.executable, "-c", _WITHOUT_ORBAX, "ckpt"] + [str(a) for a in args], env=common.env(),
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("direction", ["to_orbax", "from_orbax"])
@pytest.mark.slow
def test_convert_without_orbax_installed_names_the_extra_in_one_line(src, tmp_path, direction):
    if direction == "to_orbax":
        args = (src, tmp_path / "out", "--to", "orbax")
    else:
        r = cli("convert", src, tmp_path / "o", "--to", "orbax", "--no-progress")
        assert r.returncode == 0, r.stderr
        args = (tmp_path / "o", tmp_path / "out", "--to", "dcp")
    r = _cli_without_orbax("convert", *args, "--no-progress")
    assert r.returncode == 2, r.stderr     # bad usage, as the demo's missing optax: the extra the command needs
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("jaxquant ckpt convert: error: ")
    assert 'pip install "jaxquant[orbax]"' in lines[0]
    assert 'pip install --no-build-isolation -e ".[orbax]"' in lines[0]
    assert not os.path.exists(tmp_path / "out") and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    r = _cli_without_orbax("inspect", src)  # DCP alone needs no Orbax
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


@pytest.mark.slow
def test_inspect_orbax_checkpoint_lists_keys_dtypes_shapes(src, tmp_path):
    o = tmp_path / "o"
    r = cli("convert", src, o, "--to", "orbax", "--no-progress")
    assert r.returncode == 0, r.stderr
    r = cli("inspect", o)
    assert r.returncode == 0, r.stderr
    assert "not a DCP checkpoint" not in r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"Orbax checkpoint {o}: 3 keys"), r.stdout
    rows = {l.split()[0]: l.split(None, 1)[1] for l in lines[2:5]}
    assert rows["w"].split()[:1] == ["bfloat16"] and "[8, 8]" in rows["w"]
    assert rows["u"].split()[:1] == ["uint8"] and "[4, 4]" in rows["u"]
    assert rows["step"].split()[:2] == ["-", "bytes"]
    assert lines[-1] == "OK"
    import json
    r = cli("inspect", o, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["format"] == "orbax" and rep["ok"]
    assert rep["verified"] == {"keys": 3, "keys_total": 3, "bytes": 8 * 8 * 2 + 4 * 4}
    assert {k["key"]: (k["kind"], k["dtype"], k["shape"]) for k in rep["keys"]} == {
        "w": ("tensor", "bfloat16", [8, 8]), "u": ("tensor", "uint8", [4, 4]), "step": ("bytes", None, None)}
    # its data files damaged: refused (Orbax itself may log asyncio noise on stderr after jaxquant's line)
    for name in os.listdir(o / "d"):
        with open(o / "d" / name, "r+b") as f:
            f.truncate(os.path.getsize(o / "d" / name) // 2)
    for args in ((), ("--verify",)):
        r = cli("inspect", o, *args)
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "jaxquant ckpt inspect: error: " in r.stderr or "NOT SOUND" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.slow
def test_inspect_byte_counts_say_what_they_count_and_agree(src, tmp_path):
    import json
    r = cli("inspect", src, "--verify", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    tensor_data = 8 * 8 * 2 + 4 * 4  # w: bfloat16[8, 8], u: uint8[4, 4]
    assert rep["total_bytes"] == sum(k["nbytes"] for k in rep["keys"]) == tensor_data
    assert rep["disk_bytes"] == os.path.getsize(os.path.join(src, "__0_0.distcp"))
    assert rep["metadata_bytes"] == os.path.getsize(os.path.join(src, ".metadata"))
    assert rep["records"] == 3  # w, u, step
    v = rep["verified"]
    assert v["records"] == v["records_total"] == 3 and v["files"] == 1
    assert v["tensor_bytes"] == tensor_data < v["bytes"] < rep["disk_bytes"]  # + pickles < + zip headers, padding
    r = cli("inspect", src, "--verify")
    header, verified = r.stdout.splitlines()[0], r.stdout.splitlines()[5]
    assert f"3 keys in 3 records; {tensor_data} bytes of tensor data (elements x itemsize); on disk " \
           f"{rep['disk_bytes']:,} bytes in 1 .distcp file" in header, header
    assert f"and {rep['metadata_bytes']:,} in .metadata" in header, header
    assert verified.startswith(f"verified: 3 of 3 records read ({v['zip_entries']} zip entries of {v['bytes']:,} "
                               f"bytes: {tensor_data} of tensor data, the rest pickles"), verified
    # Orbax: the same two counts
    o = tmp_path / "o"
    assert cli("convert", src, o, "--to", "orbax", "--no-progress").returncode == 0
    rep = json.loads(cli("inspect", o, "--verify", "--json").stdout)
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(o) for f in fs)
    assert rep["total_bytes"] == tensor_data and rep["disk_bytes"] == on_disk
    assert rep["verified"] == {"keys": 3, "keys_total": 3, "bytes": tensor_data}


@pytest.mark.slow
def test_inspect_verify_on_a_truncated_file_counts_the_records_it_read(src):
    f = os.path.join(src, "__0_0.distcp")
    os.truncate(f, os.path.getsize(f) // 2)
    import json
    r = cli("inspect", src, "--verify", "--json")
    assert r.returncode == 1
    v = json.loads(r.stdout)["verified"]
    assert v["records_total"] == 3 and v["records"] < 3
    r = cli("inspect", src, "--verify")
    assert r.returncode == 1 and f"verified: {v['records']} of 3 records read with matching CRC-32s" in r.stdout
    assert "NOT SOUND" in r.stdout
