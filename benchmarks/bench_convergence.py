"""Convergence of the flax NNX Llama (jaxquant/cli/llama.py) trained four ways from the same seed on the same bytes:
does training with FP8 / NVFP4 weights reach the held-out loss of bf16 training?

Configurations (``--configs``, all four by default, run one after another in this process):

* ``plain-bf16``: the model trained without jaxquant: ``jax.jit`` of a step over ``nnx.split``'s parameters,
  kernels and embedding split by rows over an ``fsdp`` mesh of every device (``NamedSharding``; XLA inserts the
  gathers and reduce-scatters), optax; fp32 parameters, bf16 compute (the model's ``dtype``);
* ``jq-bf16`` / ``jq-fp8`` / ``jq-nvfp4``: the same model unchanged under ``jq.make_train_step(jq.flax_loss(model,
  lm_loss), rules=jq.flax_rules(stacked=...))`` (layer-wise FSDP over the same mesh), compute weights bf16 / FP8 /
  NVFP4 cast from the fp32 master each step.

Every configuration starts from the same parameters (``--seed``), reads the same batches in the same order (random
windows of ``--seq + 1`` bytes of the training part, jaxquant/training/text.py) and uses the same optimizer (AdamW,
linear warm-up then cosine decay, global-norm clipping at 1). The held-out loss is measured the same way for all:
the model at the step's fp32 parameters, bf16 compute, on fixed held-out windows (whole files the training never
reads), every ``--eval-every`` steps and after the last. Data: the bytes of the Python standard library's ``.py``
sources (no download), or ``--text PATH``.

Writes to ``--out DIR``: ``results.json`` (every curve and the summary), ``results.md`` (the table: final held-out
loss and its gap to plain-bf16, final training loss, tokens/s, steps, tokens) and ``heldout.png`` (held-out loss
against tokens, one curve per configuration), ``train.png`` (training loss, smoothed).

    python benchmarks/bench_convergence.py --out results/convergence          # GPU: the ~85M-parameter "base" size
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_convergence.py --size smoke --steps 4

``--size auto`` (the default) is ``base`` on GPU and ``smoke`` elsewhere. Docs: docs/convergence.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "benchmarks")):     # jaxquant from this checkout; bench_e2e's helpers
    if _path not in sys.path:
        sys.path.insert(0, _path)
import bench_e2e as e2e  # noqa: E402

CONFIGS = ("plain-bf16", "jq-bf16", "jq-fp8", "jq-nvfp4")
# "-bf16head": the output head kept in bf16 (flax_rules(recipes=...)), every other kernel in the recipe: what the
# head's quantization costs (the NVFP4 pretraining recipe keeps the last layers in higher precision)
EXTRA_CONFIGS = ("jq-fp8-bf16head", "jq-nvfp4-bf16head")
# model sizes (vocab 256: byte tokens) and the run each size defaults to
SIZES = {
    "smoke": dict(model=dict(dim=64, heads=4, ffn=128, layers=2), seq=64, steps=20, batch=16, eval_every=5,
                  eval_batches=2, lr=3e-3),
    "base": dict(model=dict(dim=768, heads=12, ffn=2048, layers=12), seq=512, steps=1500, batch=32,
                 eval_every=100, eval_batches=8, lr=1e-3),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_convergence.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("auto",) + tuple(SIZES), default="auto",
                   help="model and run size: smoke (CPU, seconds), base (~85M parameters, GPU); default auto: base on "
                        "GPU, smoke elsewhere")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {','.join(CONFIGS + EXTRA_CONFIGS)}")
    p.add_argument("--steps", type=int, default=None, help="training steps of each configuration (default: the size's)")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch in sequences, a multiple of the device count (default: the size's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length in bytes (default: the size's)")
    p.add_argument("--eval-every", type=int, default=None, help="held-out loss every N steps (default: the size's)")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="held-out batches (of --batch windows) per evaluation (default: the size's)")
    p.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default: the size's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the parameters and of the data order (default 0)")
    p.add_argument("--text", default=None, metavar="PATH",
                   help="a text file or directory of text files (default: the Python standard library's .py files)")
    p.add_argument("--out", default="convergence-results", metavar="DIR",
                   help="results.json, results.md, heldout.png and train.png go here (default convergence-results)")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="no training: the table and plots of the configurations in these results.json files (runs of "
                        "the same settings, e.g. configurations run on separate GPUs at once), written to --out")
    return p.parse_args(argv)


def merge(a) -> int:
    """``--merge``: one table and one plot of several runs' results (the same settings, checked)."""
    runs = []
    for path in a.merge:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"bench_convergence.py: error: --merge: cannot read {path}: {e}", file=sys.stderr)
            return 2
    keys = ("size", "steps", "batch", "seq", "eval_every", "eval_batches", "lr", "seed", "text")
    first = runs[0]["settings"]
    for path, run in zip(a.merge, runs):
        differ = [k for k in keys if run["settings"].get(k) != first.get(k)]
        if differ:
            print(f"bench_convergence.py: error: --merge: {path} was run with other settings ({', '.join(differ)})",
                  file=sys.stderr)
            return 2
    settings = argparse.Namespace(**{**first, "out": a.out})
    results = [r for run in runs for r in run["results"]]
    order = {c: i for i, c in enumerate(CONFIGS + EXTRA_CONFIGS)}
    results.sort(key=lambda r: order[r["config"]])
    md = write_outputs(settings, results, runs[0]["header"])
    print(md, flush=True)
    return 0


