"""Byte-level language-model data from text files: ``jaxquant demo --text`` and benchmarks/bench_convergence.py.

A corpus is a file or a directory of text files (read recursively, in sorted order; hidden entries, empty files and
files that hold a NUL byte, i.e. binaries, are skipped, and ``TextData.skipped`` lists them). Tokens are the bytes
(vocabulary 256). A held-out part, disjoint from the training part, is set aside deterministically: whole
documents (files), taken in the order of a hash of their path relative to the corpus root until they hold the
``holdout`` fraction of the bytes (a file that would take the part past twice that is passed over), or, where no
such choice leaves both parts a window (a single file, a few files of very different sizes), the last ``holdout``
fraction of the corpus's bytes.

Training batches are random windows of ``seq + 1`` tokens (inputs and the targets shifted by one) of the training
part. Batch ``n`` of seed ``s`` depends on ``(s, n)`` only: the order is reproducible, another seed gives another
order, and a resumed run reads the batches the uninterrupted run would have read, without replaying the ones
before. The held-out windows are fixed, evenly spaced over the held-out part (the same for every seed and run, so
every configuration is evaluated on the same tokens).

Multi-process: every process computes the same global batch and keeps its rows (``process_rows``; the shards of
the processes tile the global batch in process order), then ``on_mesh`` makes the global ``jax.Array``, split
over the mesh's batch axes as ``make_train_step`` expects it (on one process: the whole batch).
"""

from __future__ import annotations

import os
import sysconfig
import zlib

import numpy as np

VOCAB = 256                      # byte tokens
HOLDOUT = 0.05                   # default fraction of the corpus held out
# directories under the standard library's that hold other packages (or no sources)
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")


def stdlib_dir() -> str:
    """The directory of the running Python's standard library sources (the default corpus: no download)."""
    return sysconfig.get_paths()["stdlib"]


def _is_text(data: bytes) -> bool:
    return b"\0" not in data


def read_documents(path: str, *, suffixes: tuple | None = None, skip_dirs: tuple = (),
                   option: str = "--text", skipped: list | None = None) -> list[tuple[str, bytes]]:
    """``[(relative path, bytes)]`` of the text files of ``path`` (a file: itself), in sorted path order.

    Args:
      path: a file or a directory (walked recursively; hidden files and directories are skipped).
      suffixes: only files whose name ends with one of these (e.g. ``(".py",)``); None: every text file.
      skip_dirs: directory names not entered (e.g. ``site-packages``).
      option: the option ``path`` came from, which each error message starts with.
      skipped: if given, ``(relative path, why)`` is appended for each entry of a directory ``path`` that was
        passed over: a hidden file or directory (``hidden``; not entered), a binary file (``binary: holds a NUL
        byte``) or an empty one (``empty``), in sorted path order. (Files ``suffixes`` leaves out and ``skip_dirs``
        are not inputs: not listed.)

    Raises:
      ValueError: ``"{option}: ..."`` when ``path`` does not exist, cannot be read or holds no text.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{option}: must be a file or a directory of text files, got {path!r}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"{option}: {path} does not exist")
    passed = []      # (relative path, why) of the entries passed over
    rel = lambda f: os.path.relpath(f, path).replace(os.sep, "/")  # noqa: E731
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            passed += [(rel(os.path.join(root, d)) + "/", "hidden") for d in dirs if d.startswith(".")]
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skip_dirs)
            passed += [(rel(os.path.join(root, n)), "hidden") for n in names if n.startswith(".")]
            files += [os.path.join(root, n) for n in names
                      if not n.startswith(".") and (suffixes is None or n.endswith(tuple(suffixes)))]
        files.sort()
    else:
        files = [path]
    docs = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise ValueError(f"{option}: cannot read {f}: {e.strerror or e}") from None
        if data and _is_text(data):
            docs.append((rel(f) if os.path.isdir(path) else os.path.basename(f), data))
        elif os.path.isdir(path):
            passed.append((rel(f), "binary: holds a NUL byte" if data else "empty"))
    if skipped is not None:
        skipped += sorted(passed)
    if not docs:
        what = "is empty" if not os.path.isdir(path) and os.path.getsize(path) == 0 else (
            "is not a text file (it holds NUL bytes)" if not os.path.isdir(path) else
            f"holds no non-empty text files{' ending in ' + '/'.join(suffixes) if suffixes else ''}")
        raise ValueError(f"{option}: {path} {what}")
    return docs


def process_rows(global_rows: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch of ``global_rows`` that process ``process_index`` of ``process_count`` holds:
    equal contiguous blocks in process order (they tile the batch)."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} must be in [0, process_count={process_count})")
    if global_rows % process_count:
        raise ValueError(f"the global batch of {global_rows} rows does not split over {process_count} processes")
    n = global_rows // process_count
    return slice(process_index * n, (process_index + 1) * n)


def on_mesh(local, mesh, axes=("fsdp",)):
    """The global ``jax.Array`` whose rows this process holds as ``local`` (``process_rows`` of it), split over
    ``axes`` of ``mesh`` (the batch sharding ``make_train_step`` expects: ``P(axes)`` on the leading axis)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P(tuple(axes)))
    rows = local.shape[0] * jax.process_count()
    return jax.make_array_from_process_local_data(sharding, local, (rows,) + tuple(local.shape[1:]))


