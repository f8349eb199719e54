"""Byte-level text data (jaxquant/training/text.py, ``jaxquant demo --text``, benchmarks/bench_convergence.py): the
tokens are the files' bytes, the held-out part is disjoint from the training part (whole files, or the corpus's
last bytes), the window order is a function of the seed and step, per-process shards tile the global batch and go
on the mesh with the step's batch sharding, files and directories (recursively) are read, and a missing or empty
path is one error naming the option."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxquant.training import text
from jaxquant.training.text import TextData

SEQ = 8


def _corpus(tmp_path, n=64):
    """``n`` files, each a distinct line repeated (file ``i``'s bytes are found in no other file), some nested."""
    root = tmp_path / "corpus"
    for i in range(n):
        d = root / f"pkg{i % 3}" / ("sub" if i % 2 else "")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i:03d}.py").write_text(f"# file {i:03d} <{'abcdefgh'[i % 8] * 5}>\n" * 6)
    return root


def _contents(root) -> dict:
    return {os.path.relpath(os.path.join(r, f), root).replace(os.sep, "/"): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(root) for f in fs}


def test_tokens_are_the_bytes_of_a_file(tmp_path):
    """One file: the region split; training + held-out bytes are the file, in order; each window is seq + 1
    consecutive bytes of the training part, int32 in [0, 256)."""
    raw = bytes(range(1, 256)) * 3 + "héllo wörld\n".encode() * 20   # every byte but NUL (binary)
    f = tmp_path / "one.txt"
    f.write_bytes(raw)
    data = TextData(str(f), seq=SEQ)
    assert data.vocab == 256 and data.documents == 1 and data.split == "region"
    assert data.train_tokens.tobytes() + data.heldout_tokens.tobytes() == raw
    assert data.heldout_tokens.size == round(0.05 * len(raw))
    batch = data.global_batch(0, 16)
    assert batch.shape == (16, SEQ + 1) and batch.dtype == np.int32 and batch.min() >= 0 and batch.max() < 256
    train = data.train_tokens.tobytes()
    for row in batch:
        assert bytes(row.astype(np.uint8)) in train


def test_heldout_files_are_disjoint_from_training(tmp_path):
    """A directory of many files: whole files are held out (in the order of a hash of their path) up to about the
    fraction asked for, each file's bytes are in exactly one part, the held-out windows come from the held-out files
    only, and the choice is the same whatever the seed and whichever process builds it."""
    root = _corpus(tmp_path)
    data = TextData(str(root), seq=SEQ, holdout=0.2)
    assert data.split == "documents" and 0 < len(data.heldout_names) < data.documents == 64
    train, held = data.train_tokens.tobytes(), data.heldout_tokens.tobytes()
    assert 0.2 <= len(held) / (len(held) + len(train)) <= 0.4          # the fraction asked for, up to twice it
    for name, content in _contents(root).items():
        assert (content in held) == (name in data.heldout_names), name
        assert (content in train) == (name not in data.heldout_names), name
    for b in data.heldout_batches(4, 3):
        for row in b:
            assert bytes(row.astype(np.uint8)) in held
    assert TextData(str(root), seq=SEQ, holdout=0.2, seed=5).heldout_names == data.heldout_names