def resolve(a):
    """The run's settings from the options and the size's defaults, checked before any work (``ValueError``
    naming the option)."""
    import jax

    if a.size == "auto":
        a.size = "base" if jax.default_backend() == "gpu" else "smoke"
    size = SIZES[a.size]
    for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "lr"):
        if getattr(a, name) is None:
            setattr(a, name, size[name])
    for name in ("steps", "batch", "seq", "eval_every", "eval_batches"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(a, name)}")
    if not 0 < a.lr < math.inf:
        raise ValueError(f"--lr: must be a positive finite number, got {a.lr}")
    devices = len(jax.devices())
    if a.batch % devices:
        raise ValueError(f"--batch: {a.batch} sequences do not split over the {devices} devices (fsdp)")
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs if c not in CONFIGS + EXTRA_CONFIGS]
    if bad or not a.configs:
        raise ValueError(f"--configs: must be a comma-separated subset of {','.join(CONFIGS + EXTRA_CONFIGS)}, got "
                         f"{bad or 'none'}")
    from jaxquant.cli.demo_support import check_writable_dir, require_matplotlib

    check_writable_dir(a.out, "--out", create=True)
    require_matplotlib("--out")     # the plots it draws at the end: matplotlib is there, before any training
    return a


# ----------------------------------------------------------------------------------------------
# The optimizer, the two kinds of step and the evaluation (the same for every configuration)
# ----------------------------------------------------------------------------------------------


def _name(path) -> str:
    """Dotted name of a parameter path (a pure dict's or an nnx.State's, whose leaves add ``.value``)."""
    import jax

    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
    return ".".join(str(k) for k in keys)


def optimizer(a):
    """AdamW (b2 0.95, weight decay 0.1 on the kernels and the embedding), linear warm-up over the first 5% of the
    steps then cosine decay to a tenth, gradients clipped to global norm 1."""
    import jax
    import optax

    warmup = max(1, a.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, warmup, max(a.steps, warmup + 1), a.lr / 10)
    decay = lambda params: jax.tree_util.tree_map_with_path(
        lambda p, _: _name(p).endswith(("kernel", "embedding")), params)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay))


class Evaluator:
    """The held-out loss of a parameter dict (``jq.flax_params``' layout) or ``nnx.State``: the plain flax model
    (no jaxquant) at those fp32 parameters, bf16 compute, mean over the held-out batches."""

    def __init__(self, cfg, seed, batches, mesh):
        import jax
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec as P

        from jaxquant.cli import llama as L

        self.abstract = nnx.eval_shape(lambda: L.llama(cfg, seed))
        self.graphdef, _, self.rest = nnx.split(self.abstract, nnx.Param, ...)
        self.batches = batches
        self.replicated = NamedSharding(mesh, P())     # every configuration's parameters evaluated alike
        self.loss = jax.jit(lambda p, rest, b: L.lm_loss(nnx.merge(self.graphdef, p, rest), b))

    def state_of(self, params: dict):
        from flax import nnx

        state = nnx.split(self.abstract, nnx.Param, ...)[1]
        nnx.replace_by_pure_dict(state, params)
        return state

    def __call__(self, state) -> float:
        import jax

        state = jax.device_put(state, self.replicated)
        return float(sum(float(self.loss(state, self.rest, b)) for b in self.batches) / len(self.batches))


