"""Multi-process saves: the barriers' timeout (a dead or absent process makes the others raise, and no checkpoint
or staging directory is left, instead of a hang) and the save id drawn without the user's numpy RNG.

The barriers themselves run in threads of this process (they only look at files); the end-to-end cases start 2
JAX processes (``jax.distributed`` on 127.0.0.1, gloo CPU collectives) with a subprocess timeout, so a
regression fails instead of hanging."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

common.setup_devices()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.checkpoint import writer  # noqa: E402

X = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)


def _write_part(path, rank, save_id="t"):
    """Process ``rank``'s half of ``X`` (rows 4*rank..), written as a multi-process save does before it meets the
    others; the staging directory."""
    tree = {"x": ck.LocalShards((8, 4), np.float32, [((4 * rank, 0), X[4 * rank:4 * rank + 4])]), "step": 7}
    return ck.save_dcp(path, tree, process_index=rank, process_count=2, save_id=save_id, finalize=False)


def _meet_in_thread(path, staging, rank, timeout):
    """Start rank ``rank``'s barriers in a thread; join() returns (exception or None, seconds taken)."""
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            writer._meet(path, staging, "t", rank, 2, timeout)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join(limit=60):
        t.join(limit)
        assert not t.is_alive(), f"rank {rank}'s barrier still waiting after {limit} s"
        return out.get("error"), out["seconds"]
    return join


def _leftovers(tmp_path):
    return sorted(os.listdir(tmp_path))


def test_barriers_commit_when_every_process_arrives(tmp_path):
    path = str(tmp_path / "ckpt")
    staging = _write_part(path, 1)
    assert _write_part(path, 0) == staging
    joins = [_meet_in_thread(path, staging, r, 30) for r in (1, 0)]
    for join in joins:
        error, _ = join()
        assert error is None, error
    assert _leftovers(tmp_path) == ["ckpt"]
    assert not os.path.exists(os.path.join(path, writer._DECISION))  # the decision is no part of the checkpoint
    out = ck.load_dcp(path, {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32), "step": int})
    assert common.same_bytes(out["x"], X) and out["step"] == 7


@pytest.mark.parametrize("survivor", [0, 1])
def test_barrier_written_times_out_on_an_absent_process(tmp_path, survivor):
    path = str(tmp_path / "ckpt")
    staging = _write_part(path, survivor)
    error, seconds = _meet_in_thread(path, staging, survivor, 0.5)()
    assert isinstance(error, ck.CheckpointError)
    msg = str(error)
    assert "barrier 'written' timed out after 0.5 s (barrier_timeout_s)" in msg, msg
    assert f"process(es) {1 - survivor} of 2 did not write their part" in msg and "see its log" in msg, msg
    assert "staging directory removed" in msg, msg
    assert 0.5 <= seconds < 5
    assert _leftovers(tmp_path) == []  # no checkpoint, no staging directory


def test_barrier_final_times_out_when_process_0_never_commits(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "_GONE_GRACE_S", 0.2)
    path = str(tmp_path / "ckpt")
    staging = _write_part(path, 1)
    _write_part(path, 0)  # process 0 wrote its part, then never reached its barrier
    error, seconds = _meet_in_thread(path, staging, 1, 0.5)()
    msg = str(error)
    assert isinstance(error, ck.CheckpointError) and "barrier 'final' timed out after 0.5 s" in msg, msg
    assert "process 0 did not commit it" in msg and "staging directory removed" in msg, msg
    assert _leftovers(tmp_path) == []
    # process 0 arriving late cannot commit what was aborted
    error, _ = _meet_in_thread(path, staging, 0, 30)()
    assert isinstance(error, ck.CheckpointError) and "not committed" in str(error), error
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("seen", ["decision", "removal"])
def test_a_failing_process_aborts_the_save_for_the_others_at_once(tmp_path, seen):
    path = str(tmp_path / "ckpt")
    staging = _write_part(path, 0)
    join = _meet_in_thread(path, staging, 0, 60)
    time.sleep(0.2)
    if seen == "decision":  # process 0 looks while process 1's abort is recorded
        assert writer._decide(staging, "abort 1: OSError: [Errno 28] No space left on device") is None
    else:  # process 1's save_dcp after its write failed: the abort, then the staging directory removed at once
        assert writer._give_up(path, staging, 1, OSError(28, "No space left on device")) is None
    error, seconds = join()
    msg = str(error)
    assert isinstance(error, ck.CheckpointError) and seconds < 10, (msg, seconds)
    if seen == "decision":
        assert "process 1 aborted the save of" in msg and "No space left on device" in msg, msg
    else:
        assert "another process aborted the save" in msg, msg
    assert _leftovers(tmp_path) == []


