"""`jaxquant demo` (the CLI entry point, in-process on the 8 simulated devices): the default flax NNX Llama trains
(the loss falls) on an FSDP mesh of every device and the hand-written TP-SP transformer (`--model tp-sp`) on an
fsdp-only and on its default (fsdp=4, tp=2) mesh, a DCP checkpoint is written and `jaxquant ckpt inspect` reads it;
a TP split a model cannot take is refused with a clear message."""

import os
import sys

import jax
import pytest

from jaxquant import cli

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def _assert_trained_nvfp4_and_inspect(out, tmp_path, capsys, steps):
    """A ``steps``-step NVFP4 run on fsdp=8: the per-device bytes, the loss fell, the checkpoint it names inspects;
    the listing."""
    assert "mesh fsdp=8 x tp=1" in out, out
    ratio = float(out.split(" per device (")[1].split("x bf16")[0])
    assert 0.25 < ratio < 0.35, out      # NVFP4 matrices: 0.5 + 1/16 bytes an element; the bf16 embedding dilutes
    first, last = _loss_range(out)
    assert last < first - 0.5, out
    ckpt = tmp_path / f"nvfp4-step{steps}"
    assert (ckpt / ".metadata").is_file()
    assert f"jaxquant ckpt inspect {ckpt}" in out
    assert cli.main(["ckpt", "inspect", str(ckpt)]) == 0
    return capsys.readouterr().out


def _loss_range(out):
    return tuple(float(v) for v in out.split("loss ")[-1].split(" over")[0].split(" -> "))


