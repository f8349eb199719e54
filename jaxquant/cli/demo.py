"""``jaxquant demo``: train a small language model with NVFP4 / FP8 / bf16 weights cast from fp32 master shards.

Models (``--model``):

* ``llama`` (default): a flax NNX Llama (jaxquant/cli/llama.py: ``nnx.Embed``, RMSNorm, attention with rotary
  embeddings, SwiGLU MLP, blocks stacked by ``nnx.vmap`` and run under ``nnx.scan``, untied head) trained unchanged
  through ``jq.flax_loss`` / ``jq.flax_params`` / ``jq.flax_rules`` on an FSDP mesh (flax models do no TP
  collectives): every kernel quantized where the scan body reads it, embedding and norms kept as arrays.
* ``tp-sp``: the hand-written transformer of jaxquant/cli/tpsp.py (every matrix ``[out, in]`` through
  ``jq.dense``) on an ``(fsdp, tp)`` mesh, Megatron tensor parallel with sequence parallelism.

Data: synthetic next-token sequences (each follows a fixed random permutation of the vocabulary from a random first
token, so the loss falls from about ``ln(vocab)`` towards 0), or with ``--text PATH`` the bytes of text files
(jaxquant/training/text.py) with a held-out part whose loss is reported every ``--eval-every`` steps. Training runs
through ``jq.make_train_step`` (layer-wise FSDP). The run ends by saving a PyTorch DCP checkpoint of the training
state (one name per layer, as a PyTorch model has them) and the NVFP4/FP8 weights; ``--plot`` draws the losses.
The checks of the options and the checkpoint plumbing are in jaxquant/cli/demo_support.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import time

import numpy as np

from jaxquant.cli import errors
from jaxquant.primitives import recipes
# (re-exported: tests, benchmarks and `jaxquant bench` reach these through this module)
from jaxquant.cli.demo_support import (  # noqa: F401
    MissingExtraError, MissingOptaxError, NonFiniteError, bytes_gathered, check_plot, check_resume,
    check_writable_dir, checkpoint_model, checkpoint_recipe, fresh_dir, parse_mesh, peak_memory_gib, print_backends,
    resumed_state, run_record, torch_load_command, write_plot)
from jaxquant.cli.tpsp import (  # noqa: F401
    BLOCK_MATRICES, TP_SPLIT, ModelConfig, check_tp, init_params, loss_fn, param_specs, per_layer, quantize_mask)

RECIPES = tuple(reversed(recipes.RECIPES))   # NVFP4 first: the default
MODELS = ("llama", "tp-sp")
EVAL_BATCHES = 4       # held-out batches (of the training batch size) per evaluation


class SyntheticData:
    """Next-token data: token t+1 = perm[token t], from a random first token; one fresh batch a step
    (``skip``: the batches of steps already taken, so a resumed run sees the data it would have seen)."""

    def __init__(self, cfg, batch: int, seed: int = 0, skip: int = 0):
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


# --- the two models, behind one interface: mesh, step, parameters, compute weights, plain (evaluation) loss


class LlamaDemo:
    """The flax NNX Llama (jaxquant/cli/llama.py), FSDP only."""

    name, head = "llama", "model.head.kernel"

    def __init__(self, cfg=None, vocab: int = 64):
        try:
            from jaxquant.cli import llama
        except ImportError as e:
            if (e.name or "").split(".")[0] != "flax":
                raise
            raise MissingExtraError("the demo's default model is a flax NNX Llama, and flax is not installed (or "
                                    "train the hand-written one, --model tp-sp)") from e
        self.llama = llama
        self.cfg = cfg or llama.LlamaConfig(vocab=vocab)

    def describe(self) -> str:
        c = self.cfg
        return (f"flax NNX Llama, {c.layers} blocks under nnx.scan, dim {c.dim}, {c.heads} heads, SwiGLU {c.ffn}, "
                f"vocab {c.vocab}")

    def check_mesh(self, fsdp: int, tp: int, recipe: str) -> None:
        if tp != 1:
            raise ValueError(f"--mesh: the llama model trains with FSDP only (flax models do no TP collectives), so "
                             f"tp must be 1, got {fsdp}x{tp}; use --mesh {fsdp * tp}x1, or --model tp-sp for tensor "
                             f"parallelism")

    def mesh(self, devices, fsdp: int, tp: int):
        from jax.sharding import Mesh

        return Mesh(np.array(devices[:fsdp]), ("fsdp",))

    def _abstract(self):
        from flax import nnx

        return nnx.eval_shape(lambda: self.llama.llama(self.cfg))     # flax_loss keeps no arrays of it

    def make_step(self, optimizer, mesh, recipe: str):
        import jaxquant as jq

        return jq.make_train_step(jq.flax_loss(self._abstract(), self.llama.lm_loss), optimizer, mesh=mesh,
                                  rules=self.llama.rules(), policy=jq.MixedPrecisionPolicy(compute_weights=recipe))

    def init_params(self, seed: int):
        import jaxquant as jq

        return jq.flax_params(self.llama.llama(self.cfg, seed))

    def compute_weights(self, params) -> dict:
        """Every kernel as PyTorch holds it, ``[out, in]``, named as the checkpoint names it (one per layer)."""
        import jax

        from jaxquant.training.rules import dotted_path

        out = {}
        for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
            name = dotted_path(path)
            if name.endswith("kernel"):
                if name.startswith("layers."):
                    out |= {f"layers.{i}.{name[len('layers.'):]}": a[i].T for i in range(self.cfg.layers)}
                else:
                    out[name] = a.T
        return out

    def plain_loss(self):
        """loss(params, batch) of the model at plain fp32 parameters (bf16 compute, no quantization)."""
        import jaxquant as jq

        return jq.flax_loss(self._abstract(), self.llama.lm_loss)


class TpSpDemo:
    """The hand-written TP + SP transformer (jaxquant/cli/tpsp.py) on an (fsdp, tp) mesh."""

    name, head = "tp-sp", "model.head"

    def __init__(self, cfg=None, vocab: int = 64):
        self.cfg = cfg or ModelConfig(vocab=vocab)

    def describe(self) -> str:
        return f"{self.cfg.layers} blocks under scan, d_model {self.cfg.d_model}, vocab {self.cfg.vocab}"

    def check_mesh(self, fsdp: int, tp: int, recipe: str) -> None:
        check_tp(self.cfg, tp, recipe)

    def mesh(self, devices, fsdp: int, tp: int):
        from jax.sharding import Mesh

        return Mesh(np.array(devices[:fsdp * tp]).reshape(fsdp, tp), ("fsdp", "tp"))

    def make_step(self, optimizer, mesh, recipe: str):
        import jaxquant as jq

        tp = mesh.shape["tp"]
        return jq.make_train_step(loss_fn(self.cfg, "tp", tp), optimizer, mesh=mesh, tp_axis="tp",
                                  param_specs=param_specs(self.cfg), quantize_mask=quantize_mask(self.cfg),
                                  policy=jq.MixedPrecisionPolicy(compute_weights=recipe))

    def init_params(self, seed: int):
        import jax

        return init_params(jax.random.key(seed), self.cfg)

    def compute_weights(self, params) -> dict:
        return {n: w for n, w in per_layer(params, self.cfg).items() if w.ndim == 2 and n != "embed"}

    def plain_loss(self):
        return loss_fn(self.cfg)


def resume_command(path: str, recipe: str, model: str, text: str | None) -> str:
    """The command that continues checkpoint ``path`` of a run with these options."""
    again = (f" --model {model}" if model != "llama" else "") + (f" --text {shlex.quote(text)}" if text else "")
    return f"jaxquant demo --resume {shlex.quote(path)} --recipe {recipe}{again} --steps N"


def _interrupted_line(e, saved: list, args) -> str:
    """The one line of an interrupted run: the last complete checkpoint (the one to resume from), if any. A save
    that the signal cut short left nothing (its staging directory is removed), so it is never the one named."""
    if saved:
        where = (f"the last complete checkpoint is {saved[-1]}; continue with "
                 f"{resume_command(saved[-1], args.recipe, args.model, args.text)}")
    elif args.resume is not None:
        where = f"no checkpoint saved by this run; {args.resume}, which it resumed, is the last complete one"
    else:
        where = "no checkpoint saved"
    return f"{PROG}: interrupted by {e.signame}; {where}"


def _all_finite(tree) -> bool:
    import jax
    import jax.numpy as jnp

    return all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(tree))


def _check_counts(steps, recipe, model, batch_per_device, lr, save_every, text, eval_every) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"--recipe: must be nvfp4, fp8 or bf16, got {recipe!r}")
    if model not in MODELS:
        raise ValueError(f"--model: must be llama or tp-sp, got {model!r}")
    if steps < 1:
        raise ValueError(f"--steps: must be at least 1, got {steps}")
    if batch_per_device < 1:
        raise ValueError(f"--batch-per-device: must be at least 1, got {batch_per_device}")
    if save_every < 0:
        raise ValueError(f"--save-every: must be 0 (off) or positive, got {save_every}")
    if not 0 < lr <= float(np.finfo(np.float32).max):   # (the step computes in float32: a larger one is inf)
        raise ValueError(f"--lr: must be a positive finite float32 number, got {lr}")
    if eval_every is not None:
        if text is None:
            raise ValueError("--eval-every: needs --text (the held-out loss is that of the text's held-out part)")
        if eval_every < 1:
            raise ValueError(f"--eval-every: must be at least 1, got {eval_every}")


def run(steps: int = 40, recipe: str = "nvfp4", mesh_spec: str | None = None, batch_per_device: int = 2,
        lr: float = 3e-3, ckpt_dir: str = "jaxquant-demo-ckpt", seed: int = 0, progress: bool = True,
        cfg=None, resume: str | None = None, save_every: int = 0, model: str = "llama", text: str | None = None,
        eval_every: int | None = None, plot: str | None = None, saved: list | None = None):
    """Train and checkpoint; returns a dict with the losses (``losses``: training, one a step; ``heldout``:
    ``[(step, loss)]`` with ``text``), the checkpoint path and the throughput, and ``first_loss`` (the loss of the
    training run's first step: this run's, or for ``resume`` the one the checkpoint records; None where it does
    not) and ``step`` (the steps taken in all). ``cfg``: the model's config (``llama.LlamaConfig`` /
    ``tpsp.ModelConfig``; None: its default, vocabulary 256 with ``text``).

    Every argument, the data and the checkpoint to resume are checked before any training (``ValueError`` starting
    with the option's name; ``errors.OperationError`` for a checkpoint to resume that cannot be read); a NaN or
    ±inf loss or parameter stops the run before it is saved (``NonFiniteError``). ``saved``: a list the path of
    each checkpoint is appended to once it is complete (what an interrupted run can be resumed from)."""
    _check_counts(steps, recipe, model, batch_per_device, lr, save_every, text, eval_every)   # (before jax loads)
    if plot is not None:
        check_plot(plot)
    import jax
    try:
        import optax
    except ImportError as e:
        raise MissingOptaxError() from e
    from tqdm.auto import tqdm

    import jaxquant as jq
    from jaxquant import checkpoint as ck
    from jaxquant.checkpoint import interrupt
    from jaxquant.training import text as textdata

    vocab = textdata.VOCAB if text is not None else 64
    net = (LlamaDemo if model == "llama" else TpSpDemo)(cfg, vocab=vocab)
    if text is not None and net.cfg.vocab < textdata.VOCAB:
        raise ValueError(f"--text: byte tokens need a vocabulary of {textdata.VOCAB}, the model has {net.cfg.vocab}")
    devices = jax.devices()
    fsdp, tp = parse_mesh(mesh_spec, len(devices), default_tp=2 if model == "tp-sp" else 1)
    net.check_mesh(fsdp, tp, recipe)
    data_kind = "synthetic" if text is None else "text"
    corpus = textdata.TextData(text, seq=net.cfg.seq, seed=seed) if text is not None else None
    if corpus is not None and eval_every is None:
        eval_every = max(1, steps // 10)
    first_loss = check_resume(resume, recipe, model, data_kind) if resume is not None else None
    check_writable_dir(ckpt_dir, "--ckpt-dir", create=True)

    print_backends()
    mesh = net.mesh(devices, fsdp, tp)
    batch = batch_per_device * fsdp * tp        # the TP ranks of one FSDP rank share its rows
    step = net.make_step(optax.adam(lr), mesh, recipe)
    state = step.init(net.init_params(seed))
    adam = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)     # optax.adam's, as torch names them
    if resume is not None:   # any mesh size: the checkpoint is read into this mesh's shards
        state = resumed_state(step, state, resume)
        print(f"resumed from {resume} at step {int(state.step)}")
    start = int(state.step)
    sent, sent_bf16 = bytes_gathered(state.plan, recipe)
    n_params = sum(math.prod(shape) for shape in state.plan.shapes)
    print(f"model: {net.describe()}, {n_params:,} parameters; mesh fsdp={fsdp} x tp={tp} on {devices[0].platform}; "
          f"weights {recipe}, layer-wise FSDP; batch {batch} x {net.cfg.seq} tokens")
    from jaxquant.training.plan_view import plan_summary

    print(plan_summary(step.describe(state, file=False)) + " (the table: step.describe(state))")
    if sent_bf16:
        gathered = f"{sent / 1024:.0f} KiB/step per device ({sent / sent_bf16:.2f}x bf16)"
        print(f"weights all-gathered per step (each layer where it is used): {gathered}")
    else:   # fsdp = 1, or no weight's rows split evenly over fsdp (e.g. 3): every rank holds its weights whole
        split = "" if fsdp == 1 else " splits no weight evenly"
        print(f"weights all-gathered per step: none (fsdp={fsdp}{split}: each device holds its weights whole)")

    procs = (jax.process_index(), jax.process_count())
    if corpus is None:
        synthetic = SyntheticData(net.cfg, batch, seed, skip=start)
        next_batch = lambda n: synthetic.next()
    else:
        print(f"data: {corpus.describe()}; held-out loss every {eval_every} steps")
        if corpus.describe_skipped():
            print(f"data: {corpus.describe_skipped()}")
        next_batch = lambda n: {"tokens": textdata.on_mesh(corpus.batch(n, batch, *procs), mesh)}
        heldout = [{"tokens": textdata.on_mesh(b, mesh)} for b in corpus.heldout_batches(batch, EVAL_BATCHES, *procs)]
        plain = jax.jit(net.plain_loss())

    def evaluate():   # the model at its fp32 master weights, bf16 compute: the same measure for every recipe
        params = step.params(state)
        return float(np.mean([float(plain(params, b)) for b in heldout]))

    def save(total, final):
        if not _all_finite(state.master):
            raise NonFiniteError(f"the parameters hold NaN or inf after step {total} (--lr {lr:g}); stopped "
                                 f"without saving them")
        tree = step.state_dict(state, hyperparams=adam)
        if final and recipe != "bf16":   # the compute weights too, per layer
            quant = jq.quantize_nvfp4 if recipe == "nvfp4" else jq.quantize_fp8
            tree[f"model_{recipe}"] = {n: quant(w) for n, w in net.compute_weights(step.params(state)).items()}
        record = run_record(recipe, model, data_kind, first_loss)
        path = ck.save_dcp(fresh_dir(os.path.join(ckpt_dir, f"{recipe}-step{total}")),
                           tree | {"step": total, "demo": record})
        if saved is not None:
            saved.append(path)
        return path

    tokens = batch * net.cfg.seq
    losses, times, evals = [], [], []
    # drawn only on a terminal: elsewhere (a log, a pipe) each redraw around bar.write is a line of its own
    bar = tqdm(range(steps), desc=f"train {recipe}", disable=None if progress else True, dynamic_ncols=True)

    def report_heldout(total):
        evals.append((total, evaluate()))
        bar.write(f"step {total}: held-out loss {evals[-1][1]:.3f}")

    try:
        if corpus is not None:
            report_heldout(start)
        for i in bar:
            interrupt.check()   # a Ctrl-C whose raise Python dropped (in a GC callback) stops the run here
            b = next_batch(start + i)
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
            held = f"  held-out {evals[-1][1]:.3f}" if evals else ""
            bar.set_postfix_str(f"loss {loss:.3f}{held}  {tok_s:,.0f} tok/s")
            if corpus is not None and ((i + 1) % eval_every == 0 or i + 1 == steps):
                report_heldout(start + i + 1)
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
    if evals:
        print(f"held-out loss {evals[0][1]:.3f} at step {evals[0][0]} -> {evals[-1][1]:.3f} at step {evals[-1][0]}")
    if plot is not None:
        curves = [("training loss", np.arange(start + 1, start + steps + 1), losses, "-")]
        curves += [("held-out loss", [s for s, _ in evals], [v for _, v in evals], "o-")] if evals else []
        where = f"--text {os.path.basename(os.path.normpath(text))}" if text is not None else "synthetic data"
        print(f"plot: {write_plot(plot, curves, xlabel='step', title=f'jaxquant demo: {net.name}, {recipe}, {where}')}")
    print(f"checkpoint (parameters, Adam state, step {start + steps}): {path}\n"
          f"  inspect it:        jaxquant ckpt inspect {shlex.quote(path)}\n"
          f"  resume in JAX:     {resume_command(path, recipe, model, text)}   (any --mesh)\n"
          f"  load in PyTorch:   {torch_load_command(path, net.head)}")
    return {"losses": losses, "heldout": evals, "checkpoint": path, "step_time_s": step_time,
            "tokens_per_s": tokens / step_time, "gathered_bytes": sent, "gathered_bytes_bf16": sent_bf16,
            "peak_gib": peak, "first_loss": first_loss, "step": start + steps, "model": dataclasses.asdict(net.cfg)}


PROG = "jaxquant demo"
EXIT_STATUS = ("Exit status 0; 1 when the loss did not fall (the last step's loss is not below the first step's "
               "loss of the training run: with --resume, the first step of the run the checkpoint continues, as it "
               "records it, so a resumed run is judged as the uninterrupted one; a fresh one-step run is not "
               "judged), when the loss or the parameters became NaN or inf (the run stops before saving them) or "
               "when the checkpoint to resume cannot be read (damaged); 2 for bad usage: a bad option, text path, "
               "checkpoint to resume (missing, of another recipe, model or data) or destination, found before any "
               "training; 130 / 143 when interrupted (the line names the last complete checkpoint).")


def add_demo_parser(sub) -> None:
    text = "train a small flax NNX Llama with NVFP4/FP8 weights from fp32 master shards"
    demo = sub.add_parser("demo", help=text, description=f"{text[0].upper()}{text[1:]}. {EXIT_STATUS}",
                          epilog=errors.EXIT_STATUS)
    demo.add_argument("--model", choices=MODELS, default="llama",
                      help="llama: a flax NNX Llama on an FSDP mesh; tp-sp: a hand-written transformer with tensor "
                           "and sequence parallelism (default llama; --resume needs the checkpoint's)")
    demo.add_argument("--steps", type=int, default=40, help="training steps, at least 1 (default 40)")
    demo.add_argument("--recipe", choices=RECIPES, default="nvfp4",
                      help="compute weights (default nvfp4; --resume needs the checkpoint's)")
    demo.add_argument("--mesh", default=None,
                      help="FSDPxTP, e.g. 8x1 (default: all devices; llama: FSDP only, 8x1 on 8; tp-sp: tp=2 on an "
                           "even number, 4x2 on 8, 3x1 on 3)")
    demo.add_argument("--batch-per-device", type=int, default=2, help="sequences per device and step (default 2)")
    demo.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate, positive (default 3e-3)")
    demo.add_argument("--text", default=None, metavar="PATH",
                      help="train on the bytes of a text file or of the text files under a directory (read "
                           "recursively; vocabulary 256) instead of synthetic data, with a held-out part (default: "
                           "synthetic data)")
    demo.add_argument("--eval-every", type=int, default=None, metavar="N",
                      help="with --text: the held-out loss every N steps, at least 1 (default: steps/10, at least "
                           "1; also before the first step and after the last)")
    demo.add_argument("--plot", default=None, metavar="PATH",
                      help="write the loss curves (training, and held-out with --text) to this .png file, in a "
                           "directory that exists; needs matplotlib (default: no plot)")
    demo.add_argument("--ckpt-dir", default="jaxquant-demo-ckpt",
                      help="checkpoints go under this directory, made if missing (its parent must exist; default "
                           "jaxquant-demo-ckpt)")
    demo.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when running on the CPU, at least 1 (default 8; ignored if "
                           "XLA_FLAGS sets it)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data (default 0)")
    demo.add_argument("--no-progress", action="store_true",
                      help="no progress bar (it is drawn on stderr only when stderr is a terminal)")
    demo.add_argument("--resume", default=None, metavar="DIR",
                      help="continue from a checkpoint this demo wrote (parameters, Adam state, step; any mesh; "
                           "the same --recipe, --model and data)")
    demo.add_argument("--save-every", type=int, default=0, metavar="N",
                      help="also save a training checkpoint every N steps (default 0: only at the end)")
    demo.set_defaults(func=main, parser=demo)


def main(args) -> int:
    """0: the loss fell (or a one-step run); 1: it did not, it became non-finite, or the checkpoint to resume
    cannot be read; 2: bad usage (see EXIT_STATUS). Each error is one line on stderr."""
    import signal

    from jaxquant.cli.signals import Interrupted, report

    saved = []
    try:
        out = run(steps=args.steps, recipe=args.recipe, mesh_spec=args.mesh, batch_per_device=args.batch_per_device,
                  lr=args.lr, ckpt_dir=args.ckpt_dir, seed=args.seed, progress=not args.no_progress,
                  resume=args.resume, save_every=args.save_every, model=args.model, text=args.text,
                  eval_every=args.eval_every, plot=args.plot, saved=saved)
    except KeyboardInterrupt as e:   # Interrupted; or Python's own, from code that took SIGINT itself
        e = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        return report(_interrupted_line(e, saved, args), e)
    except MissingExtraError as e:
        return errors.refuse(PROG, str(e))
    except (NonFiniteError, errors.OperationError) as e:
        return errors.fail(PROG, str(e))
    except ValueError as e:
        if str(e).startswith("--"):
            return errors.refuse(PROG, str(e))
        raise
    first, last = out["first_loss"], out["losses"][-1]
    if first is not None and out["step"] > 1 and not last < first:
        return errors.fail(PROG, f"the loss did not fall ({first:.3f} at step 1 -> {last:.3f} at step "
                                 f"{out['step']}); try more --steps or another --lr")
    return 0
