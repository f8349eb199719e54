"""`jaxquant demo` (the CLI entry point, in-process on the 8 simulated devices): the transformer trains
(the loss falls) on an fsdp-only mesh and on the default (fsdp=4, tp=2) mesh, a DCP checkpoint is written
and `jaxquant ckpt inspect` reads it; a TP split the model cannot take is refused with a clear message."""

import os
import sys

import jax
import pytest

from jaxquant import cli

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def test_demo_trains_and_checkpoints(tmp_path, capsys):
    rc = cli.main(["demo", "--steps", "30", "--mesh", "8x1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "weights nvfp4" in out and "mesh fsdp=8 x tp=1" in out
    assert "0.25x" in out                                  # NVFP4 gathers a quarter of the bf16 bytes
    first, last = _loss_range(out)
    assert last < first - 0.5, out
    ckpt = tmp_path / "nvfp4-step30"
    assert (ckpt / ".metadata").is_file()
    assert f"jaxquant ckpt inspect {ckpt}" in out
    assert cli.main(["ckpt", "inspect", str(ckpt)]) == 0
    listing = capsys.readouterr().out
    assert "model.l1.down" in listing and "model_nvfp4.l1.down" in listing


def _loss_range(out):
    return tuple(float(v) for v in out.split("loss ")[-1].split(" over")[0].split(" -> "))


def test_demo_default_mesh_is_fsdp_x_tp_and_trains(tmp_path, capsys):
    """Heads and MLP hidden units split over tp=2 (Megatron column/row-parallel), NVFP4 weights."""
    rc = cli.main(["demo", "--steps", "30", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mesh fsdp=4 x tp=2" in out and "weights nvfp4" in out
    first, last = _loss_range(out)
    assert last < first - 0.5, out
    assert (tmp_path / "nvfp4-step30" / ".metadata").is_file()


def test_demo_refuses_tp_split_the_model_cannot_take(tmp_path, capsys):
    rc = cli.main(["demo", "--steps", "1", "--mesh", "1x8", "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    out = capsys.readouterr().out
    assert "tp=8 must divide the 4 heads" in out
    assert not os.listdir(tmp_path)


def test_demo_without_optax_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    """optax is the "train" extra: without it the demo stops with the install command, not a traceback."""
    monkeypatch.setitem(sys.modules, "optax", None)  # `import optax` now raises ImportError
    rc = cli.main(["demo", "--steps", "1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    out = capsys.readouterr().out
    assert 'pip install "jaxquant[train]"' in out and "optax" in out
    assert not os.listdir(tmp_path)