def test_a_commit_in_progress_is_left_alone_at_the_timeout(tmp_path):
    path = str(tmp_path / "ckpt")
    staging = _write_part(path, 1)
    _write_part(path, 0)
    assert writer._decide(staging, "commit") is None  # process 0 began committing, then stalled (or died)
    error, _ = _meet_in_thread(path, staging, 1, 0.5)()
    msg = str(error)
    assert isinstance(error, ck.CheckpointError) and "barrier 'final' timed out" in msg, msg
    assert "process 0 began committing it" in msg and "left as it is" in msg, msg
    assert os.path.isdir(staging)  # not ours to delete: process 0 may still rename it
    # an abort now loses to the commit decision, and removes nothing
    assert writer._give_up(path, staging, 1, RuntimeError("late")) is None
    assert os.path.isdir(staging)


def _save_in_threads(monkeypatch, path, fail_rank=None, timeout=30):
    """Both processes' ``save_dcp`` as threads of this one, as under a 2-process JAX runtime (jax.process_count()
    says 2 meanwhile); ``fail_rank``'s write fails once the other waits at the barrier. {rank: exception or None}."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    real = writer._write_rank_plan

    def write_rank_plan(staging, rank, w):
        if rank == fail_rank:
            other = os.path.join(staging, f"__{1 - rank}{writer._PLAN_SUFFIX}")
            for _ in range(1000):
                if os.path.exists(other):
                    break
                time.sleep(0.01)
            raise OSError(28, "No space left on device")
        real(staging, rank, w)
    monkeypatch.setattr(writer, "_write_rank_plan", write_rank_plan)
    errors = {}

    def run(rank):
        tree = {"x": ck.LocalShards((8, 4), np.float32, [((4 * rank, 0), X[4 * rank:4 * rank + 4])]), "step": 7}
        try:
            assert ck.save_dcp(path, tree, process_index=rank, process_count=2, save_id="t",
                               barrier_timeout_s=timeout) == path
            errors[rank] = None
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            errors[rank] = e
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a save still waiting after 60 s"
    return errors


def test_save_dcp_meets_the_other_process_and_commits(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    assert _save_in_threads(monkeypatch, path) == {0: None, 1: None}
    assert _leftovers(tmp_path) == ["ckpt"]
    assert sorted(n for n in os.listdir(path) if not n.startswith("__")) == [".metadata"]
    out = ck.load_dcp(path, {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32), "step": int})
    assert common.same_bytes(out["x"], X) and out["step"] == 7


def test_save_dcp_of_a_failing_process_aborts_the_others(tmp_path, monkeypatch):
    t0 = time.monotonic()
    errors = _save_in_threads(monkeypatch, str(tmp_path / "ckpt"), fail_rank=1)
    assert time.monotonic() - t0 < 20  # not the 30 s timeout: the abort is seen at once
    assert isinstance(errors[1], OSError) and "No space left" in str(errors[1]), errors  # its own error
    assert isinstance(errors[0], ck.CheckpointError) and "aborted the save" in str(errors[0]), errors
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "5", True, None])
def test_barrier_timeout_s_must_be_a_positive_number(tmp_path, bad):
    with pytest.raises(ck.CheckpointError, match="barrier_timeout_s must be a number of seconds > 0"):
        ck.save_dcp(str(tmp_path / "c"), {"x": X}, barrier_timeout_s=bad)
    assert _leftovers(tmp_path) == []


def test_save_leaves_the_numpy_rng_alone(tmp_path):
    np.random.seed(1234)
    before = np.random.get_state()
    ck.save_dcp(str(tmp_path / "c"), {"x": X, "q": jnp.asarray(X), "step": 3})
    _write_part(str(tmp_path / "mp"), 0)
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


# One process of a 2-process JAX job: ``python -c _WORKER RANK PORT PATH MODE``. MODE "ok": both save (save_id
# drawn by process 0); "dead1": process 1 crashes after joining (no jax.distributed shutdown); "absent0": process 0
# stays alive but never saves. The one that saves prints one line "RESULT <json>".
_WORKER = r"""
import json, os, sys, time
rank, port, path, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank)
assert len(jax.devices()) == 4  # (every process takes part in creating the backend: do it before one goes)
import numpy as np
from jaxquant import checkpoint as ck
if (mode, rank) == ("dead1", 1):
    os._exit(0)
