"""The ``jaxquant`` command: ``demo`` (train a small transformer with quantized weights, jaxquant/cli/demo.py),
``bench`` (time the quantizers, jaxquant/cli/bench.py) and ``ckpt`` (checkpoint tools, jaxquant/cli/ckpt.py).
``DESCRIPTION`` is what ``jaxquant --help`` prints."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from jaxquant.cli import errors


def _force_host_devices(n: int) -> None:
    # XLA reads this when the first backend starts, so it must be set before any device use.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


DESCRIPTION = ("FP8 and NVFP4 weights for sharded JAX training. Commands: demo (train a small transformer), "
               "bench (time the quantizers), ckpt (inspect and convert PyTorch DCP / Orbax checkpoints); "
               "'jaxquant COMMAND --help' lists a command's options.")


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxquant`` parser. Its subcommand parsers are ``errors.Parser`` too (argparse's errors as one line) and
    each command's own parser is its ``parser`` default (``main`` reports an unknown option as that command's)."""
    from jaxquant.cli.demo import add_demo_parser

    parser = errors.Parser(prog="jaxquant", description=DESCRIPTION, epilog=errors.EXIT_STATUS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(sub)
    from jaxquant.cli.bench import configure_parser as configure_bench  # sets func=bench.run

    bench = sub.add_parser("bench", help="time the quantizers against the memory floor and XLA",
                           epilog=errors.EXIT_STATUS)
    configure_bench(bench)
    bench.set_defaults(parser=bench)
    from jaxquant.cli.ckpt import add_ckpt_parser

    add_ckpt_parser(sub)
    return parser


def _hold_signals(hold: bool) -> None:
    if hasattr(signal, "pthread_sigmask"):  # POSIX
        signal.pthread_sigmask(signal.SIG_BLOCK if hold else signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def main(argv: list[str] | None = None) -> int:
    # SIGINT/SIGTERM become one exception (checkpoint writes clean up on it) and end in one line with exit status
    # 128 + signal number, not a traceback. The commands' imports and work run inside cli_handlers; a SIGINT before
    # they are in place (while this imports them) is Python's own KeyboardInterrupt: the same line. (One while Python
    # imports the jaxquant package itself, before this module runs, cannot be caught here.)
    # SIGINT/SIGTERM are held (blocked) until the handlers are in place: one that lands inside a C extension's
    # import (jaxlib) can crash the process; cli_handlers unblocks them and a held one is raised there
    _hold_signals(True)
    try:
        from jaxquant.cli.signals import Interrupted, cli_handlers, report
    except KeyboardInterrupt:
        _hold_signals(False)
        print("jaxquant: interrupted by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
    except BaseException:
        _hold_signals(False)
        raise

    try:
        with cli_handlers():
            parser = build_parser()
            # (parse_args would report an option unknown to the command as the top-level parser's, with its usage)
            args, unknown = parser.parse_known_args(argv)
            command = getattr(args, "parser", parser)
            if unknown:
                command.error(f"unrecognized arguments: {' '.join(unknown)}")
            devices = getattr(args, "devices", None)
            if devices is not None and devices < 1:
                return errors.refuse(command.prog, f"--devices: must be at least 1, got {devices}")
            if devices:
                _force_host_devices(devices)
            return int(args.func(args) or 0)
    except KeyboardInterrupt as e:   # Interrupted; or Python's own, from a SIGINT before or after the handlers
        e = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        return report(f"jaxquant: interrupted by {e.signame}", e)


if __name__ == "__main__":
    sys.exit(main())