def test_order_is_a_function_of_seed_and_step(tmp_path):
    root = _corpus(tmp_path)
    a, b, c = (TextData(str(root), seq=SEQ, seed=s) for s in (1, 1, 2))
    np.testing.assert_array_equal(a.global_batch(3, 8), b.global_batch(3, 8))      # reproducible
    assert not np.array_equal(a.global_batch(3, 8), c.global_batch(3, 8))          # another seed, another order
    assert not np.array_equal(a.global_batch(3, 8), a.global_batch(4, 8))          # a step's own batch
    # a resumed run reads step 3's batch without reading steps 0-2 first
    fresh = TextData(str(root), seq=SEQ, seed=1)
    np.testing.assert_array_equal(fresh.global_batch(3, 8), a.global_batch(3, 8))
    # the held-out windows are the same for every seed (every configuration evaluated on the same bytes)
    for x, y in zip(a.heldout_batches(8, 2), c.heldout_batches(8, 2)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("processes", [1, 2, 4, 8])
def test_process_shards_tile_the_global_batch(tmp_path, processes):
    data = TextData(str(_corpus(tmp_path)), seq=SEQ, seed=3)
    whole = data.global_batch(7, 16)
    shards = [data.batch(7, 16, p, processes) for p in range(processes)]
    assert all(s.shape == (16 // processes, SEQ + 1) for s in shards)
    np.testing.assert_array_equal(np.concatenate(shards), whole)
    held = [data.heldout_batches(16, 2, p, processes) for p in range(processes)]
    for i, b in enumerate(data.heldout_batches(16, 2)):
        np.testing.assert_array_equal(np.concatenate([h[i] for h in held]), b)
    if processes > 1:
        with pytest.raises(ValueError, match="does not split over"):
            data.batch(7, processes + 1, 0, processes)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_one_process_puts_the_whole_batch_on_the_mesh_split_over_fsdp(tmp_path):
    data = TextData(str(_corpus(tmp_path)), seq=SEQ)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    local = data.batch(0, 16, jax.process_index(), jax.process_count())
    arr = text.on_mesh(local, mesh)
    assert arr.shape == (16, SEQ + 1) and arr.sharding.spec == P(("fsdp",))
    np.testing.assert_array_equal(np.asarray(arr), data.global_batch(0, 16))
    for shard in arr.addressable_shards:        # device i holds rows 2i, 2i + 1
        i = list(mesh.devices.flat).index(shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data), data.global_batch(0, 16)[2 * i:2 * i + 2])


def test_a_directory_is_read_recursively_skipping_hidden_and_binary_files(tmp_path):
    root = tmp_path / "docs"
    (root / "a" / "b").mkdir(parents=True)
    (root / "top.md").write_text("# top\n" * 20)
    (root / "a" / "b" / "deep.txt").write_text("deep text\n" * 20)
    (root / ".hidden.txt").write_text("hidden\n" * 20)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n" * 20)
    (root / "a" / "blob.bin").write_bytes(b"\x00\x01binary" * 20)
    (root / "a" / "empty.txt").write_bytes(b"")
    data = TextData(str(root), seq=SEQ)
    assert data.names == ["a/b/deep.txt", "top.md"] and data.documents == 2
    both = data.train_tokens.tobytes() + data.heldout_tokens.tobytes()
    assert b"deep text" in both and b"# top" in both and b"hidden" not in both and b"binary" not in both
    assert TextData(str(root), seq=SEQ, suffixes=(".md",)).names == ["top.md"]
    single = TextData(str(root / "top.md"), seq=SEQ)                  # a file: itself
    assert single.names == ["top.md"] and single.train_tokens.tobytes() + single.heldout_tokens.tobytes() == \
        b"# top\n" * 20


def test_default_corpus_is_the_standard_librarys_python_sources():
    data = TextData(None, seq=64)
    assert data.path == text.stdlib_dir() and data.split == "documents"
    assert data.documents > 100 and all(n.endswith(".py") for n in data.names)
    assert not any(part in ("site-packages", "dist-packages") for n in data.names for part in n.split("/"))
    assert "os.py" in data.names


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def _mkdir(path):
    path.mkdir()
    return path


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "nowhere", "does not exist"),
    (lambda d: _write(d / "empty.txt", b""), "is empty"),
    (lambda d: _mkdir(d / "e"), "holds no non-empty text files"),
    (lambda d: _write(d / "bin", b"\x00" * 100), "is not a text file"),
    (lambda d: _write(d / "tiny.txt", b"short"), "a training window and a held-out one"),
], ids=["missing", "empty file", "empty directory", "binary file", "too short"])
def test_a_path_with_no_usable_text_is_one_error_naming_the_option(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ValueError) as e:
        TextData(str(path), seq=SEQ, option="--corpus")
    assert str(e.value).startswith(f"--corpus: {path}") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
