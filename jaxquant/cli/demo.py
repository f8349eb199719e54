"""``jaxquant demo``: train a small transformer with NVFP4 / FP8 / bf16 weights cast from fp32 master shards.

A decoder-only transformer (token embedding read with ``jnp.take``, ``layers`` pre-norm blocks of causal
attention + GELU MLP stacked into ``[L, out, in]`` leaves and run under ``jax.lax.scan``, output head;
every matrix in PyTorch ``[out, in]`` convention and applied with ``jq.dense``) learns synthetic
next-token data: each sequence follows a fixed random permutation of the vocabulary from a random first
token, so the loss falls from ``ln(vocab)`` towards 0. Training runs through ``jq.make_train_step``
(layer-wise FSDP: each layer's weights are quantized and gathered where the scan body uses them) on an
``(fsdp, tp)`` mesh, Megatron-style tensor parallel over ``tp``: the QKV and MLP-up weights are
column-parallel (each TP rank holds ``heads/tp`` heads and ``d_ff/tp`` hidden units), the attention output
and MLP-down weights row-parallel, their outputs ``psum``-ed over ``tp``; embedding, head and norms are
replicated over ``tp``. ``quantize_mask`` keeps the embedding and the norms unquantized (bf16 arrays). The
run ends by saving a PyTorch DCP checkpoint of the fp32 parameters (one name per layer, as a PyTorch
model has them) and the NVFP4/FP8 weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import tempfile
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    layers: int = 2
    seq: int = 32


RECIPES = ("nvfp4", "fp8", "bf16")
BLOCK_MATRICES = ("q", "k", "v", "o", "up", "down")
TP_SPLIT = {"q": "col", "k": "col", "v": "col", "o": "row", "up": "col", "down": "row"}


def _block_shapes(cfg: ModelConfig) -> dict:
    d, f = cfg.d_model, cfg.d_ff
    return {"attn_norm": (d,), "q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "mlp_norm": (d,),
            "up": (f, d), "down": (d, f)}


def init_params(key, cfg: ModelConfig):
    """fp32 parameters: ``embed`` [vocab, d_model] (rows looked up), ``head`` [vocab, d_model], ``final_norm``
    and ``blocks``, each block leaf stacked over the layers ([L, out, in] matrices, [L, d] norm scales)."""
    import jax
    import jax.numpy as jnp

    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.float32) / math.sqrt(shape[-1])

    ks = jax.random.split(key, len(_block_shapes(cfg)) + 2)
    blocks = {name: (jnp.ones((cfg.layers,) + shape, jnp.float32) if len(shape) == 1
                     else normal(k, (cfg.layers,) + shape))
              for k, (name, shape) in zip(ks, sorted(_block_shapes(cfg).items()))}
    return {"embed": jax.random.normal(ks[-2], (cfg.vocab, cfg.d_model), jnp.float32),
            "head": normal(ks[-1], (cfg.vocab, cfg.d_model)),
            "final_norm": jnp.ones((cfg.d_model,), jnp.float32), "blocks": blocks}


def quantize_mask(cfg: ModelConfig):
    """The quantized leaves: the block matrices and the head (the embedding is read by rows, the stacked
    norm scales [L, d] are no GEMM weights)."""
    return {"embed": False, "head": True, "final_norm": False,
            "blocks": {name: name in BLOCK_MATRICES for name in _block_shapes(cfg)}}


def per_layer(params, cfg: ModelConfig) -> dict:
    """Flat ``{name: array}`` with one entry per layer (``blocks.{i}.q``, as a PyTorch model names them and as
    ``step.state_dict`` does)."""
    flat = {n: params[n] for n in ("embed", "head", "final_norm")}
    for name, stack in params["blocks"].items():
        flat |= {f"blocks.{i}.{name}": stack[i] for i in range(cfg.layers)}
    return flat


def _rms_norm(x, scale):
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)) * scale).astype(x.dtype)


def _positions(seq, d):
    """Sinusoidal position encodings [seq, d] (fixed, not a parameter)."""
    pos = np.arange(seq)[:, None] / (10000.0 ** (np.arange(0, d, 2)[None, :] / d))
    return np.concatenate([np.sin(pos), np.cos(pos)], axis=1).astype(np.float32)


def param_specs(cfg: ModelConfig):
    """How make_train_step splits each parameter over tp (Megatron: column- then row-parallel)."""
    return {"embed": None, "head": None, "final_norm": None,
            "blocks": {name: TP_SPLIT.get(name) for name in _block_shapes(cfg)}}


def loss_fn(cfg: ModelConfig, tp_axis: str | None = None, tp: int = 1, sequence_parallel: bool = True,
            overlap: str = "off"):
    """loss(weights, batch): mean next-token cross-entropy; batch["tokens"] int32 [B, seq + 1]. With
    ``tp > 1`` it runs on one TP rank's blocks (``param_specs``) and does the TP collectives itself:
    with ``sequence_parallel`` (Megatron SP, ``jq.sp_column_dense`` / ``jq.sp_row_dense``) the residual
    stream, norms and loss hold this rank's ``seq / tp`` positions, the column-parallel GEMMs all-gather
    their input over tp and the row-parallel ones reduce-scatter their bf16 partial sums; without it every
    TP rank holds the whole sequence and the row-parallel partial sums are all-reduced in fp32.
    ``overlap`` goes to the sequence-parallel layers ("fused": the bf16 / FP8 collective GEMM kernels, docs/sp.md)."""
    import jax
    import jax.numpy as jnp

    import jaxquant as jq
    from jaxquant.primitives.varying import mark_varying

    act = jnp.bfloat16
    hd = cfg.d_model // cfg.heads
    heads = cfg.heads // tp                # this TP rank's heads
    amax = (tp_axis,) if tp > 1 else ()    # FP8 statistics of TP-split activations span the whole tensor
    sp = sequence_parallel and tp > 1

    def column_parallel(x, w):
        if sp:
            return jq.sp_column_dense(x, w, tp_axis=tp_axis, out_dtype=act, overlap=overlap)
        if tp > 1:   # Megatron's "f": identity forward; its transpose all-reduces the input gradient over tp
            x = mark_varying(x, (tp_axis,))
        return jq.dense(x, w, out_dtype=act, amax_axes=amax)

    def row_parallel(x, w):   # Megatron's "g": partial products summed over tp
        if sp:
            return jq.sp_row_dense(x, w, tp_axis=tp_axis, out_dtype=act, overlap=overlap)
        y = jq.dense(x, w, out_dtype=jnp.float32, amax_axes=amax)
        return (jax.lax.psum(y, tp_axis) if tp > 1 else y).astype(act)
    pos = _positions(cfg.seq, cfg.d_model)
    mask = np.tril(np.ones((cfg.seq, cfg.seq), bool))

    def block(h, p):
        b = h.shape[0]
        x = _rms_norm(h, p["attn_norm"])
        q, k, v = (column_parallel(x, p[n]).reshape(b, cfg.seq, heads, hd) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1).astype(act)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, cfg.seq, heads * hd)
        h = h + row_parallel(o, p["o"])
        x = _rms_norm(h, p["mlp_norm"])
        return h + row_parallel(jax.nn.gelu(column_parallel(x, p["up"])), p["down"]), None

    def loss(w, batch):
        tokens = batch["tokens"]
        inputs, targets, p = tokens[:, :-1], tokens[:, 1:], pos
        if sp:   # this rank's positions of the sequence
            rows = cfg.seq // tp
            start = jax.lax.axis_index(tp_axis) * rows
            local = lambda a, axis: jax.lax.dynamic_slice_in_dim(a, start, rows, axis=axis)
            inputs, targets, p = local(inputs, 1), local(targets, 1), local(jnp.asarray(pos), 0)
        h = jnp.take(w["embed"], inputs, axis=0).astype(act) + p.astype(act)
        h, _ = jax.lax.scan(block, h, w["blocks"])          # one layer's weights gathered per iteration
        logits = jq.dense(_rms_norm(h, w["final_norm"]), w["head"], out_dtype=jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        return jax.lax.pmean(nll, tp_axis) if sp else nll    # equal shares of the sequence

    return loss


class SyntheticData:
    """Next-token data: token t+1 = perm[token t], from a random first token; one fresh batch a step
    (``skip``: the batches of steps already taken, so a resumed run sees the data it would have seen)."""

    def __init__(self, cfg: ModelConfig, batch: int, seed: int = 0, skip: int = 0):
        self.cfg, self.batch = cfg, batch
        self.rng = np.random.default_rng(seed)
        self.perm = self.rng.permutation(cfg.vocab)
        for _ in range(skip):
            self.next()

    def next(self):
        tokens = np.empty((self.batch, self.cfg.seq + 1), np.int32)
        tokens[:, 0] = self.rng.integers(0, self.cfg.vocab, self.batch)
        for t in range(self.cfg.seq):
            tokens[:, t + 1] = self.perm[tokens[:, t]]
        return {"tokens": tokens}


def parse_mesh(spec: str | None, num_devices: int) -> tuple[int, int]:
    """``"FxT"`` -> (fsdp, tp); None -> every device on a (fsdp, tp=2) mesh (``Nx1`` for an odd count)."""
    if spec is None:
        return (num_devices // 2, 2) if num_devices % 2 == 0 else (num_devices, 1)
    try:
        fsdp, tp = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh: must look like 8x1 (fsdp x tp), got {spec!r}") from None
    if fsdp < 1 or tp < 1:
        raise ValueError(f"--mesh: both sizes must be positive, got {spec!r}")
    if fsdp * tp > num_devices:
        raise ValueError(f"--mesh: {fsdp}x{tp} needs {fsdp * tp} devices, {num_devices} available")
    return fsdp, tp


def check_tp(cfg: ModelConfig, tp: int, recipe: str) -> None:
    """The model splits over ``tp`` ranks: whole heads and hidden units, NVFP4 16-element tiles."""
    if cfg.heads % tp or cfg.d_ff % tp or cfg.seq % tp:
        raise ValueError(f"--mesh: tp={tp} must divide the {cfg.heads} heads, d_ff={cfg.d_ff} and the sequence "
                         f"length {cfg.seq} (sequence parallelism)")
    if recipe == "nvfp4" and (cfg.d_model // tp) % 16:
        raise ValueError(f"--mesh: tp={tp} leaves {cfg.d_model // tp} columns per TP rank; NVFP4 needs a "
                         f"multiple of 16 (use tp <= {cfg.d_model // 16})")


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


def _print_backends() -> None:
    import jax

    from jaxquant.primitives import _ffi

    summary = getattr(_ffi, "backend_summary", None)
    if summary is not None:
        print(summary())
    else:
        print(f"backend: {jax.default_backend()}; custom calls built for: "
              f"{', '.join(_ffi.built_platforms()) or 'none (pure-JAX reference everywhere)'}")


def _fresh_dir(path: str) -> str:
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


class MissingOptaxError(ImportError):
    """optax (the "train" extra, not a core dependency) is not installed; the message says how to get it."""

    def __init__(self):
        super().__init__('the demo trains with optax, which is not installed: pip install "jaxquant[train]" '
                         '(from a checkout: pip install --no-build-isolation -e ".[train]")')


class NonFiniteError(ArithmeticError):
    """The loss or the parameters became NaN or ±inf: the run stops before saving that state."""


def _os_error_text(e: OSError) -> str:
    from jaxquant.checkpoint.fsutil import os_error_cause

    return f"{e.filename}: {os_error_cause(e)}" if e.filename else os_error_cause(e)


def check_writable_dir(directory: str, option: str, *, create: bool) -> None:
    """Raise ``ValueError("{option}: ...")`` unless files can be made in ``directory`` (``create``: or in the
    directory it will be made in, with its parents). Tried by making and removing a temporary directory, so a
    destination that cannot be written is refused before the work whose results would go there, not after it."""
    from jaxquant.checkpoint.fsutil import os_error_cause

    path = os.path.abspath(directory)
    existing = path
    while create and not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "does not exist" if not os.path.lexists(existing) else "is not a directory"
        on_the_way = "" if existing == path else f" (on the way to {directory})"
        raise ValueError(f"{option}: {existing} {what}{on_the_way}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxquant-probe-", dir=existing))
    except OSError as e:
        raise ValueError(f"{option}: cannot write in {existing}: {os_error_cause(e)}") from None


def _recorded(path: str, name: str, kind: type):
    """The demo's record ``demo.{name}`` of checkpoint ``path``; None where it has none (written by another
    program, or by the demo before it kept these records). Raises ``CheckpointError`` for an unreadable one."""
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


def check_resume(path: str, recipe: str) -> float | None:
    """Before any work: ``path`` must be a readable DCP checkpoint trained with ``recipe`` (resuming with
    another would switch the compute weights mid-run). Returns the loss of its run's first step, None where the
    checkpoint does not record it. The errors are ``jaxquant ckpt inspect``'s (jaxquant/checkpoint/errors.py)."""
    from jaxquant import checkpoint as ck

    try:
        trained = checkpoint_recipe(path)
        first_loss = _recorded(path, "first_loss", float)
    except ck.CheckpointError as e:
        raise ValueError(f"--resume: {e}") from None
    except OSError as e:
        raise ValueError(f"--resume: {_os_error_text(e)}") from None
    if trained is not None and trained != recipe:
        raise ValueError(f"--resume: {path} was trained with --recipe {trained}, this run asks for --recipe "
                         f"{recipe}; pass --recipe {trained} to continue it")
    return first_loss