def plain_train(a, cfg, mesh, opt, evaluator):
    """(train, state) of the model trained with plain jax.jit + NamedSharding: ``train(state, batch) -> (state,
    loss)``, ``state`` = (parameters, optimizer state), Adam's moments sharded like their parameters (bench_e2e's
    ``plain_opt_state``: a fair baseline keeps no replicated copy of them)."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxquant.cli import llama as L

    fsdp = mesh.shape["fsdp"]
    graphdef, rest = evaluator.graphdef, evaluator.rest
    shapes = nnx.split(evaluator.abstract, nnx.Param, ...)[1]

    def spec(path, x):   # kernels [(L,) in, out] and the embedding [vocab, dim] split by rows; norms replicated
        if _name(path).endswith(("kernel", "embedding")) and x.shape[-2] % fsdp == 0:
            return NamedSharding(mesh, P(*(None,) * (x.ndim - 2), "fsdp", None))
        return NamedSharding(mesh, P())

    shardings = jax.tree_util.tree_map_with_path(spec, shapes)
    params = jax.jit(lambda: nnx.split(L.llama(cfg, a.seed), nnx.Param, ...)[1], out_shardings=shardings)()
    opt_state, opt_shardings = e2e.plain_opt_state(opt, params, shardings, mesh)

    def train(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: L.lm_loss(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    out = e2e.plain_step_shardings(mesh, shardings, opt_shardings)
    return jax.jit(train, donate_argnums=0, out_shardings=out), (params, opt_state)


def plain_runner(a, cfg, mesh, opt, evaluator):
    """(step(batch) -> loss, heldout() -> loss) of ``plain_train``'s model."""
    train, state = plain_train(a, cfg, mesh, opt, evaluator)
    box = {"state": state}

    def step(batch):
        box["state"], loss = train(box["state"], batch)
        return loss

    return step, lambda: evaluator(box["state"][0])


def jq_runner(a, cfg, mesh, opt, evaluator, recipe, bf16_head=False):
    """The same for the model under jq.make_train_step with ``recipe`` compute weights (the head's bf16 with
    ``bf16_head``)."""
    import jaxquant as jq
    from jaxquant.cli import llama as L

    rules = jq.flax_rules(stacked=L.STACKED, recipes={r"head\.kernel": "bf16"}) if bf16_head else L.rules()
    train = jq.make_train_step(jq.flax_loss(evaluator.abstract, L.lm_loss), opt, mesh=mesh, rules=rules,
                               policy=jq.MixedPrecisionPolicy(compute_weights=recipe))
    box = {"state": train.init(jq.flax_params(L.llama(cfg, a.seed)))}

    def step(batch):
        box["state"], metrics = train(box["state"], batch)
        return metrics["loss"]

    return step, lambda: evaluator(evaluator.state_of(train.params(box["state"])))


# ----------------------------------------------------------------------------------------------
# One configuration
# ----------------------------------------------------------------------------------------------


def run_config(a, config, cfg, data, mesh, evaluator):
    """Train ``config`` for ``a.steps`` steps; its curves (held-out and training loss against tokens) and speed."""
    import numpy as np

    from jaxquant.training import text as textdata

    opt = optimizer(a)
    t_build = time.perf_counter()
    if config == "plain-bf16":
        step, heldout = plain_runner(a, cfg, mesh, opt, evaluator)
    else:
        step, heldout = jq_runner(a, cfg, mesh, opt, evaluator, config.split("-")[1], config.endswith("-bf16head"))
    tokens_per_step = a.batch * a.seq
    curve = [(0, heldout())]
    train, times = [], []
    print(f"[{config}] step 0/{a.steps}: held-out loss {curve[0][1]:.4f}", flush=True)
    for i in range(a.steps):
        batch = {"tokens": textdata.on_mesh(data.global_batch(i, a.batch), mesh)}
        t0 = time.perf_counter()
        loss = float(step(batch))           # waits for the step
        times.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            raise ArithmeticError(f"{config}: the training loss is {loss} at step {i + 1}")
        train.append(loss)
        if (i + 1) % a.eval_every == 0 or i + 1 == a.steps:
            curve.append(((i + 1) * tokens_per_step, heldout()))
            speed = tokens_per_step / float(np.median(times[1:] or times))
            print(f"[{config}] step {i + 1}/{a.steps} ({(i + 1) * tokens_per_step / 1e6:.2f}M tokens): training loss "
                  f"{np.mean(train[-a.eval_every:]):.4f}, held-out {curve[-1][1]:.4f}; {speed:,.0f} tokens/s",
                  flush=True)
    step_s = float(np.median(times[1:] or times))
    last = max(1, min(len(train), a.eval_every))
    return {"config": config, "heldout": curve, "train": train, "final_heldout": curve[-1][1],
            "final_train": float(np.mean(train[-last:])), "steps": a.steps, "tokens": a.steps * tokens_per_step,
            "tokens_per_s": tokens_per_step / step_s, "step_ms": step_s * 1e3, "first_step_s": times[0],
            "wall_s": time.perf_counter() - t_build}


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def table(results, header) -> str:
    base = next((r["final_heldout"] for r in results if r["config"] == "plain-bf16"), None)
    gap = lambda r: "-" if base is None else f"{r['final_heldout'] - base:+.4f}"
    lines = [header, "",
             "| config | final held-out loss | vs plain-bf16 | final training loss | tokens/s | step ms | steps | "
             "tokens |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['config']} | {r['final_heldout']:.4f} | {gap(r)} | {r['final_train']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {r['steps']} | {r['tokens']:,} |")
    return "\n".join(lines) + "\n"


