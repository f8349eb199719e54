"""`jaxquant demo` (the CLI entry point, in-process on the 8 simulated devices): the transformer trains
(the loss falls) on an fsdp-only mesh and on the default (fsdp=4, tp=2) mesh, a DCP checkpoint is written
and `jaxquant ckpt inspect` reads it; a TP split the model cannot take is refused with a clear message."""

import os
import sys

import jax
import pytest

from jaxquant import cli

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


@pytest.mark.slow
def test_demo_trains_and_checkpoints(tmp_path, capsys):
    rc = cli.main(["demo", "--steps", "30", "--mesh", "8x1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "weights nvfp4" in out and "mesh fsdp=8 x tp=1" in out and "under scan" in out
    ratio = float(out.split(" per device (")[1].split("x bf16")[0])
    assert 0.25 < ratio < 0.35, out      # NVFP4 layers: 0.5 + 1/16 bytes an element; the bf16 embedding dilutes
    first, last = _loss_range(out)
    assert last < first - 0.5, out
    ckpt = tmp_path / "nvfp4-step30"
    assert (ckpt / ".metadata").is_file()
    assert f"jaxquant ckpt inspect {ckpt}" in out
    assert cli.main(["ckpt", "inspect", str(ckpt)]) == 0
    listing = capsys.readouterr().out
    assert "model.blocks.1.down" in listing and "model_nvfp4.blocks.1.down" in listing
    assert "optim.state.blocks.1.down.exp_avg_sq" in listing           # the Adam state, as torch names it


def _loss_range(out):
    return tuple(float(v) for v in out.split("loss ")[-1].split(" over")[0].split(" -> "))


@pytest.mark.slow
def test_demo_default_mesh_is_fsdp_x_tp_and_trains(tmp_path, capsys):
    """Heads and MLP hidden units split over tp=2 (Megatron column/row-parallel), NVFP4 weights."""
    rc = cli.main(["demo", "--steps", "30", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mesh fsdp=4 x tp=2" in out and "weights nvfp4" in out
    first, last = _loss_range(out)
    assert last < first - 0.5, out
    assert (tmp_path / "nvfp4-step30" / ".metadata").is_file()


@pytest.mark.slow
def test_demo_on_tp_only_mesh_has_no_weight_gathers(tmp_path, capsys):
    """fsdp=1 x tp=2: each device holds its TP-local weights whole (nothing to all-gather) and the
    sequence-parallel step still trains."""
    rc = cli.main(["demo", "--steps", "3", "--mesh", "1x2", "--recipe", "fp8", "--ckpt-dir", str(tmp_path),
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mesh fsdp=1 x tp=2" in out and "weights all-gathered per step: none" in out
    assert (tmp_path / "fp8-step3" / ".metadata").is_file()


def test_demo_refuses_tp_split_the_model_cannot_take(tmp_path, capsys):
    rc = cli.main(["demo", "--steps", "1", "--mesh", "1x8", "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tp=8 must divide the 4 heads" in err
    assert not os.listdir(tmp_path)


def test_demo_without_optax_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    """optax is the "train" extra: without it the demo stops with the install command, not a traceback."""
    monkeypatch.setitem(sys.modules, "optax", None)  # `import optax` now raises ImportError
    rc = cli.main(["demo", "--steps", "1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert 'pip install "jaxquant[train]"' in err and "optax" in err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("argv,message", [(["--steps", "0"], "--steps: must be at least 1, got 0"),
                                          (["--devices", "0"], "--devices: must be at least 1, got 0"),
                                          (["--batch-per-device", "0"], "--batch-per-device: must be at least 1")])
def test_demo_refuses_bad_counts_on_stderr(tmp_path, capsys, argv, message):
    rc = cli.main(["demo", *argv, "--ckpt-dir", str(tmp_path), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 2 and message in captured.err and "Traceback" not in captured.err
    assert not os.listdir(tmp_path)


def test_demo_says_when_the_loss_did_not_fall(monkeypatch, capsys):
    from jaxquant import demo

    monkeypatch.setattr(demo, "run", lambda **kw: {"losses": [2.0, 2.5]})
    args = cli.build_parser().parse_args(["demo", "--steps", "2"])
    assert demo.main(args) == 1
    assert "the loss did not fall (2.000 -> 2.500 over 2 steps)" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_one_step_runs_and_checkpoints(tmp_path, capsys):
    """--steps 1: no step after the compile one to time, still a result and a checkpoint."""
    rc = cli.main(["demo", "--steps", "1", "--mesh", "8x1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "over 1 steps" in out and (tmp_path / "nvfp4-step1" / ".metadata").is_file()


@pytest.mark.slow
def test_demo_saves_every_n_and_resumes_on_another_mesh(tmp_path, capsys):
    """--save-every writes training checkpoints on the way; --resume continues from one (parameters, Adam
    state, step, the data stream) on a (4, 2) mesh although it was written on (8, 1)."""
    rc = cli.main(["demo", "--steps", "12", "--mesh", "8x1", "--save-every", "6", "--ckpt-dir", str(tmp_path),
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    first, _ = _loss_range(out)
    assert (tmp_path / "nvfp4-step6" / ".metadata").is_file() and (tmp_path / "nvfp4-step12").is_dir()
    assert f"jaxquant demo --resume {tmp_path / 'nvfp4-step12'}" in out and "set_state_dict" in out
    rc = cli.main(["demo", "--steps", "6", "--mesh", "4x2", "--resume", str(tmp_path / "nvfp4-step6"),
                   "--ckpt-dir", str(tmp_path / "again"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"resumed from {tmp_path / 'nvfp4-step6'} at step 6" in out
    resumed_first, _ = _loss_range(out)
    assert resumed_first < first - 1.0, out               # the loss goes on from where step 6 left it
    assert (tmp_path / "again" / "nvfp4-step12" / ".metadata").is_file()
    rc = cli.main(["demo", "--resume", str(tmp_path / "nowhere"), "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2 and "--resume: " in capsys.readouterr().err