def _resumed_state(step, like, path: str):
    """The training state of checkpoint ``path`` on ``step``'s mesh; ``ValueError("--resume: ...")`` for a
    damaged checkpoint (a chunk's CRC-32 is checked as it is read) or one of another model."""
    from jaxquant import checkpoint as ck

    try:
        return step.load_state_dict(ck.load_dcp(path, step.state_dict_target(like)), like=like)
    except ck.KeyMismatchError as e:
        raise ValueError(f"--resume: not a checkpoint of this demo's model: {e}") from None
    except ck.CheckpointError as e:
        raise ValueError(f"--resume: {e}") from None
    except OSError as e:
        raise ValueError(f"--resume: {_os_error_text(e)}") from None
    except (KeyError, ValueError) as e:   # load_state_dict: entries that are no Adam state of this model
        raise ValueError(f"--resume: not a checkpoint of this demo's training state: {path}: "
                         f"{e.args[0] if e.args else e}") from None


def _all_finite(tree) -> bool:
    import jax
    import jax.numpy as jnp

    return all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(tree))


def peak_memory_gib(devices) -> float | None:
    """The largest peak of device memory in use among ``devices`` (None where the backend does not say)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2 ** 30 if peaks else None


def torch_load_command(path: str) -> str:
    """A shell command that loads every tensor of DCP checkpoint ``path`` into a PyTorch dict (keyed as the
    checkpoint names them: model.*, optim.state.*, model_nvfp4.*), with no model class: the dict is built from
    the checkpoint's own metadata."""
    code = (f"import torch, torch.distributed.checkpoint as dcp; r = dcp.FileSystemReader({json.dumps(path)}); "
            'sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in '
            'r.read_metadata().state_dict_metadata.items() if hasattr(m, "size")}; dcp.load(sd, storage_reader=r); '
            'print(len(sd), "tensors; model.head", tuple(sd["model.head"].shape))')
    return f"python -c {shlex.quote(code)}"


