"""`jaxquant --help` and its subcommands' help: plain text, every command listed, every option explained."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from jaxquant import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _run_help(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "jaxquant", *args, "--help"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _help_in_process(capsys, *args):
    """What ``jaxquant ARGS --help`` prints: the parser the subprocess above runs, its help on stdout, exit 0."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_top_level_help_lists_every_subcommand_in_plain_text(capsys):
    out = _run_help()
    assert "``" not in out, out
    commands = set(_subparsers(cli.build_parser()))
    assert commands == {"demo", "bench", "ckpt"}
    for name in commands:
        assert f"\n    {name} " in out, (name, out)  # the subcommand list
        assert f"{name} (" in out, (name, out)       # and the description names it
    # the subcommands' help in-process (one interpreter start is the command's: the same parser prints it)
    ckpt = _help_in_process(capsys, "ckpt")
    assert "``" not in ckpt and "\n    inspect " in ckpt and "\n    convert " in ckpt, ckpt
    for sub in (("bench",), ("ckpt", "convert"), ("ckpt", "inspect")):
        assert "``" not in _help_in_process(capsys, *sub), sub


def test_every_option_of_ckpt_convert_inspect_and_bench_has_help():
    parser = cli.build_parser()
    commands = _subparsers(parser)
    ckpt = _subparsers(commands["ckpt"])
    for name, p in (("ckpt convert", ckpt["convert"]), ("ckpt inspect", ckpt["inspect"]),
                    ("bench", commands["bench"])):
        for action in p._actions:
            label = "/".join(action.option_strings) or action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"jaxquant {name}: {label} has no help"
    assert commands["bench"].description and commands["ckpt"].description


def test_every_demo_option_has_help_naming_its_default():
    """`jaxquant demo --help` shows each default (--ckpt-dir's was missing) and the exit statuses."""
    demo = _subparsers(cli.build_parser())["demo"]
    for action in demo._actions:
        label = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"jaxquant demo: {label} has no help"
        if action.default not in (None, False, argparse.SUPPRESS) and action.dest != "func":
            assert "default" in action.help, f"jaxquant demo: {label}'s help does not name its default"
    helps = {a.dest: a.help for a in demo._actions}
    assert "default jaxquant-demo-ckpt" in helps["ckpt_dir"]
    assert "default llama" in helps["model"] and "tp-sp" in helps["model"]        # the default model, and the other
    assert "held-out" in helps["text"] and "default: steps/10" in helps["eval_every"] and ".png" in helps["plot"]
    assert "a fresh one-step run is not judged" in demo.description and "130" in demo.description