if (mode, rank) == ("absent0", 0):
    time.sleep(600)  # the test kills it
np.random.seed(1234)
before = np.random.get_state()
x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
tree = {"x": ck.LocalShards((8, 4), np.float32, [((4 * rank, 0), x[4 * rank:4 * rank + 4])]), "step": 7}
out, t0 = {"rank": rank}, time.monotonic()
try:
    ck.save_dcp(path, tree, **({} if mode == "ok" else {"save_id": "dead", "barrier_timeout_s": 2}))
    out["ok"] = True
except ck.CheckpointError as e:
    out.update(ok=False, error=str(e))
out["seconds"] = time.monotonic() - t0
after = np.random.get_state()
out["rng_same"] = bool(before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:])
print("RESULT " + json.dumps(out), flush=True)
if mode != "ok":
    os._exit(0)  # skip jax.distributed's shutdown barrier: it would wait for the missing process
"""


def _run_job(tmp_path, mode, wait_for):
    """Run the 2 workers; the RESULT of each process in ``wait_for`` (the others are killed once those ended)."""
    path, port = str(tmp_path / "ckpt"), common.free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r), str(port), path, mode], env=common.env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = {r: procs[r].communicate(timeout=120)[0] for r in wait_for}
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    results = {}
    for r, out in outs.items():
        assert procs[r].returncode == 0, out[-3000:]
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, out[-3000:]
        results[r] = json.loads(lines[0][len("RESULT "):])
    return path, results


@pytest.mark.slow
def test_two_processes_save_with_a_drawn_id_and_leave_the_numpy_rng_alone(tmp_path):
    path, results = _run_job(tmp_path, "ok", wait_for=(0, 1))
    for r in (0, 1):
        assert results[r]["ok"] and results[r]["rng_same"], results[r]
    assert _leftovers(tmp_path) == ["ckpt"]
    assert sorted(n for n in os.listdir(path) if not n.startswith("__")) == [".metadata"]
    out = ck.load_dcp(path, {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32), "step": int})
    assert common.same_bytes(out["x"], X) and out["step"] == 7


@pytest.mark.parametrize("mode,survivor", [("dead1", 0), ("absent0", 1)], ids=["process-1-died", "process-0-absent"])
@pytest.mark.fast_cases("process-1-died")
def test_a_dead_or_absent_process_makes_the_other_raise_within_the_timeout(tmp_path, mode, survivor):
    path, results = _run_job(tmp_path, mode, wait_for=(survivor,))
    res = results[survivor]
    assert not res["ok"] and res["rng_same"], res
    assert "barrier 'written' timed out after 2 s (barrier_timeout_s)" in res["error"], res
    assert f"process(es) {1 - survivor} of 2 did not write their part" in res["error"], res
    assert 2 <= res["seconds"] < 12, res
    assert _leftovers(tmp_path) == []  # no checkpoint, no staging directory