class TextData:
    """Byte tokens of a corpus with a held-out split, and the batches of a training run.

    Args:
      path: a file or a directory of text files; None: the Python standard library's ``.py`` sources.
      seq: tokens a sequence is trained on (windows of ``seq + 1`` bytes).
      seed: the order of the training windows.
      holdout: the fraction of the corpus held out (0 < holdout < 1).
      suffixes: only files ending so (None: every text file; the standard library: ``.py``).
      option: the option ``path`` came from, named by the error messages.
    """

    vocab = VOCAB

    def __init__(self, path: str | None = None, *, seq: int, seed: int = 0, holdout: float = HOLDOUT,
                 suffixes: tuple | None = None, option: str = "--text"):
        if seq < 1:
            raise ValueError(f"seq: must be at least 1, got {seq}")
        if not 0 < holdout < 1:
            raise ValueError(f"holdout: must be between 0 and 1, got {holdout}")
        stdlib = path is None
        self.path = stdlib_dir() if stdlib else os.fspath(path)
        self.seq, self.seed = seq, seed
        self.skipped = []    # (relative path, why) of the entries of a directory passed over (read_documents)
        docs = read_documents(self.path, suffixes=(".py",) if stdlib and suffixes is None else suffixes,
                              skip_dirs=_NOT_STDLIB if stdlib else (), option=option, skipped=self.skipped)
        self.names = [name for name, _ in docs]
        self.documents = len(docs)
        window = seq + 1
        # whole documents, taken in the order of a hash of their relative path (a fixed pseudo-random order) until
        # they hold the fraction of the bytes; one that would take it past twice the fraction is passed over
        total, target, held_bytes = sum(len(d) for _, d in docs), holdout * sum(len(d) for _, d in docs), 0
        held = [False] * len(docs)
        for i in sorted(range(len(docs)), key=lambda i: (zlib.crc32(docs[i][0].encode()), docs[i][0])):
            if held_bytes >= target:
                break
            if held_bytes + len(docs[i][1]) <= 2 * target and total - held_bytes - len(docs[i][1]) >= window:
                held[i], held_bytes = True, held_bytes + len(docs[i][1])
        train = b"".join(d for (_, d), h in zip(docs, held) if not h)
        heldout = b"".join(d for (_, d), h in zip(docs, held) if h)
        self.split = "documents"
        self.heldout_names = [name for name, h in zip(self.names, held) if h]   # (region split: none)
        if len(train) < window or len(heldout) < window:     # too few documents: the corpus's last bytes instead
            data = b"".join(d for _, d in docs)
            if len(data) < 2 * window:
                raise ValueError(f"{option}: {self.path} holds {len(data)} bytes; a training window and a held-out "
                                 f"one of seq + 1 = {window} bytes need at least {2 * window}")
            cut = max(window, len(data) - max(window, int(round(holdout * len(data)))))
            train, heldout = data[:cut], data[cut:]
            self.split, self.heldout_names = "region", []
        self.train_tokens = np.frombuffer(train, np.uint8)
        self.heldout_tokens = np.frombuffer(heldout, np.uint8)

    def describe(self) -> str:
        how = (f"{len(self.heldout_names)} of {self.documents} files held out" if self.split == "documents"
               else f"the last {self.heldout_tokens.size:,} bytes held out")
        return (f"{self.path}: {self.documents} file{'s' * (self.documents != 1)}, "
                f"{self.train_tokens.size:,} training bytes, {self.heldout_tokens.size:,} held-out ({how})")

    def describe_skipped(self, most: int = 10) -> str | None:
        """The entries of the corpus passed over, the first ``most`` named with why; None when there are none."""
        if not self.skipped:
            return None
        named = ", ".join(f"{name} ({why})" for name, why in self.skipped[:most])
        more = f" and {len(self.skipped) - most} more" if len(self.skipped) > most else ""
        return (f"{self.path}: skipped {len(self.skipped)} entr{'ies' if len(self.skipped) != 1 else 'y'}: "
                f"{named}{more}")

    def _windows(self, tokens, starts) -> np.ndarray:
        return tokens[np.asarray(starts)[:, None] + np.arange(self.seq + 1)].astype(np.int32)

    def global_batch(self, step: int, batch: int) -> np.ndarray:
        """int32 ``[batch, seq + 1]``: the training windows of step ``step`` (a function of the seed and step)."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.train_tokens.size - self.seq, size=batch)
        return self._windows(self.train_tokens, starts)

    def batch(self, step: int, batch: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """This process's rows (``process_rows``) of the global batch of step ``step``."""
        return self.global_batch(step, batch)[process_rows(batch, process_index, process_count)]

    def heldout_batches(self, batch: int, count: int, process_index: int = 0, process_count: int = 1) -> list:
        """``count`` batches of ``batch`` held-out windows (this process's rows of each), evenly spaced over the
        held-out part; the same whatever the seed."""
        last = self.heldout_tokens.size - self.seq - 1
        starts = np.linspace(0, last, batch * count).round().astype(np.int64).reshape(count, batch)
        rows = process_rows(batch, process_index, process_count)
        return [self._windows(self.heldout_tokens, s)[rows] for s in starts]
