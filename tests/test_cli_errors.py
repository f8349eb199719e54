"""Ctrl-C at any moment of a `jaxquant` command ends in one line, `jaxquant: interrupted by SIGINT` (the demo's own
names the checkpoint to resume from, or that there is none), and exit status 130 (issue 45 item 6), also while Python
is still importing (before the command's signal handlers are in place)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types


from jaxquant import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start_demo(tmp_path):
    """`python -m jaxquant demo` as a terminal would start it, with SIGINT at its default disposition (a test runner
    in the background may have it ignored, which children inherit; a handler is reset to the default at exec)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)   # the command sets its own (--devices)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([sys.executable, "-m", "jaxquant", "demo", "--steps", "1", "--mesh", "1x1",
                                 "--no-progress", "--ckpt-dir", str(tmp_path / "ckpt")], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)


# before the demo's own work starts (while the command is imported and its options parsed), and inside it
BEFORE, IN_DEMO = "jaxquant: interrupted by SIGINT", "jaxquant demo: interrupted by SIGINT; no checkpoint saved"


def _assert_one_interrupt_line(p, tmp_path, lines=(BEFORE, IN_DEMO)):
    out, err = p.communicate(timeout=120)
    # 130, or killed by SIGINT, which a shell reports as 130 too: under `python -m`, CPython ends that way once a
    # KeyboardInterrupt has passed through exec() (dataclasses' generated methods), even one that was caught
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, err)
    assert len(err.strip().splitlines()) == 1 and err.strip() in lines, err
    assert not (tmp_path / "ckpt").exists()


def test_ctrl_c_in_the_first_half_second_is_one_line(tmp_path):
    """``import jaxquant`` (run by ``python -m jaxquant`` before the command) loads nothing heavy, so the command's
    handlers are in place before jax is imported: a SIGINT 0.3 s after the start is the same one line."""
    p = _start_demo(tmp_path)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _assert_one_interrupt_line(p, tmp_path)


def test_ctrl_c_during_the_demo_setup_is_one_line(tmp_path):
    """Once the first line is out (jax and the extension are loaded, the backend started) the handlers run."""
    p = _start_demo(tmp_path)
    assert p.stdout.readline().startswith("custom calls built for")
    p.send_signal(signal.SIGINT)
    _assert_one_interrupt_line(p, tmp_path, [IN_DEMO])


def test_keyboard_interrupt_before_the_handlers_is_one_line(monkeypatch, capsys):
    """A SIGINT while cli.main imports its handlers is Python's own KeyboardInterrupt: the same line, 130."""
    class Interrupting(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "jaxquant.cli.signals", Interrupting("jaxquant.cli.signals"))
    assert cli.main(["demo", "--help"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["jaxquant: interrupted by SIGINT"]


def test_plain_keyboard_interrupt_inside_the_command_is_one_line(monkeypatch, capsys):
    """A KeyboardInterrupt that is not the handlers' Interrupted (raised by code that took SIGINT itself) too."""
    from jaxquant.cli import demo

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "main", interrupted)
    assert cli.main(["demo", "--steps", "1"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["jaxquant: interrupted by SIGINT"]
