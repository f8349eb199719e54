"""SIGINT / SIGTERM at random moments of `jaxquant ckpt convert` (DCP -> Orbax, Orbax -> DCP, DCP -> DCP) and of
`save_dcp`: the source is untouched, no staging directory is left, the destination is absent or complete,
the command prints one line and exits 130 / 143. A SIGKILLed write's staging directory is removed by the next.

Importing jax + orbax takes seconds on a loaded 2-core machine, so the children are forked from one server
process that imported everything once (the real `jaxquant.cli.main` runs in each child).
"""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

common.setup_devices()

from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.checkpoint import fsutil  # noqa: E402

# Forks one child per request ({"kind": "cli"|"save", "argv"|"path", "log"}) and answers "<pid>", then
# "<exit status> <seconds>". Signals are blocked across the fork, so one sent before the child's handlers exist
# is delivered once they do (cli_handlers unblocks them), never lost or handled by the defaults.
_SERVER = r"""
import json, os, signal, sys, time, traceback
import numpy as np
import jaxquant.cli as cli
from jaxquant import checkpoint as ck
import orbax.checkpoint, tensorstore  # noqa: F401
SIGS = {signal.SIGINT, signal.SIGTERM}
rng = np.random.default_rng(1)
TREE = {f"t{i}": rng.integers(0, 255, (1024, 4096), dtype=np.uint8) for i in range(16)}  # 64 MiB
TREE["step"] = 5
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGS)
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1), os.dup2(fd, 2)
        code = 99
        try:
            if req["kind"] == "cli":
                for s in SIGS:  # what main restores when it returns: a kill after that changes nothing
                    signal.signal(s, signal.SIG_IGN)
                code = cli.main(req["argv"])
            else:  # library call with the default dispositions (KeyboardInterrupt, terminate)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGS)
                try:
                    ck.save_dcp(req["path"], TREE)
                    code = 0
                    signal.pthread_sigmask(signal.SIG_BLOCK, SIGS)
                except KeyboardInterrupt:
                    code = 130
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGS)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), time.time() - t0, flush=True)
"""