def run(steps: int = 40, recipe: str = "nvfp4", mesh_spec: str | None = None, batch_per_device: int = 2,
        lr: float = 3e-3, ckpt_dir: str = "jaxquant-demo-ckpt", seed: int = 0, progress: bool = True,
        cfg: ModelConfig = ModelConfig(), resume: str | None = None, save_every: int = 0):
    """Train and checkpoint; returns a dict with the losses, the checkpoint path and the throughput, and
    ``first_loss`` (the loss of the training run's first step: this run's, or for ``resume`` the one the
    checkpoint records; None where it does not) and ``step`` (the steps taken in all).

    Every argument and the checkpoint to resume are checked before any training (``ValueError`` starting with
    the option's name); a NaN or ±inf loss or parameter stops the run before it is saved (``NonFiniteError``)."""
    import jax
    try:
        import optax
    except ImportError as e:
        raise MissingOptaxError() from e
    from jax.sharding import Mesh
    from tqdm.auto import tqdm

    import jaxquant as jq
    from jaxquant import checkpoint as ck
    from jaxquant.checkpoint import interrupt

    if recipe not in RECIPES:
        raise ValueError(f"--recipe: must be nvfp4, fp8 or bf16, got {recipe!r}")
    if steps < 1:
        raise ValueError(f"--steps: must be at least 1, got {steps}")
    if batch_per_device < 1:
        raise ValueError(f"--batch-per-device: must be at least 1, got {batch_per_device}")
    if save_every < 0:
        raise ValueError(f"--save-every: must be 0 (off) or positive, got {save_every}")
    if not 0 < lr <= float(np.finfo(np.float32).max):   # (the step computes in float32: a larger one is inf)
        raise ValueError(f"--lr: must be a positive finite float32 number, got {lr}")
    devices = jax.devices()
    fsdp, tp = parse_mesh(mesh_spec, len(devices))
    check_tp(cfg, tp, recipe)
    first_loss = check_resume(resume, recipe) if resume is not None else None
    check_writable_dir(ckpt_dir, "--ckpt-dir", create=True)
    _print_backends()
    mesh = Mesh(np.array(devices[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))
    batch = batch_per_device * fsdp * tp        # the TP ranks of one FSDP rank share its rows
    step = jq.make_train_step(loss_fn(cfg, "tp", tp), optax.adam(lr), mesh=mesh, tp_axis="tp",
                              param_specs=param_specs(cfg), quantize_mask=quantize_mask(cfg),
                              policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
    state = step.init(init_params(jax.random.key(seed), cfg))
    adam = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)     # optax.adam's, as torch names them
    if resume is not None:   # any mesh size: the checkpoint is read into this mesh's shards
        state = _resumed_state(step, state, resume)
        print(f"resumed from {resume} at step {int(state.step)}")
    start = int(state.step)
    sent, sent_bf16 = bytes_gathered(state.plan, recipe)
    n_params = sum(math.prod(shape) for shape in state.plan.shapes)
    print(f"model: {cfg.layers} blocks under scan, d_model {cfg.d_model}, vocab {cfg.vocab}, {n_params:,} "
          f"parameters; mesh fsdp={fsdp} x tp={tp} on {devices[0].platform}; weights {recipe}, layer-wise FSDP; "
          f"batch {batch} x {cfg.seq} tokens")
    if sent_bf16:
        gathered = f"{sent / 1024:.0f} KiB/step per device ({sent / sent_bf16:.2f}x bf16)"
        print(f"weights all-gathered per step (each layer where it is used): {gathered}")
    else:   # fsdp = 1, or no weight's rows split evenly over fsdp (e.g. 3): every rank holds its weights whole
        split = "" if fsdp == 1 else " splits no weight evenly"
        print(f"weights all-gathered per step: none (fsdp={fsdp}{split}: each device holds its weights whole)")
    data = SyntheticData(cfg, batch, seed, skip=start)

    def save(total, final):
        if not _all_finite(state.master):
            raise NonFiniteError(f"the parameters hold NaN or inf after step {total} (--lr {lr:g}); stopped "
                                 f"without saving them")
        tree = step.state_dict(state, hyperparams=adam)
        if final and recipe != "bf16":   # the compute weights too, per layer
            quant = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
            params = per_layer(step.params(state), cfg)
            tree[f"model_{recipe}"] = {n: quant(w) for n, w in params.items() if w.ndim == 2 and n != "embed"}
        # what --resume checks and judges by: the recipe, and the loss the training run started from
        record = {"recipe": recipe} | ({} if first_loss is None else {"first_loss": first_loss})
        return ck.save_dcp(_fresh_dir(os.path.join(ckpt_dir, f"{recipe}-step{total}")),
                           tree | {"step": total, "demo": record})

    tokens = batch * cfg.seq
    losses, times = [], []
    bar = tqdm(range(steps), desc=f"train {recipe}", disable=not progress, dynamic_ncols=True)
    try:
        for i in bar:
            interrupt.check()   # a Ctrl-C whose raise Python dropped (in a GC callback) stops the run here
            b = data.next()
            t0 = time.perf_counter()
            state, metrics = step(state, b)
            loss = float(metrics["loss"])           # waits for the step
            times.append(time.perf_counter() - t0)
            if not math.isfinite(loss):
                raise NonFiniteError(f"the loss is {loss} at step {start + i + 1} (--lr {lr:g}); stopped without "
                                     f"saving")
            losses.append(loss)
            if resume is None and i == 0:
                first_loss = loss
            tok_s = tokens / (np.median(times[1:]) if len(times) > 1 else times[0])
            bar.set_postfix_str(f"loss {loss:.3f}  {tok_s:,.0f} tok/s")
            if save_every and (i + 1) % save_every == 0 and i + 1 < steps:
                bar.write(f"saved {save(start + i + 1, final=False)}")
    finally:
        bar.close()
    path = save(start + steps, final=True)
    step_time = float(np.median(times[1:])) if len(times) > 1 else times[0]
    peak = peak_memory_gib(mesh.devices.flat)
    memory = f"; peak device memory {peak:.2f} GiB" if peak is not None else ""
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps; step {step_time * 1e3:.1f} ms "
          f"({tokens / step_time:,.0f} tokens/s){' after the first (compile) step' if steps > 1 else ''}{memory}")
    print(f"checkpoint (parameters, Adam state, step {start + steps}): {path}\n"
          f"  inspect it:        jaxquant ckpt inspect {shlex.quote(path)}\n"
          f"  resume in JAX:     jaxquant demo --resume {shlex.quote(path)} --recipe {recipe} --steps N   "
          f"(any --mesh)\n"
          f"  load in PyTorch:   {torch_load_command(path)}")
    return {"losses": losses, "checkpoint": path, "step_time_s": step_time, "tokens_per_s": tokens / step_time,
            "gathered_bytes": sent, "gathered_bytes_bf16": sent_bf16, "peak_gib": peak, "first_loss": first_loss,
            "step": start + steps}


