"""The signal rules of jaxquant.checkpoint.interrupt, made deterministic with signal.raise_signal (the random-kill
tests in test_checkpoint_interrupt.py find the same failures only now and then).

- Inside a write section a signal never raises where it lands: it is raised by ``check()`` or when the section
  ends, also when it lands inside a garbage-collection callback (where a raised exception is printed and lost:
  CI saw a SIGTERM swallowed that way and the conversion finish with exit status 0).
- Outside write sections (a command's own code) a signal raises at once, and one lost in a GC callback does
  not disarm the next.

Every test starts from the default dispositions (fixture ``default_dispositions``), so the outcome does not depend
on how the test runner was started.
"""

import gc
import os
import signal

import numpy as np
import pytest

from jaxquant.checkpoint import interrupt
from jaxquant.checkpoint.interrupt import Interrupted
from jaxquant.cli.signals import cli_handlers


@pytest.fixture(autouse=True)
def default_dispositions():
    """Each test starts from the dispositions a program gets in a terminal (SIGINT: KeyboardInterrupt, SIGTERM:
    terminate), whatever the test runner was started with: a background job of a non-interactive shell starts with
    SIGINT ignored, and Python then leaves it ignored. Restored afterwards."""
    before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, h in before.items():
        signal.signal(s, h)


@pytest.fixture
def in_gc_callback():
    """Runs ``fn`` from inside a gc callback (as JAX's own ``_xla_gc_callback`` runs) during one collection."""
    todo = []

    def callback(phase, _info):
        if phase == "start" and todo:
            todo.pop()()

    gc.callbacks.append(callback)

    def run(fn):
        todo.append(fn)
        gc.collect()

    yield run
    gc.callbacks.remove(callback)


def test_signal_in_a_gc_callback_inside_a_write_is_raised_at_the_next_check(in_gc_callback, capsys):
    with cli_handlers():
        with pytest.raises(Interrupted) as e:
            with interrupt.default_signals_clean_up():
                in_gc_callback(lambda: signal.raise_signal(signal.SIGINT))
                reached = "after the collection"  # nothing was raised inside the callback
                interrupt.check()
                reached = "after check"
        assert e.value.signum == signal.SIGINT and e.value.exit_code == 130
    assert reached == "after the collection"
    assert "Exception ignored" not in capsys.readouterr().err


def test_signal_after_the_last_check_is_raised_when_the_write_ends():
    done = []
    with cli_handlers():
        with pytest.raises(Interrupted):
            with interrupt.default_signals_clean_up():
                signal.raise_signal(signal.SIGTERM)
                done.append("write finished")
    assert done == ["write finished"]


def test_deferred_block_holds_a_signal_until_it_ends():
    order = []
    with cli_handlers():
        with pytest.raises(Interrupted):
            with interrupt.deferred():
                signal.raise_signal(signal.SIGINT)
                order.append("operation waited for")
            order.append("not reached")
    assert order == ["operation waited for"]


def test_signals_during_cleanup_are_ignored():
    cleaned = []
    with cli_handlers():
        with pytest.raises(Interrupted):
            with interrupt.default_signals_clean_up():
                signal.raise_signal(signal.SIGINT)
                try:
                    interrupt.check()
                finally:
                    signal.raise_signal(signal.SIGTERM)  # a second signal while the staging directory goes
                    interrupt.check()  # raises nothing more
                    cleaned.append(True)
    assert cleaned == [True]


def test_outside_writes_a_signal_raises_at_once():
    with cli_handlers():
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGINT)
            pytest.fail("the handler did not raise")


def test_a_signal_python_drops_in_a_gc_callback_stays_pending_unprinted(in_gc_callback, capsys):
    with cli_handlers():
        in_gc_callback(lambda: signal.raise_signal(signal.SIGTERM))  # raised inside the callback: Python drops it
        with pytest.raises(Interrupted) as e:
            interrupt.check()  # the next check point (here: the first of a write) raises it
        assert e.value.signum == signal.SIGTERM
    assert "Exception ignored" not in capsys.readouterr().err
    with cli_handlers():  # and a dropped one does not disarm the next signal
        in_gc_callback(lambda: signal.raise_signal(signal.SIGINT))
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGINT)
            pytest.fail("the handler did not raise")


def test_library_write_restores_default_keyboard_interrupt():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with interrupt.default_signals_clean_up():
            signal.raise_signal(signal.SIGINT)
            interrupt.check()
    assert signal.getsignal(signal.SIGINT) is before
    with interrupt.default_signals_clean_up():  # a fresh write starts with nothing pending
        interrupt.check()


def test_an_interrupt_caught_outside_a_write_does_not_silence_the_next():
    with cli_handlers():
        try:
            signal.raise_signal(signal.SIGINT)
        except Interrupted:
            pass  # e.g. code that catches KeyboardInterrupt and goes on
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGTERM)
            pytest.fail("the second signal was ignored")


def test_a_signal_left_pending_by_a_command_does_not_reach_a_later_write(in_gc_callback, tmp_path):
    """A signal recorded inside cli_handlers but never raised (dropped in a GC callback) ends with the block: a later
    save_dcp in the same process, with SIGINT and SIGTERM ignored (so the write takes neither over), completes."""
    from jaxquant import checkpoint as ck

    with cli_handlers():
        in_gc_callback(lambda: signal.raise_signal(signal.SIGINT))
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        path = ck.save_dcp(str(tmp_path / "ckpt"), {"w": np.zeros((4, 4), np.float32)})
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert os.path.isfile(os.path.join(path, ".metadata"))


@pytest.mark.parametrize("at", ["chunk", "commit"])
def test_sigint_cancels_the_write_while_sigterm_stays_ignored(monkeypatch, tmp_path, at):
    """A supervisor may start us with SIGTERM ignored (inherited), so a write takes SIGINT alone. A SIGINT up to the
    last check point before the rename still cancels the write: KeyboardInterrupt, no checkpoint, no staging left
    (the critical section around the rename once swapped both signals for a recorder and delivered SIGINT after
    the rename: a complete checkpoint reported as interrupted)."""
    from jaxquant import checkpoint as ck

    seen = []

    def stage(name):
        seen.append(name)
        if name == at:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(interrupt, "stage", stage)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with pytest.raises(KeyboardInterrupt):
        ck.save_dcp(str(tmp_path / "ckpt"), {"w": np.ones((4, 4), np.float32)})
    assert "renamed" not in seen and "cleanup" in seen, seen
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_checkpoint_package_imports_nothing_of_the_cli_or_training():
    """The command's signal handling lives in jaxquant/cli/signals.py: jaxquant.checkpoint stands beside the training
    layers and below the CLI, so none of its modules imports either (function-level imports included)."""
    import ast
    import pathlib

    package = pathlib.Path(interrupt.__file__).parent
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith(("jaxquant.cli", "jaxquant.training"))]
    assert found == []
