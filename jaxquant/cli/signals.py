"""SIGINT / SIGTERM around a ``jaxquant`` command: what the command installs for its run and the line it ends with.

The checkpoint writer's own rules (a signal inside a write is taken at the write's check points, so its staging
directory is removed) are in jaxquant/checkpoint/interrupt.py; this module installs its handler
(``interrupt.on_signal``) for the whole command, so that a signal outside a write raises at once too, and prints the
one line an interrupted command ends with, with exit status 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import warnings

from jaxquant.checkpoint import interrupt
from jaxquant.checkpoint.interrupt import SIGNALS, Interrupted

__all__ = ["Interrupted", "cli_handlers", "report"]


def _keep_lost_interrupt(previous_hook):
    """An ``unraisablehook``: an :class:`Interrupted` that Python could not raise (the handler ran inside a GC
    callback or ``__del__``) stays pending for the next check point or signal, unprinted."""

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, Interrupted):  # (it is still recorded as pending)
            previous_hook(unraisable)

    return hook


@contextlib.contextmanager
def cli_handlers():
    """For a command: SIGINT/SIGTERM raise :class:`Interrupted` until the block ends (at check points inside
    write sections).

    Signals that were blocked while the process started (a supervisor may start us with them blocked so that
    none is lost before the handlers exist) are unblocked once the handlers are in place, so one may be raised
    on entering the block: catch :class:`Interrupted` around the ``with``.
    """
    if not interrupt.in_main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    previous_hook = sys.unraisablehook
    interrupt.reset()
    sys.unraisablehook = ours = _keep_lost_interrupt(previous_hook)
    for s in SIGNALS:
        signal.signal(s, interrupt.on_signal)
    try:
        if hasattr(signal, "pthread_sigmask"):  # POSIX
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if sys.unraisablehook is ours:  # (report() may have replaced it: the process is exiting)
            sys.unraisablehook = previous_hook
        # a signal recorded but never raised in the block (dropped in a GC callback) ends with it: left pending, a
        # later write of this process that finds SIGINT not at its default (e.g. ignored) would raise it
        interrupt.reset()


def report(message: str, e: Interrupted) -> int:
    """Print the one line an interrupted command ends with; its exit status.

    What the interrupted code left half-built (an asyncio loop inside Orbax, unawaited coroutines) is freed
    here with its ``__del__`` complaints silenced: the process is about to exit and the line above says why.
    """
    if interrupt.in_main_thread():
        for s in SIGNALS:  # exiting: a second signal must not turn the line below into a traceback
            signal.signal(s, signal.SIG_IGN)
    print(message, file=sys.stderr, flush=True)
    e.__traceback__ = e.__context__ = None  # lets the interrupted frames go now
    sys.unraisablehook = lambda _unraisable: None
    warnings.simplefilter("ignore")
    gc.collect()
    return e.exit_code