EXIT_STATUS = ("Exit status 0; 1 when the loss did not fall (the last step's loss is not below the first step's "
               "loss of the training run: with --resume, the first step of the run the checkpoint continues, as it "
               "records it, so a resumed run is judged as the uninterrupted one; a fresh one-step run is not "
               "judged) or when the loss or the parameters became NaN or inf (the run stops before saving them); 2 "
               "for a bad option or checkpoint to resume, found before any training; 130 / 143 when interrupted.")


def add_demo_parser(sub) -> None:
    text = "train a small transformer with NVFP4/FP8 weights from fp32 master shards"
    demo = sub.add_parser("demo", help=text, description=f"{text[0].upper()}{text[1:]}. {EXIT_STATUS}")
    demo.add_argument("--steps", type=int, default=40, help="training steps, at least 1 (default 40)")
    demo.add_argument("--recipe", choices=RECIPES, default="nvfp4",
                      help="compute weights (default nvfp4; --resume needs the checkpoint's)")
    demo.add_argument("--mesh", default=None,
                      help="FSDPxTP, e.g. 4x2 (default: all devices, tp=2 on an even number: 4x2 on 8, 3x1 on 3)")
    demo.add_argument("--batch-per-device", type=int, default=2, help="sequences per device and step (default 2)")
    demo.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate, positive (default 3e-3)")
    demo.add_argument("--ckpt-dir", default="jaxquant-demo-ckpt",
                      help="checkpoints go under this directory, made if missing (default jaxquant-demo-ckpt)")
    demo.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when running on the CPU, at least 1 (default 8; ignored if "
                           "XLA_FLAGS sets it)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--resume", default=None, metavar="DIR",
                      help="continue from a checkpoint this demo wrote (parameters, Adam state, step; any mesh; "
                           "the same --recipe)")
    demo.add_argument("--save-every", type=int, default=0, metavar="N",
                      help="also save a training checkpoint every N steps (default 0: only at the end)")
    demo.set_defaults(func=main)


def main(args) -> int:
    """0: the loss fell (or a one-step run); 1: it did not, or it became non-finite (said on stderr); 2: bad
    arguments, a checkpoint that cannot be resumed or a missing extra (see EXIT_STATUS)."""
    import sys

    try:
        out = run(steps=args.steps, recipe=args.recipe, mesh_spec=args.mesh, batch_per_device=args.batch_per_device,
                  lr=args.lr, ckpt_dir=args.ckpt_dir, seed=args.seed, progress=not args.no_progress,
                  resume=args.resume, save_every=args.save_every)
    except MissingOptaxError as e:
        print(f"jaxquant demo: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"jaxquant demo: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        if str(e).startswith("--"):
            print(f"jaxquant demo: error: {e}", file=sys.stderr)
            return 2
        raise
    first, last = out["first_loss"], out["losses"][-1]
    if first is not None and out["step"] > 1 and not last < first:
        print(f"jaxquant demo: the loss did not fall ({first:.3f} at step 1 -> {last:.3f} at step {out['step']}); "
              f"try more --steps or another --lr", file=sys.stderr)
        return 1
    return 0