class Server:
    def __init__(self):
        self.p = subprocess.Popen([sys.executable, "-c", _SERVER], env=common.env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def run(self, req, kill=None):
        """Run ``req`` in a fresh child; ``kill=(signal, when)``, ``when`` a delay in seconds or a predicate
        polled until true (at most 60 s). Returns (exit status, seconds, log text)."""
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        pid = int(self.p.stdout.readline())
        if kill is not None:
            if callable(kill[1]):
                deadline = time.time() + 60
                while not kill[1]() and time.time() < deadline:
                    time.sleep(0.001)
            else:
                time.sleep(kill[1])
            try:
                os.kill(pid, kill[0])
            except ProcessLookupError:
                pass  # finished already
        rc, secs = self.p.stdout.readline().split()
        with open(req["log"]) as f:
            return int(rc), float(secs), f.read()

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def _snapshot(path):
    out = {}
    for root, _, files in os.walk(path):
        for n in files:
            st = os.stat(os.path.join(root, n))
            out[os.path.relpath(os.path.join(root, n), path)] = (st.st_size, st.st_mtime_ns)
    return out


def _digest(path):
    h = hashlib.sha256()
    for rel in sorted(_snapshot(path)):
        h.update(rel.encode())
        with open(os.path.join(path, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _complete(dst, to):
    if not os.path.isdir(dst) or os.path.exists(os.path.join(dst, fsutil.INCOMPLETE_MARKER)):
        return False
    if to == "dcp":
        return ck.inspect_dcp(dst)["ok"]
    return all(os.path.exists(os.path.join(dst, n)) for n in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt"))


def _baseline(server, req, dst, to, said):
    """How long an uninterrupted run takes (the faster of two: the first may read a cold page cache)."""
    times = []
    for _ in range(2):
        rc, secs, out = server.run(req)
        assert rc == 0 and out.strip() == said and _complete(dst, to), out
        shutil.rmtree(dst)
        times.append(secs)
    return min(times)


def _trials(server, tmp, src, to, n, seed, argv_extra=()):
    """Kill ``n`` conversions src -> <tmp>/dst at random moments, alternating SIGINT and SIGTERM."""
    before = _snapshot(src)
    dst, log = str(tmp / "dst"), str(tmp / "log.txt")
    argv = ["ckpt", "convert", src, dst, "--to", to, "--no-progress", *argv_extra]
    full = _baseline(server, {"kind": "cli", "argv": argv, "log": log}, dst, to, f"wrote {dst}")
    rng = random.Random(seed)
    outcomes = {"interrupted": 0, "finished": 0}
    for i in range(n):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        rc, _, out = server.run({"kind": "cli", "argv": argv, "log": log}, kill=(sig, rng.uniform(0, 1.1 * full)))
        what = f"{to} trial {i}: {signal.Signals(sig).name}, exit {rc}, output {out!r}"
        assert rc in (0, 128 + sig), what
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, what
        if rc:
            assert out.startswith(f"jaxquant ckpt convert: interrupted by {signal.Signals(sig).name}") or \
                out.startswith(f"jaxquant: interrupted by {signal.Signals(sig).name}"), what
        left = [n for n in os.listdir(tmp) if ".tmp-" in n]
        assert not left, f"{what}: staging left: {[(n, sorted(_snapshot(tmp / n))) for n in left]}"
        if os.path.exists(dst):  # only ever a complete checkpoint (the signal came after the rename)
            assert _complete(dst, to), what
            assert rc == 0 or "complete already" in out or out.startswith("jaxquant: interrupted"), what
            shutil.rmtree(dst)
        else:
            assert rc != 0, what
        outcomes["interrupted" if rc else "finished"] += 1
        assert _snapshot(src) == before, f"{what}: source changed"
    assert outcomes["interrupted"] >= n // 4, outcomes  # the moments fell inside the conversion, mostly
    return full


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def _make_source(path):
    rng = np.random.default_rng(0)
    tree = {f"layers.{i}.w": ck.LocalShards((1024, 4096), np.uint8, [
        ((r, 0), rng.integers(0, 255, (512, 4096), dtype=np.uint8)) for r in (0, 512)]) for i in range(16)}  # 64 MiB
    tree["step"] = 3
    ck.save_dcp(path, tree)


def test_signals_at_random_moments_of_convert_leave_no_debris(server, tmp_path):
    src = str(tmp_path / "src")
    _make_source(src)
    digest = _digest(src)
    for to, n, seed, sub in (("orbax", 20, 1, "a"), ("dcp", 10, 3, "c")):
        (tmp_path / sub).mkdir()
        _trials(server, tmp_path / sub, src, to, n, seed)
    # Orbax -> DCP: from an Orbax checkpoint made by the same code
    orbax_src = str(tmp_path / "orbax_src")
    assert server.run({"kind": "cli", "argv": ["ckpt", "convert", src, orbax_src, "--to", "orbax", "--no-progress"],
                       "log": str(tmp_path / "log.txt")})[0] == 0
    odigest = _digest(orbax_src)
    (tmp_path / "b").mkdir()
    _trials(server, tmp_path / "b", orbax_src, "dcp", 20, 2)
    assert _digest(src) == digest and _digest(orbax_src) == odigest


def test_signals_at_random_moments_of_save_dcp_leave_no_debris(server, tmp_path):
    dst, log = str(tmp_path / "dst"), str(tmp_path / "log.txt")
    full = _baseline(server, {"kind": "save", "path": dst, "log": log}, dst, "dcp", "")
    rng = random.Random(4)
    interrupted = 0
    for i in range(10):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        rc, _, out = server.run({"kind": "save", "path": dst, "log": log}, kill=(sig, rng.uniform(0, 1.1 * full)))
        what = f"save trial {i}: {signal.Signals(sig).name}, exit {rc}, output {out!r}"
        # SIGINT: KeyboardInterrupt reaches the caller; SIGTERM: the process still dies of SIGTERM, after cleanup
        assert rc in ((0, 130) if sig == signal.SIGINT else (0, -signal.SIGTERM)), what
        assert "Traceback" not in out, what
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n], f"{what}: staging left: {os.listdir(tmp_path)}"
        if os.path.exists(dst):
            assert _complete(dst, "dcp"), what
            shutil.rmtree(dst)
        interrupted += rc != 0
    assert interrupted >= 3


def test_sigkilled_write_is_never_a_checkpoint_and_the_next_write_removes_it(server, tmp_path):
    dst, log = str(tmp_path / "dst"), str(tmp_path / "log.txt")
    _baseline(server, {"kind": "save", "path": dst, "log": log}, dst, "dcp", "")
    # killed once its staging directory exists, so mid-write (a fixed delay once outlasted a fast write on
    # a loaded CI machine); a write that still wins the race is retried
    staging = lambda: any(n.startswith("dst.tmp-") for n in os.listdir(tmp_path))
    for _ in range(3):
        rc, _, _ = server.run({"kind": "save", "path": dst, "log": log}, kill=(signal.SIGKILL, staging))
        if rc != 0:
            break
        shutil.rmtree(dst)
    assert rc == -signal.SIGKILL and not os.path.exists(dst)
    (left,) = [n for n in os.listdir(tmp_path) if n.startswith("dst.tmp-")]
    with pytest.raises(ck.IncompleteCheckpointError, match="interrupted"):
        ck.inspect_dcp(str(tmp_path / left))
    live = tmp_path / f"dst.tmp-{fsutil.HOST_TAG}-{os.getpid()}-0123abcd"  # a live writer's: kept
    live.mkdir()
    ck.save_dcp(dst, {"x": np.arange(4)})
    assert sorted(os.listdir(tmp_path)) == sorted(["dst", live.name, "log.txt"])
