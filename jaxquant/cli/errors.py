"""The one error convention of every ``jaxquant`` command, and the checks of output paths that it rests on.

An error is one line on stderr, ``jaxquant COMMAND: error: WHAT``, naming the option or path and the rule it broke;
a usage error ends with where the options are explained (``; see 'jaxquant COMMAND --help'``). Exit status 2 is bad
usage: what the command line asks for cannot be done as written (fix the command); 1 is a failed operation: the
command line was sound but the work failed (fix the data or the machine). ``EXIT_STATUS`` says so in ``--help``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

USAGE = 2    # bad usage: refused before any work, nothing written
FAILED = 1   # the operation failed (or, ckpt inspect, found the checkpoint unsound)

EXIT_STATUS = ("Errors are one line on stderr, 'jaxquant COMMAND: error: WHAT', naming the option or path and the "
               "rule. Exit status 2: bad usage (an unknown option or a bad value; an input that does not exist or "
               "is not what the option takes; an output whose directory does not exist or cannot be written, or "
               "that would overwrite something; an option whose package is not installed), found before any work, "
               "nothing written. Exit status 1: the operation failed (a damaged checkpoint, a write that failed, a "
               "loss that became NaN or did not fall). 130 / 143: interrupted by SIGINT / SIGTERM.")


class UsageError(ValueError):
    """Bad usage (exit 2); the message starts with the option or path and says the rule."""


class OperationError(Exception):
    """The command line was sound but the operation failed (exit 1): e.g. a damaged checkpoint."""


def _plain(message: str) -> str:
    # argparse says "argument --recipe: ..."; the rest of the command's errors start with the option itself
    return re.sub(r"^argument ([^:]+): ", r"\1: ", message)


def refuse(prog: str, message: str) -> int:
    """Print the one line of a usage error of command ``prog`` (e.g. ``jaxquant demo``); returns 2."""
    print(f"{prog}: error: {_plain(message)}; see '{prog} --help'", file=sys.stderr, flush=True)
    return USAGE


def fail(prog: str, message: str) -> int:
    """Print the one line of a failed operation of command ``prog``; returns 1."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return FAILED


class Parser(argparse.ArgumentParser):
    """argparse's errors as one line (not the usage block), exit status 2. Subcommand parsers made by
    ``add_subparsers`` are of this class too."""

    def error(self, message):
        refuse(self.prog, message)
        self.exit(USAGE)


def _cause(e: OSError) -> str:
    from jaxquant.checkpoint.fsutil import os_error_cause

    return os_error_cause(e)


def check_writable(directory: str, option: str, on_the_way: str = "") -> None:
    """``directory`` must exist, be a directory and take new entries (tried by making and removing a temporary
    directory in it: mode bits do not tell, e.g. for root or on a read-only mount)."""
    if not os.path.lexists(directory):
        raise UsageError(f"{option}: {directory} does not exist{on_the_way}; create it first or choose another path")
    if not os.path.isdir(directory):
        raise UsageError(f"{option}: {directory} is not a directory{on_the_way}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxquant-probe-", dir=directory))
    except OSError as e:
        raise UsageError(f"{option}: cannot write in {directory}: {_cause(e)}") from None


def check_output_file(path: str, option: str) -> None:
    """Before any work: the file ``path`` can be written: it is not a directory, and the directory it goes in exists
    and can be written. Nothing is created (the directory is never made: a typo in it is an error, not a new tree)."""
    if os.path.isdir(path):
        raise UsageError(f"{option}: {path} is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    check_writable(parent, option, f" (the directory of {path})")


def check_output_dir(path: str, option: str) -> None:
    """Before any work: the directory ``path`` can be written in: it exists as a directory that takes new entries,
    or it is missing and the directory it goes in exists and can be written (the command then makes ``path`` alone,
    never its parents)."""
    if os.path.lexists(path):
        check_writable(path, option)
        return
    parent = os.path.dirname(os.path.abspath(path))
    check_writable(parent, option, f" (the directory {path} would be made in)")
