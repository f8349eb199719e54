"""``jaxquant ckpt inspect|convert``: the checkpoint subcommands (added to the top-level CLI, jaxquant/cli/__init__.py);
the work is jaxquant/checkpoint's."""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxquant.cli import errors
from jaxquant.cli.signals import Interrupted, report


def _error(command: str, e: Exception) -> int:
    """The one line of ``e``: exit 2 where the command line names no checkpoint to read (missing, a file, a staging
    directory), a destination it may not write or an extra that is not installed; 1 where the operation failed."""
    from jaxquant.checkpoint import errors as ce
    from jaxquant.checkpoint.fsutil import os_error_cause

    prog = f"jaxquant ckpt {command}"
    if isinstance(e, OSError):
        return errors.fail(prog, f"{e.filename}: {os_error_cause(e)}" if e.filename else os_error_cause(e))
    if isinstance(e, (errors.UsageError, ce.CheckpointNotFoundError, ce.IncompleteCheckpointError,
                      ce.DestinationExistsError, ce.MissingDependencyError)):
        return errors.refuse(prog, str(e))
    return errors.fail(prog, str(e))


def _inspect(args) -> int:
    from jaxquant.checkpoint.errors import CheckpointError
    from jaxquant.checkpoint.inspect import format_report, inspect_checkpoint

    try:
        rep = inspect_checkpoint(args.path, verify=args.verify)
    except (CheckpointError, OSError) as e:
        return _error("inspect", e)
    except Interrupted as e:
        return report(f"jaxquant ckpt inspect: interrupted by {e.signame}", e)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0 if rep["ok"] else errors.FAILED


def _check_convert_args(src: str, dst: str) -> None:
    """Before anything is read or made: a source directory, a destination that is not it and overwrites nothing, in
    a directory that exists and can be written (only ``dst`` itself is made)."""
    from jaxquant.checkpoint import fsutil

    fsutil.check_source_dir(src, "source")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise errors.UsageError(f"dst: {dst} is the source; choose another path")
    fsutil.check_destination(dst)
    errors.check_output_dir(dst, "dst")


def _convert(args) -> int:
    from jaxquant.checkpoint.convert import convert
    from jaxquant.checkpoint.errors import CheckpointError
    from jaxquant.checkpoint.fsutil import INCOMPLETE_MARKER

    # the bar only on a terminal: in a log or a pipe each redraw, and its removal on an error, is a line of its own
    try:
        _check_convert_args(args.src, args.dst)
        convert(args.src, args.dst, to=args.to, dequantize=args.dequantize, transpose=args.transpose_linear,
                progress=not args.no_progress and sys.stderr.isatty(), verify=not args.no_verify)
    except (CheckpointError, OSError, errors.UsageError) as e:
        return _error("convert", e)
    except Interrupted as e:
        done = os.path.isdir(args.dst) and os.listdir(args.dst) and \
            not os.path.exists(os.path.join(args.dst, INCOMPLETE_MARKER))
        state = f"{args.dst} was complete already" if done else f"nothing was written to {args.dst}"
        return report(f"jaxquant ckpt convert: interrupted by {e.signame}; {state}; {args.src} is untouched", e)
    print(f"wrote {args.dst}", file=sys.stderr)
    return 0


def add_ckpt_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``ckpt`` (with ``inspect`` and ``convert``) to an argparse subparsers object."""
    ckpt = subparsers.add_parser("ckpt", help="PyTorch DCP / Orbax checkpoints: inspect and convert",
                                 description="PyTorch DCP / Orbax checkpoints: inspect and convert "
                                             "(docs/checkpoint.md). Exit status 0 on success; 1 for an unsound or "
                                             "damaged checkpoint or a failed write; 2 for bad usage (a checkpoint "
                                             "path that does not exist, a destination that exists or whose "
                                             "directory does not; a missing extra); 130/143 when interrupted.",
                                 epilog=errors.EXIT_STATUS)
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="COMMAND")

    text = ("keys, dtypes, shapes, chunks and soundness of a DCP checkpoint; keys, dtypes and shapes of an Orbax "
            "checkpoint")
    p = sub.add_parser("inspect", help=text, description=text + " (exit 0 only when it is sound)",
                       epilog=errors.EXIT_STATUS)
    p.add_argument("path", help="the checkpoint directory (DCP or Orbax, detected)")
    p.add_argument("--verify", action="store_true", help="also read all data: DCP: check every record's CRC-32; Orbax: "
                   "restore every key")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_inspect, parser=p)

    text = "convert a DCP or Orbax checkpoint (streaming, atomic)"
    p = sub.add_parser("convert", help=text, description=text + "; the source is only read, the destination "
                       "appears complete or not at all", epilog=errors.EXIT_STATUS)
    p.add_argument("src", help="the checkpoint to read: a DCP or Orbax directory (detected)")
    p.add_argument("dst", help="the directory to write; must not exist or be empty, in a directory that exists")
    p.add_argument("--to", required=True, choices=("dcp", "orbax"),
                   help="the format to write (orbax needs the orbax extra: pip install \"jaxquant[orbax]\")")
    p.add_argument("--dequantize", nargs="?", const="bfloat16", choices=("bfloat16", "float32"),
                   help="store quantized tensors dequantized in this dtype (bfloat16 when given without a value; "
                        "default: keep them quantized)")
    p.add_argument("--transpose-linear", action="append", default=[], metavar="PATTERN",
                   help="fnmatch pattern of 2-D keys to transpose between [out, in] and [in, out] (repeatable)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn on stderr only when stderr is a terminal)")
    p.add_argument("--no-verify", action="store_true", help="skip CRC-32 checks of a DCP source")
    p.set_defaults(func=_convert, parser=p)
    return ckpt
