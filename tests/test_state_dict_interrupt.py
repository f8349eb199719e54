"""Ctrl-C during a training save leaves the previous training checkpoint as it was.

The demo (``--save-every N``) saves each training checkpoint to a new directory beside the previous ones in its
checkpoint directory (``<recipe>-step<N>``); ``save_dcp`` never overwrites (a destination that exists is refused).
So with the step-1 training state saved at ``ckpt/bf16-step1``, a save of the step-2 state to ``ckpt/bf16-step2``
is interrupted by SIGINT: at every named stage of the write (``jaxquant.checkpoint.interrupt.stage``, enabled by
``JAXQUANT_TEST_STAGES``: first, middle and last occurrence of each) and at random moments (uniform over the
shortest of 3 uninterrupted saves' duration, several seeds). After each: ``bf16-step1`` has the same files, bytes
and times, and loads with ``step.load_state_dict`` equal to what was saved; nothing else is in ``ckpt`` but
``bf16-step2`` when the write had completed (then complete and equal to the step-2 state); no staging directory
or file is left. A save of the newer state to the previous checkpoint's own path is refused and changes nothing.

The saving process (a library caller: SIGINT at its default, ``KeyboardInterrupt``) holds the step-2 state on 8
devices and saves it on request, many times; SIGINT is blocked between requests so that a signal which comes
after a save ended cannot land in the loop itself (a stale one is discarded before the next save).
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import jaxquant as jq  # noqa: E402
from ckpt_helpers import common  # noqa: E402
from jaxquant import checkpoint as ck  # noqa: E402
from jaxquant.checkpoint import fsutil  # noqa: E402
from support.meshes import fsdp_mesh  # noqa: E402
from support.files import file_digest, file_snapshot, stage_moments  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")]

ADAM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
D, F, L = 256, 1024, 4          # ~2.2M parameters: 27 MiB of state dict (params, exp_avg, exp_avg_sq)
SEEDS = (0, 1, 2)
TRIALS_PER_SEED = 4


def init_params():
    from support.transformer import VOCAB

    ks = jax.random.split(jax.random.key(0), 4)
    return {"embed": jax.random.normal(ks[0], (VOCAB, D)), "head": jax.random.normal(ks[1], (VOCAB, D)) / 16,
            "blocks": {"w1": jax.random.normal(ks[2], (L, F, D)) / 16, "w2": jax.random.normal(ks[3], (L, D, F)) / 32,
                       "norm": jnp.ones((L, 1, D))}}


def make_step():
    from support.transformer import MASK, loss_scan

    mesh = fsdp_mesh()
    return jq.make_train_step(loss_scan, optax.adam(ADAM["lr"]), mesh=mesh, quantize_mask=MASK,
                              policy=jq.MixedPrecisionPolicy(compute_weights="bf16"))


# argv: SRC (the step-2 state, DCP). Prints "ready"; per request line {"path", "stages"}: "start", (stage lines,
# reading the test's answer on stdin, see interrupt.stage), "end <done|interrupted> <seconds>".
_CHILD = r"""
import json, os, signal, sys, time
SIG = {signal.SIGINT}
signal.pthread_sigmask(signal.SIG_BLOCK, SIG)
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, os.environ["JAXQUANT_TESTS"])
import test_state_dict_interrupt as T
from jaxquant import checkpoint as ck
from jaxquant.checkpoint.interrupt import STAGES_ENV

step = T.make_step()
like = step.init(T.init_params())
state = step.load_state_dict(ck.load_dcp(sys.argv[1], step.state_dict_target(like)), like=like)
tree = step.state_dict(state, hyperparams=T.ADAM)

def line():
    b = b""
    while not b.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            sys.exit(0)
        b += c
    return b.decode()

os.write(1, b"ready\n")
while True:
    req = json.loads(line())
    if signal.SIGINT in signal.sigpending():    # sent after the last save had ended: not for this one
        signal.sigwait(SIG)
    if req["stages"]:
        os.environ[STAGES_ENV] = "0,1"
    else:
        os.environ.pop(STAGES_ENV, None)
    outcome, t0 = "interrupted", time.monotonic()
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIG)
        os.write(1, b"start\n")
        ck.save_dcp(req["path"], tree)
        outcome = "done"
        signal.pthread_sigmask(signal.SIG_BLOCK, SIG)   # (runs the handler of a signal that came just before)
    except KeyboardInterrupt:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIG)
    os.write(1, f"end {outcome} {time.monotonic() - t0:.4f}\n".encode())
"""


class Saver:
    def __init__(self, src):
        env = common.env(JAXQUANT_TESTS=os.path.dirname(os.path.abspath(__file__)))
        self.p = subprocess.Popen([sys.executable, "-c", _CHILD, src], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, bufsize=0)
        self.buf = b""
        assert self.readline(240) == "ready"

    def readline(self, timeout):
        """The next line from the child, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.p.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.p.stdout.fileno(), 4096)
            assert chunk, f"the saving process ended (exit {self.p.wait()})"
            self.buf += chunk
        out, self.buf = self.buf.split(b"\n", 1)
        return out.decode()

    def send(self, text):
        self.p.stdin.write(text.encode() + b"\n")
        self.p.stdin.flush()

    def save(self, path, *, stages=False, at_stage=lambda i, name: None, delay=None):
        """One save of the step-2 state to ``path``: SIGINT ``delay`` seconds after it starts (unless it ended
        first) or at the stages ``at_stage(i, name)`` names. Returns (outcome, seconds, stages seen, signalled)."""
        self.send(json.dumps({"path": path, "stages": stages}))
        assert self.readline(60) == "start"
        seen, signalled = [], False
        if delay is not None:
            first = self.readline(delay)
            if first is None:
                os.kill(self.p.pid, signal.SIGINT)
                signalled = True
            else:
                self.buf = first.encode() + b"\n" + self.buf
        while True:
            what, *rest = self.readline(120).split()
            if what == "end":
                return rest[0], float(rest[1]), seen, signalled
            assert what == "stage", (what, rest)
            sig = at_stage(len(seen), rest[1])
            seen.append(rest[1])
            if sig is not None:
                os.kill(self.p.pid, sig)
                signalled = True
            self.send("go" if sig is None else str(int(sig)))

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def _host(sd):
    flat = {f"model.{n}": a for n, a in sd["model"].items()}
    flat |= {f"optim.{n}.{k}": v for n, e in sd["optim"]["state"].items() for k, v in e.items()}
    return {k: np.asarray(v) for k, v in flat.items()}


