"""The model-independent parts of ``jaxquant demo`` (jaxquant/cli/demo.py): checks of its options and destinations
(each a ``ValueError`` whose message starts with the option's name, raised before any training), the checkpoint
plumbing of ``--resume`` / ``--ckpt-dir`` (the records the demo keeps in its checkpoints, the PyTorch load
command) and the loss-curve plot of ``--plot`` (benchmarks/bench_convergence.py draws its own with it too)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from typing import Optional

from jaxquant.cli.errors import OperationError, UsageError, check_output_dir, check_output_file, check_writable


class MissingExtraError(ImportError):
    """A package of the "train" extra (not a core dependency) is not installed; the message says how to get it."""

    def __init__(self, what: str):
        super().__init__(f'{what}: pip install "jaxquant[train]" (from a checkout: pip install '
                         f'--no-build-isolation -e ".[train]")')


class MissingOptaxError(MissingExtraError):
    def __init__(self):
        super().__init__("the demo trains with optax, which is not installed")


class NonFiniteError(ArithmeticError):
    """The loss or the parameters became NaN or ±inf: the run stops before saving that state."""


def parse_mesh(spec: str | None, num_devices: int, default_tp: int = 2) -> tuple[int, int]:
    """``"FxT"`` -> (fsdp, tp); None -> every device on a (fsdp, tp=``default_tp``) mesh (``Nx1`` for a count that
    ``default_tp`` does not divide)."""
    if spec is None:
        return (num_devices // default_tp, default_tp) if num_devices % default_tp == 0 else (num_devices, 1)
    try:
        fsdp, tp = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh: must look like 8x1 (fsdp x tp), got {spec!r}") from None
    if fsdp < 1 or tp < 1:
        raise ValueError(f"--mesh: both sizes must be positive, got {spec!r}")
    if fsdp * tp > num_devices:
        raise ValueError(f"--mesh: {fsdp}x{tp} needs {fsdp * tp} devices, {num_devices} available")
    return fsdp, tp


def bytes_gathered(plan, recipe: str) -> tuple[int, int]:
    """(bytes each device receives per step from the weight all-gathers, the same for bf16 weights): every
    quantized layer is gathered twice (forward, backward) as quantized bytes and scales; masked and other
    leaves once, as bf16 / fp32 arrays. With TP, one TP rank's blocks."""
    per_element = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0, "bf16": 2.0}[recipe]
    sent = sent_bf16 = 0
    for rule in plan.rules:
        local = math.prod(rule.shape) // rule.tp_size
        received = local * (rule.weight.num_shards - 1) // rule.weight.num_shards
        if rule.quantized:
            sent += int(2 * received * per_element)
            sent_bf16 += 2 * received * 2
        else:
            size = 2 if rule.recipe == "bf16" else 4
            sent += received * size
            sent_bf16 += received * size
    return sent, sent_bf16


def print_backends() -> None:
    from jaxquant.primitives import ops

    print(ops.backend_summary())


def fresh_dir(path: str) -> str:
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def _os_error_text(e: OSError) -> str:
    from jaxquant.checkpoint.fsutil import os_error_cause

    return f"{e.filename}: {os_error_cause(e)}" if e.filename else os_error_cause(e)


def check_writable_dir(directory: str, option: str, *, create: bool) -> None:
    """Raise ``UsageError("{option}: ...")`` (a ``ValueError``) unless files can be made in ``directory``
    (``create``: or ``directory`` is missing and can be made in its parent, which must exist: parents are never
    made). Tried by making and removing a temporary directory, so a destination that cannot be written is refused
    before the work whose results would go there, not after it."""
    if create:
        check_output_dir(directory, option)
    else:
        check_writable(directory, option)


# --- the demo's records in its checkpoints ("demo.*"): what --resume checks and judges by


def _recorded(path: str, name: str, kind: type):
    """The demo's record ``demo.{name}`` of checkpoint ``path``; None where it has none (written by another
    program, or by the demo before it kept this record). Raises ``CheckpointError`` for an unreadable one."""
    from jaxquant import checkpoint as ck

    try:
        return ck.load_dcp(path, {"demo": {name: kind}})["demo"][name]
    except ck.KeyMismatchError:
        return None


def checkpoint_recipe(path: str) -> str | None:
    """The recipe checkpoint ``path`` was trained with: its ``demo.recipe`` record, else the name the demo gives
    its checkpoint directories (``{recipe}-step{N}``); None where neither says."""
    recorded = _recorded(path, "recipe", str)
    name = re.fullmatch(r"(nvfp4|fp8|bf16)-step\d+(-\d+)?", os.path.basename(os.path.normpath(path)))
    return recorded or (name and name[1])


def checkpoint_model(path: str) -> str | None:
    """The ``--model`` checkpoint ``path`` was trained with: its ``demo.model`` record; ``tp-sp`` for a checkpoint
    of the demo from before ``--model`` (it records its recipe but no model: it had only that model); else None."""
    model = _recorded(path, "model", str)
    if model is None and _recorded(path, "recipe", str) is not None:
        return "tp-sp"
    return model


def run_record(recipe: str, model: str, data: str, first_loss: float | None) -> dict:
    """The ``demo`` entry of a checkpoint: the recipe, model and data (``synthetic`` / ``text``) the run trains
    with, and the loss its training run started from (judged against when it is resumed)."""
    return {"recipe": recipe, "model": model, "data": data} | ({} if first_loss is None else {"first_loss": first_loss})


