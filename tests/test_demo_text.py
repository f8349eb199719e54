"""`jaxquant demo --text PATH --plot PNG` (issue 46): the demo trains on the bytes of text files, reports the held-out
loss every --eval-every steps, records the data in its checkpoint (a resumed run must read the same kind), and
draws the losses as a PNG; each bad --text / --plot / --eval-every is one line on stderr before any training."""

from __future__ import annotations

import os
import re
import sys

import jax
import pytest

from jaxquant import cli

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def corpus(tmp_path):
    """A small text file: some Python, repeated (enough for a held-out part of a few windows)."""
    f = tmp_path / "tiny.py"
    f.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(120)))
    return f


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _heldout(out) -> dict:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+): held-out loss ([\d.]+)$", out, re.M)}


def test_demo_text_reports_heldout_loss_and_plots_it(tmp_path, capsys, corpus):
    pytest.importorskip("matplotlib", reason='--plot needs matplotlib: pip install "jaxquant[train]"')
    plot = tmp_path / "loss.png"
    rc = cli.main(["demo", "--text", str(corpus), "--steps", "6", "--eval-every", "3", "--mesh", "2x1", "--plot",
                   str(plot), "--recipe", "bf16", "--ckpt-dir", str(tmp_path / "ckpt"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "vocab 256" in out and f"data: {corpus}: 1 file" in out and "held-out loss every 3 steps" in out, out
    held = _heldout(out)
    assert sorted(held) == [0, 3, 6], out                         # before the first step, every 3, after the last
    assert held[6] < held[0], out                                 # it learns the bytes
    assert f"held-out loss {held[0]:.3f} at step 0 -> {held[6]:.3f} at step 6" in out
    assert f"plot: {plot}" in out
    raw = plot.read_bytes()
    assert raw.startswith(PNG_SIGNATURE) and len(raw) > 5000
    from matplotlib.image import imread

    image = imread(str(plot))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05                            # curves, not a blank canvas
    from jaxquant import checkpoint as ck

    record = ck.load_dcp(str(tmp_path / "ckpt" / "bf16-step6"), {"demo": {"data": str, "model": str}})["demo"]
    assert record == {"data": "text", "model": "llama"}
    assert f"--recipe bf16 --text {corpus} --steps N" in out       # the resume command names the data


def test_demo_text_resumes_on_the_same_data_and_refuses_other_data(tmp_path, capsys, corpus):
    """A text run resumes with --text (the batches of the steps it had not taken, the held-out loss goes on from
    where it was); without --text it is refused, as a synthetic run resumed with --text is."""
    common = ["--recipe", "bf16", "--mesh", "1x1", "--no-progress"]
    assert cli.main(["demo", "--text", str(corpus), "--steps", "4", "--eval-every", "2", "--ckpt-dir",
                     str(tmp_path / "a"), *common]) == 0
    first = _heldout(capsys.readouterr().out)
    ckpt = tmp_path / "a" / "bf16-step4"
    assert cli.main(["demo", "--text", str(corpus), "--steps", "2", "--eval-every", "2", "--resume", str(ckpt),
                     "--ckpt-dir", str(tmp_path / "b"), *common]) == 0
    out = capsys.readouterr().out
    again = _heldout(out)
    assert f"resumed from {ckpt} at step 4" in out and sorted(again) == [4, 6], out
    assert f"{again[4]:.3f}" == f"{first[4]:.3f}"                 # the same parameters on the same held-out bytes
    rc = cli.main(["demo", "--steps", "1", "--resume", str(ckpt), "--ckpt-dir", str(tmp_path / "c"), *common])
    line = _one_error_line(capsys)
    assert rc == 2 and f"--resume: {ckpt} was trained on --text data (byte tokens)" in line, line
    assert "pass --text PATH" in line, line
    assert cli.main(["demo", "--steps", "1", "--ckpt-dir", str(tmp_path / "s"), *common]) == 0
    capsys.readouterr()
    rc = cli.main(["demo", "--text", str(corpus), "--steps", "1", "--resume", str(tmp_path / "s" / "bf16-step1"),
                   "--ckpt-dir", str(tmp_path / "c"), *common])
    line = _one_error_line(capsys)
    assert rc == 2 and "was trained on the synthetic data (no --text)" in line and "drop --text" in line, line
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
@pytest.mark.extended   # the TP-SP demo: test_demo.py::test_demo_on_tp_only_mesh_has_no_weight_gathers (time budget)
def test_demo_text_trains_the_tp_sp_model_too(tmp_path, capsys, corpus):
    rc = cli.main(["demo", "--model", "tp-sp", "--text", str(corpus), "--steps", "4", "--mesh", "2x2", "--recipe",
                   "fp8", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mesh fsdp=2 x tp=2" in out and "vocab 256" in out, out
    held = _heldout(out)
    assert sorted(held) == [0, 1, 2, 3, 4] and held[4] < held[0], out     # default: every steps/10, at least 1


@pytest.mark.parametrize("argv,message", [
    (["--text", "{tmp}/nowhere"], "--text: {tmp}/nowhere does not exist"),
    (["--text", "{tmp}/empty.txt"], "--text: {tmp}/empty.txt is empty"),
    (["--text", "{tmp}/emptydir"], "--text: {tmp}/emptydir holds no non-empty text files"),
    (["--text", "{corpus}", "--eval-every", "0"], "--eval-every: must be at least 1, got 0"),
    (["--eval-every", "2"], "--eval-every: needs --text"),
    (["--plot", "{tmp}/loss.jpg"], "--plot: must name a .png file"),
    (["--plot", "{tmp}/f/loss.png"], "--plot: {tmp}/f is not a directory"),
    (["--plot", "{tmp}/nowhere/loss.png"], "--plot: {tmp}/nowhere does not exist"),   # never made
], ids=["missing", "empty file", "empty directory", "eval-every 0", "eval-every without text", "not png",
        "below a file", "missing directory"])
def test_demo_refuses_bad_text_and_plot_options_before_training(tmp_path, capsys, corpus, argv, message):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "f").write_text("a file")
    fill = lambda s: s.format(tmp=tmp_path, corpus=corpus)
    rc = cli.main(["demo", *map(fill, argv), "--steps", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and line.startswith(f"jaxquant demo: error: {fill(message)}"), line
    assert not (tmp_path / "ckpt").exists()


def test_demo_plot_without_matplotlib_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` now raises ImportError
    rc = cli.main(["demo", "--plot", str(tmp_path / "loss.png"), "--steps", "1", "--ckpt-dir",
                   str(tmp_path / "ckpt"), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and line.startswith("jaxquant demo: error: --plot: needs matplotlib, which is not installed"), line
    assert sorted(os.listdir(tmp_path)) == []
