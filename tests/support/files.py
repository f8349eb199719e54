"""A directory's files as the interrupt tests compare them: what is there (sizes, times), and their bytes."""

import hashlib
import os


def file_snapshot(path):
    """relative path -> (size, mtime_ns) of every file under ``path``."""
    out = {}
    for root, _, files in os.walk(path):
        for n in files:
            st = os.stat(os.path.join(root, n))
            out[os.path.relpath(os.path.join(root, n), path)] = (st.st_size, st.st_mtime_ns)
    return out


def file_digest(path):
    """sha256 of every file's relative path and bytes under ``path``, in path order."""
    h = hashlib.sha256()
    for rel in sorted(file_snapshot(path)):
        h.update(rel.encode())
        with open(os.path.join(path, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def stage_moments(stages):
    """Indices of the stages to signal at: the first, middle and last occurrence of each name."""
    at = {}
    for i, name in enumerate(stages):
        at.setdefault(name, []).append(i)
    return sorted({i for idx in at.values() for i in (idx[0], idx[len(idx) // 2], idx[-1])})
