"""The error convention of every `jaxquant` command (issue 56), as a new user meets it: the command run in a
subprocess (`python -m jaxquant`, what the installed script runs). A mistake is one line on stderr,
`jaxquant COMMAND: error: WHAT` (bad usage ends with `; see 'jaxquant COMMAND --help'`), exit status 2 for bad usage
and 1 for a failed operation, found before any work (nothing on stdout, nothing written); an output under a missing
directory is refused and the directory is not made; a demo run interrupted during a save names the last complete
checkpoint, which `jaxquant ckpt inspect --verify` accepts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from ckpt_helpers import common  # noqa: E402

from jaxquant.checkpoint.interrupt import STAGES_ENV  # noqa: E402


def jaxquant(*args, cwd):
    return subprocess.run([sys.executable, "-m", "jaxquant", *map(str, args)], env=common.env(), cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def _error_line(r, status: int) -> str:
    """The one line of a refused or failed command (nothing else on stderr, nothing on stdout)."""
    lines = r.stderr.splitlines()
    assert r.returncode == status and len(lines) == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    return lines[0]


def _usage(prog: str, what: str) -> str:
    return f"{prog}: error: {what}; see '{prog} --help'"


@pytest.fixture
def work(tmp_path):
    """tmp_path with a sound DCP checkpoint of the demo's records (``ckpt``), a copy whose data file is cut short
    (``bad``) and a regular file (``file``); returns (tmp_path, the entries it holds)."""
    from jaxquant import checkpoint as ck

    record = {"recipe": "bf16", "model": "llama", "data": "synthetic"}
    for name in ("ckpt", "bad"):
        ck.save_dcp(str(tmp_path / name), {"w": np.ones((4, 4), np.float32), "step": 1, "demo": record})
    os.truncate(tmp_path / "bad" / "__0_0.distcp", 64)
    (tmp_path / "file").write_text("mine")
    return tmp_path, sorted(os.listdir(tmp_path))


# (argv, the line's start, its end): argparse's own errors (whose wording after the option varies a little between
# Python versions) and the commands' checks of their options
USAGE_CASES = {
    "bad choice": (["demo", "--recipe", "int4"], "jaxquant demo: error: --recipe: invalid choice: 'int4'",
                   "; see 'jaxquant demo --help'"),
    "bad choice of ckpt convert": (["ckpt", "convert", "{tmp}/ckpt", "{tmp}/out", "--to", "safetensors"],
                                   "jaxquant ckpt convert: error: --to: invalid choice: 'safetensors'",
                                   "; see 'jaxquant ckpt convert --help'"),
    "unknown option": (["demo", "--stepz", "3"], _usage("jaxquant demo", "unrecognized arguments: --stepz 3"), ""),
    "no command": ([], _usage("jaxquant", "the following arguments are required: COMMAND"), ""),
    "ckpt inspect of nothing": (["ckpt", "inspect", "{tmp}/nowhere"],
                                _usage("jaxquant ckpt inspect", "{tmp}/nowhere: checkpoint directory does not exist"),
                                ""),
    "demo --resume of nothing": (["demo", "--resume", "{tmp}/nowhere", "--mesh", "1x1", "--recipe", "bf16"],
                                 _usage("jaxquant demo", "--resume: {tmp}/nowhere: checkpoint directory does not "
                                                         "exist"), ""),
    "convert onto a file": (["ckpt", "convert", "{tmp}/ckpt", "{tmp}/file", "--to", "dcp"],
                            _usage("jaxquant ckpt convert", "{tmp}/file: the destination is a file; refusing to "
                                                            "overwrite it (remove it or choose another path)"), ""),
    "plot under a missing directory": (["demo", "--plot", "{tmp}/missing/loss.png", "--ckpt-dir", "{tmp}/out"],
                                       _usage("jaxquant demo", "--plot: {tmp}/missing does not exist (the directory "
                                                               "of {tmp}/missing/loss.png); create it first or "
                                                               "choose another path"), ""),
    "ckpt-dir under a missing directory": (["demo", "--ckpt-dir", "{tmp}/missing/ckpt"],
                                           _usage("jaxquant demo", "--ckpt-dir: {tmp}/missing does not exist (the "
                                                                   "directory {tmp}/missing/ckpt would be made in); "
                                                                   "create it first or choose another path"), ""),
    "convert under a missing directory": (["ckpt", "convert", "{tmp}/ckpt", "{tmp}/missing/out", "--to", "dcp"],
                                          _usage("jaxquant ckpt convert", "dst: {tmp}/missing does not exist (the "
                                                                          "directory {tmp}/missing/out would be made "
                                                                          "in); create it first or choose another "
                                                                          "path"), ""),
    "json under a missing directory": (["bench", "--json", "{tmp}/missing/bench.json"],
                                       _usage("jaxquant bench", "--json: {tmp}/missing does not exist (the directory "
                                                                "of {tmp}/missing/bench.json); create it first or "
                                                                "choose another path"), ""),
}


@pytest.mark.all_cases
@pytest.mark.parametrize("case", list(USAGE_CASES))
def test_bad_usage_is_one_line_and_exit_2_before_any_work(work, case):
    """Every command, argparse's errors included: one line naming the command (not the top-level usage, not seven
    lines of usage), exit 2; nothing on stdout (the demo prints its first line once jax has started: it did not),
    nothing made (a missing directory an output would go in is not created)."""
    tmp, before = work
    argv, start, end = USAGE_CASES[case]
    fill = lambda s: s.format(tmp=tmp)  # noqa: E731
    line = _error_line(jaxquant(*map(fill, argv), cwd=tmp), 2)
    assert line.startswith(fill(start)) and line.endswith(end), line
    assert sorted(os.listdir(tmp)) == before


@pytest.mark.all_cases
@pytest.mark.parametrize("argv", [["ckpt", "convert", "{tmp}/bad", "{tmp}/out", "--to", "dcp"],
                                  ["demo", "--resume", "{tmp}/bad", "--mesh", "1x1", "--recipe", "bf16", "--ckpt-dir",
                                   "{tmp}/out"]], ids=["ckpt convert", "demo --resume"])
def test_a_damaged_checkpoint_is_a_failed_operation_in_every_command(work, argv):
    """The same mistake, the same status: a checkpoint that cannot be read is exit 1 (`ckpt inspect` says it is not
    sound, exit 1), with one line naming it; no "see --help" (the command line was sound)."""
    tmp, before = work
    line = _error_line(jaxquant(*(a.format(tmp=tmp) for a in argv), cwd=tmp), 1)
    prog = "jaxquant " + " ".join(argv[:2] if argv[0] == "ckpt" else argv[:1])
    assert line.startswith(f"{prog}: error: ") and str(tmp / "bad") in line and "truncated" in line, line
    assert "--help" not in line, line
    r = jaxquant("ckpt", "inspect", tmp / "bad", cwd=tmp)
    assert r.returncode == 1 and "NOT SOUND" in r.stdout, (r.stdout, r.stderr)
    assert sorted(os.listdir(tmp)) == before


def test_help_states_the_error_convention(capsys):
    """`jaxquant --help` and each command's help say what the exit statuses mean (in-process: argparse prints the
    help of the parser the subprocess cases above run)."""
    from jaxquant import cli
    from jaxquant.cli import errors

    said = " ".join(errors.EXIT_STATUS.split())
    for argv in ([], ["demo"], ["bench"], ["ckpt"], ["ckpt", "inspect"], ["ckpt", "convert"]):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args([*argv, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and said in " ".join(out.split()), (argv, out)


def test_sigint_during_a_save_names_the_last_complete_checkpoint(tmp_path):
    """`demo --text DIR --save-every 1`, interrupted by SIGINT while it writes its second checkpoint (stopped there
    through the write's named stages, jaxquant.checkpoint.interrupt.stage): the write is abandoned and the one line
    names the first checkpoint, the last complete one, with the command to continue it; `jaxquant ckpt inspect
    --verify` accepts it. The text directory's binary, empty and hidden entries are named on stdout, and stderr,
    not a terminal, holds that line alone (no progress bar redrawn as blank lines)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(120)))
    (corpus / "blob.bin").write_bytes(bytes(range(256)))
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / ".hidden").write_text("x")
    to_child, from_test = os.pipe()     # the test's answers at each stage
    from_child, to_test = os.pipe()     # the child's "stage <pid> <name>" lines
    env = common.env(**{STAGES_ENV: f"{to_child},{to_test}"})
    before = signal.signal(signal.SIGINT, signal.default_int_handler)   # (a runner may have it ignored: inherited)
    try:
        p = subprocess.Popen([sys.executable, "-m", "jaxquant", "demo", "--text", "corpus", "--steps", "4",
                              "--save-every", "1", "--mesh", "1x1", "--recipe", "bf16", "--ckpt-dir", "ckpt"],
                             cwd=tmp_path, env=env, pass_fds=(to_child, to_test), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    os.close(to_child), os.close(to_test)
    stages, sent = [], False
    with os.fdopen(from_child, "r") as lines, os.fdopen(from_test, "w") as answers:
        for line in lines:       # until the child exits (the pipe's last write end closes with it)
            _, pid, name = line.split()
            stages.append(name)
            if not sent and stages.count("staging") == 2:     # the second save has made its staging directory
                os.kill(int(pid), signal.SIGINT)
                answers.write(f"{int(signal.SIGINT)}\n")     # (the child goes on once its handler has run)
                sent = True
            else:
                answers.write("go\n")
            answers.flush()
        out, err = p.communicate(timeout=180)
    assert sent, stages
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, err)   # (-SIGINT: see test_cli_errors.py)
    first = os.path.join("ckpt", "bf16-step1")
    assert err.splitlines() == [f"jaxquant demo: interrupted by SIGINT; the last complete checkpoint is {first}; "
                                f"continue with jaxquant demo --resume {first} --recipe bf16 --text corpus "
                                f"--steps N"], err
    assert os.listdir(tmp_path / "ckpt") == ["bf16-step1"]             # the cut save left nothing
    assert re.search(r"^data: corpus: skipped 3 entries: \.hidden \(hidden\), blob\.bin \(binary: holds a NUL "
                     r"byte\), empty\.txt \(empty\)$", out, re.M), out
    r = jaxquant("ckpt", "inspect", "--verify", first, cwd=tmp_path)
    assert r.returncode == 0 and "every CRC-32 matched" in r.stdout, (r.stdout, r.stderr)