def write_outputs(a, results, header):
    import numpy as np

    from jaxquant.cli.demo_support import write_plot

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"header": header, "settings": {k: v for k, v in vars(a).items()}, "results": results}, f, indent=1)
    md = table(results, header)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    style = {"plain-bf16": "k-", "jq-bf16": "b--", "jq-fp8": "g-", "jq-nvfp4": "r-", "jq-fp8-bf16head": "g:",
             "jq-nvfp4-bf16head": "r:"}
    held = [(r["config"], [t / 1e6 for t, _ in r["heldout"]], [v for _, v in r["heldout"]], style[r["config"]] + "o")
            for r in results]
    # the curves fall together from ~6 nats: a second panel over the last two thirds shows where they part
    write_plot(os.path.join(a.out, "heldout.png"), held, xlabel="tokens (millions)", ylabel="held-out loss (nats/byte)",
               title=header, zoom_from=a.steps * a.batch * a.seq / 3e6)
    window = max(1, min(a.eval_every, a.steps // 10 or 1))     # a running mean: the per-step loss is noisy
    smooth = lambda x: np.convolve(x, np.ones(window) / window, mode="valid")
    trains = [(r["config"], (np.arange(window, len(r["train"]) + 1) * a.batch * a.seq) / 1e6, smooth(r["train"]),
               style[r["config"]]) for r in results]
    write_plot(os.path.join(a.out, "train.png"), trains, xlabel="tokens (millions)",
               ylabel=f"training loss (mean of {window} steps)", title=header)
    return md


def main(argv=None) -> int:
    import jax

    a = parse_args(argv)
    if a.merge:
        return merge(a)
    try:
        a = resolve(a)
        from jaxquant.training.text import TextData

        data = TextData(a.text, seq=a.seq, seed=a.seed)
    except ValueError as e:
        print(f"bench_convergence.py: error: {e}", file=sys.stderr)
        return 2
    import numpy as np
    from jax.sharding import Mesh

    from jaxquant.cli import llama as L
    from jaxquant.training import text as textdata

    cfg = L.LlamaConfig(vocab=textdata.VOCAB, seq=a.seq, **SIZES[a.size]["model"])
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("fsdp",))
    header = (f"flax NNX Llama {cfg.num_params() / 1e6:.1f}M parameters ({cfg.layers} layers, dim {cfg.dim}, "
              f"{cfg.heads} heads, ffn {cfg.ffn}), {len(devices)} x {devices[0].device_kind}, batch {a.batch} x "
              f"{a.seq} bytes, {a.steps} steps, lr {a.lr:g}, seed {a.seed}")
    print(header, flush=True)
    print(f"data: {data.describe()}", flush=True)
    evaluator = Evaluator(cfg, a.seed, [{"tokens": textdata.on_mesh(b, mesh)}
                                        for b in data.heldout_batches(a.batch, a.eval_batches)], mesh)
    results, start = [], time.perf_counter()
    for config in a.configs:
        results.append(run_config(a, config, cfg, data, mesh, evaluator))
        r = results[-1]
        left = len(a.configs) - len(results)
        more = f"; about {left * r['wall_s']:.0f} s more for the {left} left" if left else ""
        print(f"[{config}] done in {r['wall_s']:.0f} s: held-out {r['final_heldout']:.4f}, "
              f"{r['tokens_per_s']:,.0f} tokens/s; {time.perf_counter() - start:.0f} s in all{more}", flush=True)
        gc.collect()          # the configuration's state and executables go before the next one's
        md = write_outputs(a, results, header)     # after each: a run cut short keeps what it measured
    print("\n" + md, flush=True)
    names = ("results.json", "results.md", "heldout.png", "train.png")
    print(f"wrote {', '.join(os.path.join(a.out, n) for n in names)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

