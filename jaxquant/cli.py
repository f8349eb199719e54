"""The ``jaxquant`` command: ``demo`` (train a small transformer with quantized weights, jaxquant/demo.py)
and ``ckpt`` (checkpoint tools)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _force_host_devices(n: int) -> None:
    # XLA reads this when the first backend starts, so it must be set before any device use.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def build_parser() -> argparse.ArgumentParser:
    from jaxquant.demo import add_demo_parser

    parser = argparse.ArgumentParser(prog="jaxquant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_parser(sub)
    try:
        from jaxquant.checkpoint.cli import add_ckpt_parser
    except ModuleNotFoundError as e:  # only while the checkpoint package is absent
        if not (e.name or "").startswith("jaxquant.checkpoint"):
            raise
    else:
        add_ckpt_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "devices", None):
        _force_host_devices(args.devices)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