def _assert_loads_equal(step, like, path, want, what):
    got = _host(step.state_dict(step.load_state_dict(ck.load_dcp(path, step.state_dict_target(like)), like=like),
                                hyperparams=ADAM))
    assert set(got) == set(want), what
    for k, a in want.items():
        assert common.same_bytes(got[k], a), f"{what}: {k}"


def test_interrupted_training_save_keeps_the_previous_checkpoint(tmp_path):
    from support.transformer import make_batch

    step = make_step()
    like = step.init(init_params())
    state = step.init(init_params())
    state, _ = step(state, make_batch(1))
    ckpt = tmp_path / "ckpt"
    prev = str(ckpt / "bf16-step1")
    sd1 = step.state_dict(state, hyperparams=ADAM)
    ck.save_dcp(prev, sd1)
    want1 = _host(sd1)
    state, _ = step(state, make_batch(2))
    src = str(tmp_path / "src")           # the step-2 state, for the saving process to hold
    sd2 = step.state_dict(state, hyperparams=ADAM)
    ck.save_dcp(src, sd2)
    want2 = _host(sd2)
    assert any(not common.same_bytes(want1[k], want2[k]) for k in want1)
    snap, digest = file_snapshot(prev), file_digest(prev)

    # the newer state to the previous checkpoint's own path: refused, nothing written
    with pytest.raises(ck.DestinationExistsError, match="refusing to overwrite"):
        ck.save_dcp(prev, sd2)
    assert sorted(os.listdir(ckpt)) == ["bf16-step1"] and file_snapshot(prev) == snap

    new = str(ckpt / "bf16-step2")
    saver = Saver(src)
    tally = {"absent": 0, "complete": 0}     # of the random-moment trials

    def check(what, signalled, outcome, count=False):
        left = sorted(os.listdir(ckpt))
        assert left in (["bf16-step1"], ["bf16-step1", "bf16-step2"]), f"{what}: debris {left}"
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n], f"{what}: {os.listdir(tmp_path)}"
        assert file_snapshot(prev) == snap and file_digest(prev) == digest, f"{what}: the previous checkpoint changed"
        _assert_loads_equal(step, like, prev, want1, what)
        if os.path.exists(new):       # completed (no signal, or one after the rename): a whole checkpoint
            assert not os.path.exists(os.path.join(new, fsutil.INCOMPLETE_MARKER)) and ck.inspect_dcp(new)["ok"]
            _assert_loads_equal(step, like, new, want2, what)
            shutil.rmtree(new)
            tally["complete"] += count
        else:
            assert signalled and outcome == "interrupted", what
            tally["absent"] += count

    try:
        outcome, base_s, stages, _ = saver.save(new, stages=True)         # uninterrupted: the stages
        assert outcome == "done" and {"staging", "entry", "chunk", "commit", "renamed"} <= set(stages), stages
        check("uninterrupted", False, outcome)
        for k in stage_moments(stages):   # SIGINT at a stage; a second one during the cleanup changes nothing
            at = lambda i, name: signal.SIGINT if i == k or (i > k and name == "cleanup") else None
            outcome, _, seen, _ = saver.save(new, stages=True, at_stage=at)
            what = f"SIGINT at stage {k} ({stages[k]})"
            assert seen[:k + 1] == stages[:k + 1] and outcome == "interrupted", (what, seen)
            assert ("cleanup" in seen[k:]) == (stages[k] != "renamed"), (what, seen)
            check(what, True, outcome)
        durations = []
        for _ in range(3):                     # its duration without stage stops (the shortest of 3)
            outcome, secs, _, _ = saver.save(new)
            check("uninterrupted", False, outcome)
            durations.append(secs)
        base_s = min(durations)
        for seed in SEEDS:
            rng = np.random.default_rng(seed)
            for n in range(TRIALS_PER_SEED):
                delay = float(rng.uniform(0, base_s))
                outcome, _, _, signalled = saver.save(new, delay=delay)
                check(f"seed {seed} trial {n}: SIGINT {delay * 1e3:.1f} ms into a {base_s * 1e3:.0f} ms save "
                      f"({outcome})", signalled, outcome, count=True)
    finally:
        saver.close()
    # most random moments fell inside the write (which then left nothing behind), not after it
    assert tally["absent"] >= len(SEEDS) * TRIALS_PER_SEED // 2, tally
    print(f"\nsave of {sum(a.nbytes for a in want2.values()) / 2 ** 20:.0f} MiB in {base_s * 1e3:.0f} ms; {tally}")
