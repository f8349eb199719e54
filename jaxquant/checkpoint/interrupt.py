"""SIGINT / SIGTERM during a checkpoint write: taken at check points, so the staging directory is removed.

A signal handler that raises can fire anywhere the interpreter runs Python code: between starting a TensorStore
commit and waiting for it (the commit then re-creates the staging directory after the cleanup removed it), or
inside a garbage-collection callback or ``__del__``, where Python prints the exception and drops it (the write
then finishes as if no signal had come; CI saw both). So inside a *write section* (``save_dcp``, ``convert``) and inside
``deferred`` blocks the handler only records the first signal; :func:`check` raises it as :class:`Interrupted`
(a ``KeyboardInterrupt``) at points the write chooses (between chunks, before the commit's rename), and leaving
the outermost section raises one that came after the last check point. Once :func:`check` has raised it, later
signals are ignored while the exception unwinds, so the write's cleanup is never cut short. Outside those sections
(the demo's training loop, ``inspect``) :func:`on_signal`, installed by a program for its whole run (the ``jaxquant``
command does, jaxquant/cli/signals.py), raises at once, as Python's own SIGINT handling does; one that Python drops
there stays pending, unprinted, for the next check point or signal.

A SIGKILL cannot be handled: it leaves a marked staging directory that the next write to the same destination
removes (``fsutil.remove_stale_staging``).

Tests stop a write at named moments (:func:`stage`) to signal it there; outside tests :func:`stage` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Tests only: "<read fd>,<write fd>" makes stage() report each named moment of a write and wait there (see stage)
STAGES_ENV = "JAXQUANT_TEST_STAGES"


class Interrupted(KeyboardInterrupt):
    """A write was interrupted by ``signum``; ``exit_code`` is the shell convention 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Signals:
    """What :func:`on_signal` has seen. Signal dispositions belong to the process, so this is one per process;
    it is reset whenever our handler is installed where it was not."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.pending = None  # the first signal recorded inside a section, not yet raised
        self.raised = False  # check() raised the pending signal: ignore the rest while the write cleans up
        self.depth = 0  # nesting of write sections / deferred blocks (0: a signal raises at once)


_STATE = _Signals()
_HANDLED = [0]  # signals on_signal has run for in this process (never reset: stage() waits for it to grow)


def reset() -> None:
    """Forget what :func:`on_signal` recorded (a program does this when it installs or removes the handler)."""
    _STATE.reset()


def on_signal(signum, _frame):
    """A SIGINT/SIGTERM handler for a program that takes the signals for its whole run: raises
    :class:`Interrupted` at once outside write sections, records the signal inside them (see the module
    docstring)."""
    _HANDLED[0] += 1
    st = _STATE
    if st.raised:
        return  # unwinding after an interrupt: let the cleanup finish
    if st.pending is None:
        st.pending = signum
    if st.depth == 0:  # no write in progress: nothing to clean up, stop now (every signal raises here, so one
        raise Interrupted(signum)  # that something caught or dropped does not silence the next)


on_signal.counts_handled = True  # stage() waits for handlers so marked (they count in _HANDLED)


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def check() -> None:
    """Raise :class:`Interrupted` for a signal recorded since the write began (once); otherwise nothing.

    Call it where stopping leaves nothing in flight: every file and TensorStore operation started so far is done.
    """
    st = _STATE
    if st.pending is not None and not st.raised:
        st.raised = True
        raise Interrupted(st.pending)


@contextlib.contextmanager
def _section():
    """Signals are recorded, not raised, inside; leaving the outermost section raises one still pending."""
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1
    if _STATE.depth == 0:
        check()


@contextlib.contextmanager
def default_signals_clean_up():
    """Around a write (``save_dcp``, ``convert``): a write section (see the module docstring).

    Signals still at their default disposition (SIGINT: ``KeyboardInterrupt``; SIGTERM: terminate) are taken
    for the duration, so the write's own ``except`` removes its staging directory; a SIGTERM then terminates the
    process as the default disposition would have. A signal that comes after the last check point is raised (or
    terminates) once the write is complete. Handlers the program installed itself are left alone (they may
    raise anywhere; ``deferred`` still guards the critical steps against them).
    """
    if not in_main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    # a signal still at its default is taken by the outermost write only (an inner one finds on_signal there)
    taken = {s: h for s, h in defaults.items() if signal.getsignal(s) is h}
    if taken:
        _STATE.reset()  # the outermost write starts with nothing pending
    for s in taken:
        signal.signal(s, on_signal)
    try:
        with _section():
            yield
    except Interrupted as e:
        if e.signum in taken:
            _give_back(taken)
            taken = {}
            if e.signum == signal.SIGTERM:
                os.kill(os.getpid(), signal.SIGTERM)  # cleaned up: now terminate as SIGTERM would have
        raise
    finally:
        _give_back(taken)


def _give_back(taken: dict) -> None:
    """Restore the dispositions a write took (if any) and forget what its handler saw."""
    for s, h in taken.items():
        signal.signal(s, h)
    if taken:
        _STATE.reset()


@contextlib.contextmanager
def deferred():
    """Hold SIGINT/SIGTERM for a critical section (a TensorStore operation from start to result, an Orbax restore,
    marker removal + rename). A signal that came meanwhile is raised after it, or, inside a write, at the
    write's next check point."""
    if not in_main_thread():
        yield
        return
    # per signal: one a write took (on_signal) is recorded by the section; any other handler (the program's own,
    # SIGTERM's default) is swapped for a recorder and gets the signal after; an ignored one stays ignored. (A
    # write may take SIGINT while SIGTERM stays ignored, inherited from a supervisor: both kinds at once.)
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    swapped = {s: h for s, h in previous.items() if h is not on_signal and h is not signal.SIG_IGN}
    caught = []

    def record(signum, _frame):
        _HANDLED[0] += 1
        caught.append(signum)

    record.counts_handled = True
    for s in swapped:
        signal.signal(s, record)
    try:
        with _section():
            yield
    finally:
        for s, h in swapped.items():
            signal.signal(s, h)
        for signum in caught[:1]:
            signal.raise_signal(signum)


