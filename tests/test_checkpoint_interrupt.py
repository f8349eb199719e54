"""SIGINT / SIGTERM at every named stage of `jaxquant ckpt convert` (DCP -> Orbax, Orbax -> DCP, DCP -> DCP) and of
`save_dcp`: the source is untouched, no staging directory is left, the destination is absent (or complete, when the
signal came after the rename), the command prints one line and exits 130 / 143. A SIGKILLed write's staging
directory is removed by the next.

Deterministic: each child stops at the write's named stages (``jaxquant.checkpoint.interrupt.stage``, enabled by
``JAXQUANT_TEST_STAGES``) and waits for the test, which sends the signal there and lets it go on; the child resets
SIGINT/SIGTERM to their defaults itself, so what the test runner was started with (a background job of a
non-interactive shell has SIGINT ignored) changes nothing.

Importing jax + orbax takes seconds on a loaded 2-core machine, so the children are forked from one server
process that imported everything once (the real `jaxquant.cli.main` runs in each child).
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402
from support.files import file_digest, file_snapshot, stage_moments  # noqa: E402

common.setup_devices()

from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.checkpoint import fsutil  # noqa: E402
from jaxquant.checkpoint.interrupt import STAGES_ENV  # noqa: E402

# Forks one child per request ({"kind": "cli"|"save", "argv"|"path", "log"}) and prints "pid <pid>", then
# "exit <exit status> <seconds>". Between the two, the child prints "stage <pid> <name>" on the same stdout at each
# stage of its write and reads the test's answer ("go" or a signal number) from this process's stdin, which this
# process does not read while the child runs; an answer that a killed child left unread is skipped here (not JSON).
# Signals are blocked across the fork and unblocked once the child's dispositions are set.
_SERVER = r"""
import json, os, signal, sys, time, traceback
import numpy as np
import jaxquant.cli as cli
from jaxquant import checkpoint as ck
import orbax.checkpoint, tensorstore  # noqa: F401
SIGS = {signal.SIGINT, signal.SIGTERM}
rng = np.random.default_rng(1)
TREE = {f"t{i}": rng.integers(0, 255, (1024, 4096), dtype=np.uint8) for i in range(4)}  # 16 MiB
TREE["step"] = 5
OUT = os.dup(1)  # the test reads the children's stage lines here, with this process's
print("ready", flush=True)
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    req = json.loads(line)
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGS)
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        os.environ[sys.argv[1]] = f"0,{OUT}"
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1), os.dup2(fd, 2)
        code = 99
        try:
            if req["kind"] == "cli":
                for s in SIGS:  # what main restores when it returns: a kill after that changes nothing
                    signal.signal(s, signal.SIG_IGN)
                code = cli.main(req["argv"])
            else:  # library call with the default dispositions (KeyboardInterrupt, terminate)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
    print("pid", pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print("exit", os.waitstatus_to_exitcode(status), time.time() - t0, flush=True)
"""


class Server:
    def __init__(self):
        self.p = subprocess.Popen([sys.executable, "-c", _SERVER, STAGES_ENV], env=common.env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def run(self, req, signal_at=lambda i, name: None):
        """Run ``req`` in a fresh child. At its ``i``-th stage ``name`` (from 0), ``signal_at(i, name)`` returns a
        signal to send it there, or None. Returns (exit status, seconds, log text, the stages' names)."""
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        stages = []
        while True:
            what, *rest = self.p.stdout.readline().split()
            if what == "pid":
                continue
            if what == "exit":
                rc, secs = int(rest[0]), float(rest[1])
                break
            assert what == "stage", (what, rest)
            pid, name = int(rest[0]), rest[1]
            sig = signal_at(len(stages), name)
            stages.append(name)
            if sig is not None:
                os.kill(pid, sig)
                if sig == signal.SIGKILL:
                    continue  # nothing reads an answer
            self.p.stdin.write(("go" if sig is None else str(int(sig))) + "\n")
            self.p.stdin.flush()
        with open(req["log"]) as f:
            return rc, secs, f.read(), stages

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def _complete(dst, to):
    if not os.path.isdir(dst) or os.path.exists(os.path.join(dst, fsutil.INCOMPLETE_MARKER)):
        return False
    if to == "dcp":
        return ck.inspect_dcp(dst)["ok"]
    return all(os.path.exists(os.path.join(dst, n)) for n in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt"))


def _baseline(server, req, dst, to, said):
    """The stages of an uninterrupted run."""
    rc, _, out, stages = server.run(req)
    assert rc == 0 and out.strip() == said and _complete(dst, to), out
    shutil.rmtree(dst)
    assert "renamed" in stages and "chunk" in stages, stages
    return stages


def _signal_at(k, sig):
    """At stage ``k``: ``sig``; at a later ``cleanup`` stage (the staging directory going): the other signal,
    which must change nothing."""
    other = signal.SIGTERM if sig == signal.SIGINT else signal.SIGINT
    return lambda i, name: sig if i == k else (other if i > k and name == "cleanup" else None)


def _trials(server, tmp, src, to, argv_extra=()):
    """Signal a conversion src -> <tmp>/dst at its stages (_moments), alternating SIGINT and SIGTERM."""
    before = file_snapshot(src)
    dst, log = str(tmp / "dst"), str(tmp / "log.txt")
    argv = ["ckpt", "convert", src, dst, "--to", to, "--no-progress", *argv_extra]
    stages = _baseline(server, {"kind": "cli", "argv": argv, "log": log}, dst, to, f"wrote {dst}")
    moments = stage_moments(stages)
    for n, k in enumerate(moments):
        sig = (signal.SIGINT, signal.SIGTERM)[n % 2]
        rc, _, out, seen = server.run({"kind": "cli", "argv": argv, "log": log}, _signal_at(k, sig))
        name = signal.Signals(sig).name
        what = f"{to}: {name} at stage {k} ({stages[k]}), exit {rc}, output {out!r}"
        assert seen[:k + 1] == stages[:k + 1], what
        assert rc == 128 + sig, what
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, what
        assert out.startswith(f"jaxquant ckpt convert: interrupted by {name}; "), what
        left = [n for n in os.listdir(tmp) if ".tmp-" in n]
        assert not left, f"{what}: staging left: {[(n, sorted(file_snapshot(tmp / n))) for n in left]}"
        if stages[k] == "renamed":  # the signal came after the rename: a complete checkpoint, and said so
            assert _complete(dst, to) and f"{dst} was complete already" in out, what
            shutil.rmtree(dst)
        else:
            assert not os.path.exists(dst) and f"nothing was written to {dst}" in out, what
            assert "cleanup" in seen[k:], what
        assert file_snapshot(src) == before, f"{what}: source changed"
    return stages


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def _make_source(path):
    rng = np.random.default_rng(0)
    tree = {f"layers.{i}.w": ck.LocalShards((1024, 4096), np.uint8, [
        ((r, 0), rng.integers(0, 255, (512, 4096), dtype=np.uint8)) for r in (0, 512)]) for i in range(4)}  # 16 MiB
    tree["step"] = 3
    ck.save_dcp(path, tree)


@pytest.mark.slow
def test_signals_at_every_stage_of_convert_leave_no_debris(server, tmp_path):
    src = str(tmp_path / "src")
    _make_source(src)
    digest = file_digest(src)
    (tmp_path / "a").mkdir()
    stages = _trials(server, tmp_path / "a", src, "orbax")
    assert {"staging", "entry", "chunk", "tensorstore", "commit", "renamed"} <= set(stages), stages
    (tmp_path / "c").mkdir()
    _trials(server, tmp_path / "c", src, "dcp")
    # Orbax -> DCP: from an Orbax checkpoint made by the same code
    orbax_src = str(tmp_path / "orbax_src")
    assert server.run({"kind": "cli", "argv": ["ckpt", "convert", src, orbax_src, "--to", "orbax", "--no-progress"],
                       "log": str(tmp_path / "log.txt")})[0] == 0
    odigest = file_digest(orbax_src)
    (tmp_path / "b").mkdir()
    assert "restore" in _trials(server, tmp_path / "b", orbax_src, "dcp")
    assert file_digest(src) == digest and file_digest(orbax_src) == odigest


def test_signals_at_every_stage_of_save_dcp_leave_no_debris(server, tmp_path):
    dst, log = str(tmp_path / "dst"), str(tmp_path / "log.txt")
    stages = _baseline(server, {"kind": "save", "path": dst, "log": log}, dst, "dcp", "")
    for n, k in enumerate(stage_moments(stages)):
        sig = (signal.SIGINT, signal.SIGTERM)[n % 2]
        rc, _, out, seen = server.run({"kind": "save", "path": dst, "log": log}, _signal_at(k, sig))
        what = f"save: {signal.Signals(sig).name} at stage {k} ({stages[k]}), exit {rc}, output {out!r}"
        assert seen[:k + 1] == stages[:k + 1], what
        # SIGINT: KeyboardInterrupt reaches the caller; SIGTERM: the process still dies of SIGTERM, after cleanup
        assert rc == (130 if sig == signal.SIGINT else -signal.SIGTERM), what
        assert "Traceback" not in out, what
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n], f"{what}: staging left: {os.listdir(tmp_path)}"
        if stages[k] == "renamed":
            assert _complete(dst, "dcp"), what
            shutil.rmtree(dst)
        else:
            assert not os.path.exists(dst) and "cleanup" in seen[k:], what


def test_sigkilled_write_is_never_a_checkpoint_and_the_next_write_removes_it(server, tmp_path):
    dst, log = str(tmp_path / "dst"), str(tmp_path / "log.txt")
    stages = _baseline(server, {"kind": "save", "path": dst, "log": log}, dst, "dcp", "")
    # killed mid-write: after its first chunk
    k = stages.index("chunk")
    rc, _, _, seen = server.run({"kind": "save", "path": dst, "log": log},
                                lambda i, name: signal.SIGKILL if i == k else None)
    assert rc == -signal.SIGKILL and not os.path.exists(dst) and seen == stages[:k + 1]
    (left,) = [n for n in os.listdir(tmp_path) if n.startswith("dst.tmp-")]
    with pytest.raises(ck.IncompleteCheckpointError, match="interrupted"):
        ck.inspect_dcp(str(tmp_path / left))
    live = tmp_path / f"dst.tmp-{fsutil.HOST_TAG}-{os.getpid()}-0123abcd"  # a live writer's: kept
    live.mkdir()
    ck.save_dcp(dst, {"x": np.arange(4)})
    assert sorted(os.listdir(tmp_path)) == sorted(["dst", live.name, "log.txt"])


def test_a_write_killed_before_its_marker_leaves_nothing_taken_for_a_checkpoint(tmp_path):
    """SIGKILL between the staging directory's ``mkdir`` and its marker (CI once killed a convert there, and
    ``inspect`` took the unmarked directory for a broken checkpoint): the directory is made under a hidden name and
    renamed only once marked, so only the hidden one is left, and the next write to the destination removes it."""
    dst = str(tmp_path / "dst")
    code = ("import os, signal\nfrom jaxquant.checkpoint import fsutil\n"
            "fsutil._write_marker = lambda d: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"fsutil.make_staging(fsutil.staging_path({dst!r}), {dst!r})\n")
    r = subprocess.run([sys.executable, "-c", code], env=common.env(), capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".dst.tmp-") and os.listdir(tmp_path / left) == []
    ck.save_dcp(dst, {"x": np.arange(4)})
    assert os.listdir(tmp_path) == ["dst"] and ck.inspect_dcp(dst)["ok"]