def _resume_error(e: Exception) -> Exception:
    """``--resume``'s error for ``e`` (a ``CheckpointError`` or ``OSError``): a path that is no checkpoint to read
    (missing, a file, a staging directory) is bad usage; a checkpoint that cannot be read (damaged, unreadable) a
    failed operation. The messages are ``jaxquant ckpt inspect``'s (jaxquant/checkpoint/errors.py)."""
    from jaxquant import checkpoint as ck

    if isinstance(e, OSError):
        return OperationError(f"--resume: {_os_error_text(e)}")
    if isinstance(e, (ck.CheckpointNotFoundError, ck.IncompleteCheckpointError)):
        return UsageError(f"--resume: {e}")
    return OperationError(f"--resume: {e}")


def check_resume(path: str, recipe: str, model: str = "llama", data: str = "synthetic") -> float | None:
    """Before any work: ``path`` must be a readable DCP checkpoint trained with ``recipe`` (resuming with another
    would switch the compute weights mid-run), ``model`` and on the same kind of ``data``. Returns the loss of its
    run's first step, None where the checkpoint does not record it. Raises ``UsageError`` or, for a checkpoint
    that cannot be read, ``OperationError`` (see ``_resume_error``)."""
    from jaxquant import checkpoint as ck

    try:
        trained = checkpoint_recipe(path)
        trained_model = checkpoint_model(path)
        trained_data = _recorded(path, "data", str)
        first_loss = _recorded(path, "first_loss", float)
    except (ck.CheckpointError, OSError) as e:
        raise _resume_error(e) from None
    if trained is not None and trained != recipe:
        raise UsageError(f"--resume: {path} was trained with --recipe {trained}, this run asks for --recipe "
                         f"{recipe}; pass --recipe {trained} to continue it")
    if trained_model is not None and trained_model != model:
        raise UsageError(f"--resume: {path} was trained with --model {trained_model}, this run asks for --model "
                         f"{model}; pass --model {trained_model} to continue it")
    if trained_data is not None and trained_data != data:
        said = {"text": "--text data (byte tokens)", "synthetic": "the synthetic data (no --text)"}
        raise UsageError(f"--resume: {path} was trained on {said.get(trained_data, trained_data)}, this run on "
                         f"{said.get(data, data)}; {'pass --text PATH' if trained_data == 'text' else 'drop --text'}"
                         f" to continue it")
    return first_loss


def resumed_state(step, like, path: str):
    """The training state of checkpoint ``path`` on ``step``'s mesh; ``UsageError("--resume: ...")`` for a
    checkpoint of another model, ``OperationError`` for a damaged one (a chunk's CRC-32 is checked as it is read)."""
    from jaxquant import checkpoint as ck

    try:
        return step.load_state_dict(ck.load_dcp(path, step.state_dict_target(like)), like=like)
    except ck.KeyMismatchError as e:
        raise UsageError(f"--resume: not a checkpoint of this demo's model: {e}") from None
    except (ck.CheckpointError, OSError) as e:
        raise _resume_error(e) from None
    except (KeyError, ValueError) as e:   # load_state_dict: entries that are no Adam state of this model
        raise UsageError(f"--resume: not a checkpoint of this demo's training state: {path}: "
                         f"{e.args[0] if e.args else e}") from None


def peak_memory_gib(devices) -> float | None:
    """The largest peak of device memory in use among ``devices`` (None where the backend does not say)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2 ** 30 if peaks else None


def torch_load_command(path: str, show: str = "model.head") -> str:
    """A shell command that loads every tensor of DCP checkpoint ``path`` into a PyTorch dict (keyed as the
    checkpoint names them: model.*, optim.state.*, model_nvfp4.*), with no model class: the dict is built from
    the checkpoint's own metadata. It prints the count and the shape of tensor ``show``."""
    code = (f"import torch, torch.distributed.checkpoint as dcp; r = dcp.FileSystemReader({json.dumps(path)}); "
            'sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in '
            'r.read_metadata().state_dict_metadata.items() if hasattr(m, "size")}; dcp.load(sd, storage_reader=r); '
            f'print(len(sd), "tensors; {show}", tuple(sd["{show}"].shape))')
    return f"python -c {shlex.quote(code)}"


# --- --plot


def check_plot(path: str, option: str = "--plot") -> None:
    """Before any work: ``path`` must name a ``.png`` file in a directory that exists and can be written (it is
    never made), and matplotlib must be installed."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"{option}: must name a .png file, got {path!r}")
    check_output_file(path, option)
    require_matplotlib(option)


def require_matplotlib(option: str = "--plot") -> None:
    """``UsageError`` naming ``option`` unless matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f'{option}: needs matplotlib, which is not installed: pip install matplotlib (or '
                         f'pip install "jaxquant[train]")') from None


def write_plot(path: str, curves, *, xlabel: str, ylabel: str = "loss (nats / token)", title: str = "",
               zoom_from: Optional[float] = None) -> str:
    """Write a PNG of ``curves`` ``[(label, xs, ys, style)]`` (``style``: a matplotlib format such as ``"-"`` or
    ``"o-"``) to ``path``, in a directory that exists (see ``check_plot``); returns ``path``. ``zoom_from``: a
    second panel with the points at ``x >= zoom_from`` (where curves that fell together differ by little). Draws on
    a ``Figure`` of its own (no pyplot: no global backend or window)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12 if zoom_from is not None else 7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    panels = [(fig.add_subplot(1, 2 if zoom_from is not None else 1, 1), None)]
    if zoom_from is not None:
        panels.append((fig.add_subplot(1, 2, 2), zoom_from))
    for ax, start in panels:
        for label, xs, ys, style in curves:
            keep = [(x, y) for x, y in zip(xs, ys) if start is None or x >= start]
            if keep:
                ax.plot(*zip(*keep), style, label=label, markersize=3, linewidth=1.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        if start is not None:
            ax.set_title(f"from x = {start:.3g}", fontsize=9)
    if title:
        import textwrap

        fig.suptitle(textwrap.fill(title, 150 if zoom_from is not None else 90), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