def stage(name: str) -> None:
    """A named moment of a write (``staging``, ``entry``, ``chunk``, ``tensorstore``, ``restore``, ``commit``,
    ``renamed``, ``cleanup``), where a test may signal it.

    Does nothing unless the environment variable ``JAXQUANT_TEST_STAGES`` is ``"<read fd>,<write fd>"`` (tests
    only): then the process writes ``stage <pid> <name>`` as a line to the write fd and waits for a line on the read
    fd, ``go`` or the number of a signal the test has sent it meanwhile; for a signal it returns once the signal's
    handler has run (a handler that raises raises here).
    """
    spec = os.environ.get(STAGES_ENV)
    if spec:
        _wait_at_stage(spec, name)


def _wait_at_stage(spec: str, name: str) -> None:
    rfd, wfd = (int(v) for v in spec.split(","))
    handled = _HANDLED[0]
    os.write(wfd, f"stage {os.getpid()} {name}\n".encode())
    reply = b""
    while not reply.endswith(b"\n"):
        byte = os.read(rfd, 1)
        if not byte:
            raise RuntimeError(f"{STAGES_ENV}: the test closed the pipe at stage {name!r}")
        reply += byte
    reply = reply.decode().strip()
    if reply == "go":
        return
    signum = int(reply)  # sent to this process: Python runs its handler in the main thread at the next check of
    deadline = time.monotonic() + 60  # the eval loop, which the sleeps below give it (whichever thread took it)
    # only this signal's own disposition counts: a write takes SIGINT while SIGTERM may stay ignored (inherited)
    counted = lambda: getattr(signal.getsignal(signum), "counts_handled", False)  # noqa: E731
    while counted() and _HANDLED[0] == handled and time.monotonic() < deadline:
        time.sleep(0.0005)
    if counted() and _HANDLED[0] == handled:
        raise RuntimeError(f"{STAGES_ENV}: {signal.Signals(signum).name} sent at stage {name!r} never reached "
                           f"the handler")