@pytest.mark.slow
def test_demo_on_tp_only_mesh_has_no_weight_gathers(tmp_path, capsys):
    """fsdp=1 x tp=2: each device holds its TP-local weights whole (nothing to all-gather) and the
    sequence-parallel step still trains."""
    rc = cli.main(["demo", "--model", "tp-sp", "--steps", "3", "--mesh", "1x2", "--recipe", "fp8", "--ckpt-dir",
                   str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mesh fsdp=1 x tp=2" in out and "weights all-gathered per step: none" in out
    assert (tmp_path / "fp8-step3" / ".metadata").is_file()


def test_demo_refuses_tp_split_the_model_cannot_take(tmp_path, capsys):
    rc = cli.main(["demo", "--model", "tp-sp", "--steps", "1", "--mesh", "1x8", "--ckpt-dir", str(tmp_path),
                   "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tp=8 must divide the 4 heads" in err
    assert not os.listdir(tmp_path)


def test_demo_refuses_tp_for_the_flax_llama(tmp_path, capsys):
    """Unchanged flax code does no TP collectives: the Llama takes FSDP meshes only, and the error says which."""
    rc = cli.main(["demo", "--steps", "1", "--mesh", "4x2", "--ckpt-dir", str(tmp_path), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and line.startswith("jaxquant demo: error: --mesh: the llama model trains with FSDP only"), line
    assert "use --mesh 8x1, or --model tp-sp" in line, line
    assert not os.listdir(tmp_path)


def test_demo_without_optax_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    """optax is the "train" extra: without it the demo stops with the install command, not a traceback."""
    monkeypatch.setitem(sys.modules, "optax", None)  # `import optax` now raises ImportError
    rc = cli.main(["demo", "--steps", "1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert 'pip install "jaxquant[train]"' in err and "optax" in err
    assert not os.listdir(tmp_path)


def test_demo_without_flax_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    """flax is in the "train" extra too: without it the default model stops with the install command (and names
    the model that needs no flax), one line, nothing written."""
    import jaxquant.cli

    monkeypatch.setitem(sys.modules, "flax", None)    # `import flax` now raises ImportError
    monkeypatch.delitem(sys.modules, "jaxquant.cli.llama", raising=False)
    monkeypatch.delattr(jaxquant.cli, "llama", raising=False)
    rc = cli.main(["demo", "--steps", "1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and "flax is not installed" in line and 'pip install "jaxquant[train]"' in line, line
    assert "--model tp-sp" in line, line
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("argv,message", [(["--steps", "0"], "--steps: must be at least 1, got 0"),
                                          (["--devices", "0"], "--devices: must be at least 1, got 0"),
                                          (["--batch-per-device", "0"], "--batch-per-device: must be at least 1"),
                                          (["--mesh", "0x8"], "--mesh: both sizes must be positive, got '0x8'"),
                                          (["--lr", "nan"], "--lr: must be a positive finite float32 number"),
                                          (["--lr", "0"], "--lr: must be a positive finite float32 number"),
                                          (["--lr", "1e39"], "--lr: must be a positive finite float32 number"),
                                          (["--eval-every", "5"], "--eval-every: needs --text"),
                                          (["--model", "tp-sp", "--mesh", "9x1"], "--mesh: 9x1 needs 9 devices")])
def test_demo_refuses_bad_counts_on_stderr(tmp_path, capsys, argv, message):
    rc = cli.main(["demo", *argv, "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2 and _one_error_line(capsys).startswith(f"jaxquant demo: error: {message}")
    assert not os.listdir(tmp_path)


def _one_error_line(capsys) -> str:
    """The one line a refused command prints on stderr (no traceback)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("losses,first,step,rc", [
    ([2.0, 2.5], 2.0, 2, 1),         # fresh run: judged from its first step
    ([4.8], 4.8, 1, 0),              # fresh one-step run: nothing to judge
    ([3.0, 3.1, 3.2], 4.8, 6, 0),    # resumed at step 3: judged from the first step the checkpoint records
    ([4.9], 4.8, 4, 1),
    ([3.0, 3.1], None, 6, 0),        # resumed from a checkpoint that records no first loss: not judged
])
def test_demo_judges_the_loss_from_the_first_step_of_training(monkeypatch, capsys, losses, first, step, rc):
    """One rule for fresh and resumed runs: the last loss must be below the training run's first (a resumed run
    gets the verdict the uninterrupted run would get); a fresh one-step run is not judged."""
    from jaxquant.cli import demo

    monkeypatch.setattr(demo, "run", lambda **kw: {"losses": losses, "first_loss": first, "step": step})
    args = cli.build_parser().parse_args(["demo", "--steps", str(len(losses))])
    assert demo.main(args) == rc
    err = capsys.readouterr().err
    assert ("did not fall" in err) == (rc == 1)
    if rc == 1:
        assert f"the loss did not fall ({first:.3f} at step 1 -> {losses[-1]:.3f} at step {step})" in err


def _assert_model_listing(model, out, listing):
    """What the demo says of each model and how its checkpoint names the parameters and the Adam state."""
    if model == "llama":   # the flax NNX Llama (nnx.scan over nnx.vmap-stacked blocks), kernels saved [out, in]
        assert "flax NNX Llama" in out and "under nnx.scan" in out and "weights nvfp4" in out, out
        assert "model.layers.1.mlp.down.kernel" in listing and "model_nvfp4.layers.1.mlp.down.kernel" in listing
        assert "optim.state.layers.1.mlp.down.kernel.exp_avg_sq" in listing     # the Adam state, as torch names it
        assert "model.embed.embedding" in listing and "model_nvfp4.embed" not in listing   # the embedding: an array
    else:
        assert "weights nvfp4" in out and "under scan" in out, out
        assert "model.blocks.1.down" in listing and "model_nvfp4.blocks.1.down" in listing
        assert "optim.state.blocks.1.down.exp_avg_sq" in listing           # the Adam state, as torch names it


@pytest.mark.slow
# the resume leg's --mesh (None: the model's default) and the mesh it then runs on. The Llama's, fsdp=3 (padded
# shards), is test_demo_never_saves_non_finite_parameters_and_names_its_mesh_once's: one compile of that step serves
# both (the session's compilation cache, tests/conftest.py).
@pytest.mark.parametrize("model,other_mesh,resumed_on", [("llama", "3x1", "fsdp=3 x tp=1"),
                                                         ("tp-sp", None, "fsdp=4 x tp=2")])
def test_demo_trains_checkpoints_and_resumes_on_another_mesh(tmp_path, capsys, model, other_mesh, resumed_on):
    """The default flax NNX Llama and the hand-written TP-SP model train 20 steps with NVFP4 weights on fsdp=8 (the
    loss falls); the checkpoints name each layer's parameters as the model does, with the Adam state, and `jaxquant
    ckpt inspect` reads them; --save-every writes training checkpoints on the way; --resume continues from one
    (parameters, Adam state, step, the data stream) on another mesh than the one it was written on: the Llama's on
    fsdp=3, the TP-SP model's on its default mesh, fsdp=4 x tp=2 (heads and MLP hidden units split over tp,
    Megatron column/row-parallel)."""
    steps, every = 20, 10
    rc = cli.main(["demo", "--model", model, "--steps", str(steps), "--mesh", "8x1", "--save-every", str(every),
                   "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    _assert_model_listing(model, out, _assert_trained_nvfp4_and_inspect(out, tmp_path, capsys, steps))
    first, _ = _loss_range(out)
    assert (tmp_path / f"nvfp4-step{every}" / ".metadata").is_file()
    flag = "" if model == "llama" else f" --model {model}"
    assert f"jaxquant demo --resume {tmp_path / f'nvfp4-step{steps}'} --recipe nvfp4{flag} --steps N" in out
    assert "load in PyTorch:   python -c 'import torch" in out
    mesh_arg = ["--mesh", other_mesh] if other_mesh else []
    rc = cli.main(["demo", "--model", model, "--steps", str(steps - every), *mesh_arg, "--resume",
                   str(tmp_path / f"nvfp4-step{every}"), "--ckpt-dir", str(tmp_path / "again"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"resumed from {tmp_path / f'nvfp4-step{every}'} at step {every}" in out
    assert f"mesh {resumed_on}" in out and "weights nvfp4" in out, out
    resumed_first, resumed_last = _loss_range(out)
    assert resumed_first < first - 1.0, out               # the loss goes on from where step 10 left it
    assert resumed_last < resumed_first, out
    assert (tmp_path / "again" / f"nvfp4-step{steps}" / ".metadata").is_file()
    rc = cli.main(["demo", "--resume", str(tmp_path / "nowhere"), "--ckpt-dir", str(tmp_path), "--no-progress"])
    assert rc == 2 and "--resume: " in capsys.readouterr().err


# --- what a new user hit (issue 45 item 6): each bad input is one line on stderr, exit 2, found before any
# training, nothing written; a non-finite state is never saved.

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A one-step fp8 checkpoint of the demo (1x1 mesh) and what the demo printed."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("demo-ckpt")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["demo", "--steps", "1", "--mesh", "1x1", "--recipe", "fp8", "--ckpt-dir", str(root),
                       "--no-progress"])
    assert rc == 0, out.getvalue()
    return root / "fp8-step1", out.getvalue()


def test_demo_one_step_runs_and_checkpoints(fp8_checkpoint):
    """--steps 1: no step after the compile one to time, still a result and a checkpoint."""
    ckpt, out = fp8_checkpoint
    assert "over 1 steps" in out and (ckpt / ".metadata").is_file(), out


def _damage(src, dst, how):
    """A copy of checkpoint ``src`` at ``dst``, damaged ``how``."""
    import shutil

    from jaxquant.checkpoint.metadata import read_metadata

    shutil.copytree(src, dst)
    data = dst / "__0_0.distcp"
    if how == "crc":        # one byte in the middle of model.embed.embedding's record (its tensor data)
        storage = read_metadata(str(src)).entries["model.embed.embedding"].chunks[0].storage
        raw = bytearray(data.read_bytes())
        raw[storage.offset + storage.length // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif how == "truncated":
        data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    elif how == "missing data file":
        data.unlink()
    elif how == "corrupt .metadata":
        meta = dst / ".metadata"
        meta.write_bytes(meta.read_bytes()[:100])
    return dst


@pytest.mark.parametrize("how,message", [
    ("crc", "CRC-32 mismatch"), ("truncated", "truncated"), ("missing data file", "is missing"),
    ("corrupt .metadata", ".metadata: not a valid pickle")])
def test_demo_refuses_a_damaged_checkpoint_to_resume(tmp_path, capsys, fp8_checkpoint, how, message):
    """The errors `jaxquant ckpt inspect` reports, as one line; exit 1 (the command line was sound, the checkpoint it
    names cannot be read), as `jaxquant ckpt inspect` and `convert` exit for it."""
    bad = _damage(fp8_checkpoint[0], tmp_path / "bad", how)
    rc = cli.main(["demo", "--resume", str(bad), "--recipe", "fp8", "--mesh", "1x1", "--ckpt-dir",
                   str(tmp_path / "out"), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 1 and line.startswith("jaxquant demo: error: --resume: ") and message in line, line
    assert not (tmp_path / "out").exists()


def test_demo_refuses_a_checkpoint_it_did_not_write(tmp_path, capsys):
    """A sound DCP checkpoint of something else."""
    import jax.numpy as jnp

    from jaxquant import checkpoint as ck

    foreign = ck.save_dcp(str(tmp_path / "foreign"), {"w": jnp.ones((4, 4)), "step": 3})
    rc = cli.main(["demo", "--resume", foreign, "--mesh", "1x1", "--ckpt-dir", str(tmp_path / "out"),
                   "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and "--resume: not a checkpoint of this demo's model" in line and "'model." in line, line
    assert not (tmp_path / "out").exists()


def test_demo_refuses_to_resume_with_another_recipe(tmp_path, capsys, fp8_checkpoint):
    """Resuming an fp8 run as nvfp4 (the default) would switch the compute weights silently: refused, naming
    both; the resume command the demo prints names the recipe."""
    ckpt, printed = fp8_checkpoint
    assert f"jaxquant demo --resume {ckpt} --recipe fp8 --steps N" in printed
    rc = cli.main(["demo", "--resume", str(ckpt), "--mesh", "1x1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and f"--resume: {ckpt} was trained with --recipe fp8, this run asks for --recipe nvfp4" in line
    assert not os.listdir(tmp_path)


def test_demo_refuses_to_resume_with_another_model(tmp_path, capsys, fp8_checkpoint):
    """The checkpoint records its model: a Llama checkpoint is not resumed as the TP-SP model, and a checkpoint of
    the demo from before --model (a recipe record, no model record: the TP-SP model then) not as the Llama."""
    from jaxquant import checkpoint as ck

    ckpt, _ = fp8_checkpoint
    rc = cli.main(["demo", "--model", "tp-sp", "--resume", str(ckpt), "--recipe", "fp8", "--mesh", "1x1",
                   "--ckpt-dir", str(tmp_path / "out"), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and f"--resume: {ckpt} was trained with --model llama, this run asks for --model tp-sp" in line
    assert "pass --model llama" in line, line
    old = ck.save_dcp(str(tmp_path / "old"), {"demo": {"recipe": "fp8", "first_loss": 4.0}, "step": 1})
    rc = cli.main(["demo", "--resume", old, "--recipe", "fp8", "--mesh", "1x1", "--ckpt-dir", str(tmp_path / "out"),
                   "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and "was trained with --model tp-sp, this run asks for --model llama" in line, line
    assert not (tmp_path / "out").exists()


def _unwritable_dir(tmp_path):
    """A directory this process cannot create entries in (root ignores mode bits: /sys then), or None."""
    import tempfile

    if os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir(mode=0o555)
        return d
    try:
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
    except OSError:
        return "/sys"
    return None


@pytest.mark.parametrize("where", ["file", "below a file", "unwritable"])
def test_demo_checks_the_checkpoint_destination_before_training(tmp_path, capsys, where):
    (tmp_path / "f").write_text("not a directory")
    ckpt_dir = {"file": tmp_path / "f", "below a file": tmp_path / "f" / "ckpts"}.get(where)
    if where == "unwritable":
        parent = _unwritable_dir(tmp_path)
        if parent is None:
            pytest.skip("no unwritable directory here")
        ckpt_dir = os.path.join(parent, "ckpts")
    rc = cli.main(["demo", "--steps", "1", "--mesh", "1x1", "--ckpt-dir", str(ckpt_dir), "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 2 and line.startswith("jaxquant demo: error: --ckpt-dir: "), line
    assert ("cannot write in" if where == "unwritable" else "is not a directory") in line, line
    assert sorted(os.listdir(tmp_path)) == ["f"] + (["read-only"] if where == "unwritable" and os.geteuid() else [])


def test_demo_stops_on_a_nan_loss_before_saving(tmp_path, capsys):
    """--lr 1e30: the first update makes the parameters ~1e30, the next loss is NaN: exit 1, one line, no checkpoint."""
    rc = cli.main(["demo", "--steps", "2", "--mesh", "1x1", "--lr", "1e30", "--ckpt-dir", str(tmp_path),
                   "--no-progress"])
    line = _one_error_line(capsys)
    assert rc == 1 and "the loss is nan at step 2" in line and "stopped without saving" in line, line
    assert not os.listdir(tmp_path)


# (its step, the Llama's NVFP4 one on fsdp=3, is the resume leg's in test_demo_trains_checkpoints_and_resumes_on_...)
def test_demo_never_saves_non_finite_parameters_and_names_its_mesh_once(tmp_path, capsys, monkeypatch):
    """A state whose parameters are not all finite is not saved (exit 1, one line). On fsdp=3, which divides none
    of the model's weights (the step pads them to split them), every line names the mesh as fsdp=3 (it once said
    fsdp=1 further down)."""
    from jaxquant.cli import demo

    monkeypatch.setattr(demo, "_all_finite", lambda tree: False)
    rc = cli.main(["demo", "--steps", "1", "--mesh", "3x1", "--ckpt-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "the parameters hold NaN or inf after step 1" in lines[0], out.err
    assert not os.listdir(tmp_path)
    assert "mesh fsdp=3 x tp=1" in out.out and "fsdp=1" not in out.out, out.out
    assert "weights all-gathered per step (each layer where it is used)" in out.out, out.out


def test_demo_prints_a_pytorch_load_command_that_works(fp8_checkpoint):
    """The closing "load in PyTorch" line is a shell command that loads every tensor, with no model class."""
    import subprocess

    pytest.importorskip("torch")
    ckpt, printed = fp8_checkpoint
    command = printed.split("load in PyTorch:")[1].strip().splitlines()[0]
    r = subprocess.run(["bash", "-c", command.replace("python -c", f"{sys.executable} -c", 1)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensors; model.head.kernel (64, 128)" in r.stdout, r.stdout     # the head kernel as torch holds it


def test_demo_judges_a_resumed_run_as_the_uninterrupted_one(tmp_path, capsys):
    """3 steps, then 3 more resumed from the checkpoint: exit 0 both times (the resumed run's loss is judged
    against the first step of the run it continues, which the checkpoint records with the recipe)."""
    from jaxquant import checkpoint as ck

    common = ["--mesh", "1x1", "--recipe", "bf16", "--no-progress"]
    assert cli.main(["demo", "--steps", "3", "--ckpt-dir", str(tmp_path / "a"), *common]) == 0
    first, _ = _loss_range(capsys.readouterr().out)
    assert cli.main(["demo", "--steps", "3", "--resume", str(tmp_path / "a" / "bf16-step3"), "--ckpt-dir",
                     str(tmp_path / "b"), *common]) == 0
    assert "did not fall" not in capsys.readouterr().err
    record = ck.load_dcp(str(tmp_path / "b" / "bf16-step6"), {"demo": {"recipe": str, "first_loss": float}})
    assert record["demo"]["recipe"] == "bf16" and f"{record['demo']['first_loss']:.3f}" == f"{first:.3f}"
