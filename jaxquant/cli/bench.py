"""``jaxquant bench``: the single-tensor quantizers against the memory floor and against XLA.

For each (op, shape, input dtype) it times the custom calls (``impl="custom_call"``) and the
XLA-fused pure-JAX reference (``impl="reference"``), both jitted, with the default bf16 compute
dtype. The floor is the fewest bytes the op must move -- two reads of x (the statistics pass and
the cast pass) plus every output written once -- divided by the copy bandwidth of a jitted ``x + 1``
over an fp32 array of the same element count, measured in the same run. Each time is the median
of ``--repeats`` batches of ``--iters`` asynchronous dispatches after a warm-up. Rows whose time is
near the printed host cost of one dispatch are dispatch-bound, so on a GPU the table also gives
each op's kernel time per call from a profiler trace, against the floor at the copy kernel's
bandwidth (``--device-time``).

Then the master-weight step (``quantize_master_weights`` over every visible device as the fsdp
axis) on the linear weights of one Llama-3-8B layer, NVFP4 and FP8, each rowwise and with the
columnwise copy, against the plain-JAX ``all_gather(shard.astype(bf16))`` it replaces (× bf16
gather), timed the same way (``--no-group`` skips it; ``benchmarks/bench_distributed.py`` has the
profile and the 300-tensor group).

On a GPU the defaults are sizes 8192² and 16384², 5 x 20 dispatches. On any other backend they are a
smoke run that checks that everything runs and the JSON has its fields: 128x256, 3 x 3 dispatches, the
layer's dims / 32 (small enough for a CPU to run in seconds). The GPU sizes on the CPU take minutes and GBs.
The JSON is written only with --json PATH. The options are checked before anything is timed: a bad one
is one line on stderr and exit status 2 (the error convention below).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import fnmatch
import glob
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPU_SIZES = "8192x8192,16384x16384"
CPU_SIZES = "128x256"
GPU_ITERS, GPU_REPEATS = 20, 5
CPU_ITERS, CPU_REPEATS = 3, 3  # elsewhere than on a GPU (a smoke run)
# JSON fields of every row (checked by the CPU smoke test).
ROW_FIELDS = ("op", "shape", "dtype", "us", "floor_us", "x_floor", "xla_us", "x_xla", "bytes")
# JSON fields of every master-weight step row ("group_step")
STEP_FIELDS = ("op", "devices", "params", "us", "bf16_gather_us", "x_bf16_gather", "gathered_mb")
# The linear weights of one Llama-3-8B layer (PyTorch [out, in]; 218M parameters): q, k, v, o, gate,
# up, down projections.
LLAMA3_8B_LAYER = (("q_proj", (4096, 4096)), ("k_proj", (1024, 4096)), ("v_proj", (1024, 4096)),
                   ("o_proj", (4096, 4096)), ("gate_proj", (14336, 4096)), ("up_proj", (14336, 4096)),
                   ("down_proj", (4096, 14336)))
# with --device-time (default on a GPU) also: kernel time of the custom calls and of the XLA reference
# per call, and their ratios to the floor at the copy kernel's bandwidth (None on the CPU)
DEVICE_FIELDS = ("dev_us", "dev_floor_us", "dev_x_floor", "xla_dev_us", "dev_x_xla")
# The ops --ops selects from: the single-tensor quantizers, each pass on its own (--stages) and the
# master-weight steps (--group): (op, recipe, columnwise, split); "-gathered": split=False, the step returns the
# gathered buffers (as the baseline does) and each weight is cut out where it is read.
QUANTIZE_OPS = ("quantize_fp8", "quantize_fp8+T", "quantize_nvfp4", "quantize_nvfp4+T")
STAGE_OPS = ("fp8_stats", "fp8_quantize", "fp8_quantize+T", "nvfp4_stats", "nvfp4_quantize", "nvfp4_quantize+T")
STEP_OPS = tuple((f"step_{recipe}{'+T' if columnwise else ''}{'' if split else '-gathered'}", recipe, columnwise, split)
                 for recipe in ("nvfp4", "fp8") for columnwise in (False, True) for split in (True, False))


def batch_seconds(fn, *args, iters: int, keep: bool = False) -> float:
    """Seconds per call of one batch of ``iters`` back-to-back dispatches of ``fn(*args)``, waited
    for at the end. Each output is freed by the next call, or with ``keep`` all are held until the end."""
    import jax

    t0 = time.perf_counter()
    if keep:
        jax.block_until_ready([fn(*args) for _ in range(iters)])
    else:
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def median_seconds(fn, *args, iters: int, repeats: int) -> float:
    """Median seconds per call over ``repeats`` batches of ``iters`` dispatches, after a warm-up."""
    import jax

    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    return statistics.median(batch_seconds(fn, *args, iters=iters) for _ in range(repeats))


def copy_bandwidth(numel: int, *, iters: int, repeats: int, device_time: bool = False):
    """Bytes/s of a jitted ``x + 1`` over fp32[numel] (one read and one write of each element):
    wall clock, and (``device_time``, on a GPU) from its kernel time, else None."""
    import jax
    import jax.numpy as jnp

    y = jnp.zeros((numel,), jnp.float32)
    fn = jax.jit(lambda v: v + 1)
    dev = device_seconds(fn, y) if device_time else None
    return 2 * numel * 4 / median_seconds(fn, y, iters=iters, repeats=repeats), (2 * numel * 4 / dev if dev else None)


def device_seconds(fn, arg, iters: int = 5):
    """Seconds of GPU time per call of ``fn(arg)``: the time during which any kernel, memset or
    device-to-device copy of its streams runs, from a ``jax.profiler`` trace (no host dispatch, no host
    transfers; each call waited for). A union of intervals, not a sum: a kernel launched while the one
    before it drains (programmatic dependent launch, as XLA's fusions and jaxquant's casts are) counts
    the overlap once. None without a GPU."""
    events = _stream_events(_traced_planes(fn, arg, iters, False))
    return _covered_ns(events) * 1e-9 / iters if events else None


def _stream_events(planes: list) -> list:
    """(start ns, end ns, name) of every kernel, memset and device copy on GPU 0's streams, in start order."""
    host = ("MemcpyH2D", "MemcpyD2H")   # a stream line's name lists its event kinds, so filter events
    return sorted((ev.start_ns, ev.end_ns, ev.name) for line in _gpu0_lines(planes) if line.name.startswith("Stream")
                  for ev in line.events if not ev.name.startswith(host))


def _covered_ns(events: list) -> int:
    """Nanoseconds during which at least one of ``events`` (sorted by start) runs."""
    busy, end = 0, None
    for s, e, _ in events:
        if end is None or s > end:
            busy, end = busy + e - s, e
        elif e > end:
            busy, end = busy + e - end, e
    return busy


def _nvfp4_scale_bytes(rows: int, cols: int) -> int:
    from jaxquant.primitives import formats

    r, c = formats.nvfp4_scale_shape(rows, cols)
    return r * c


def cases(x, stages: bool):
    """(op name, fn(x, impl), bytes at the floor) for one input."""
    import jaxquant as jq
    from jaxquant.primitives import ops

    rows, cols = (int(d) for d in x.shape)
    n, itemsize = rows * cols, x.dtype.itemsize
    fp4_out = n // 2 + _nvfp4_scale_bytes(rows, cols)
    fp4_out_t = n // 2 + _nvfp4_scale_bytes(cols, rows)
    q8, q8t, q4, q4t = QUANTIZE_OPS
    out = [
        (q8, lambda x, impl: jq.quantize_fp8(x, impl=impl), 2 * n * itemsize + n),
        (q8t, lambda x, impl: jq.quantize_fp8(x, columnwise=True, impl=impl), 2 * n * itemsize + 2 * n),
        (q4, lambda x, impl: jq.quantize_nvfp4(x, impl=impl), 2 * n * itemsize + fp4_out),
        (q4t, lambda x, impl: jq.quantize_nvfp4(x, columnwise=True, impl=impl), 2 * n * itemsize + fp4_out + fp4_out_t),
    ]
    if stages:  # each pass on its own: one read of x plus its outputs (all from NVFP4's statistics)
        s8, c8, c8t, s4, c4, c4t = STAGE_OPS
        tiles, amax, _ = ops.nvfp4_stats(x, impl="reference")
        out += [
            (s8, lambda x, impl: ops.fp8_stats(x, impl=impl), n * itemsize),
            (c8, lambda x, impl: ops.fp8_quantize(x, amax, impl=impl), n * itemsize + n),
            (c8t, lambda x, impl: ops.fp8_quantize(x, amax, columnwise=True, impl=impl), n * itemsize + 2 * n),
            (s4, lambda x, impl: ops.nvfp4_stats(x, impl=impl), n * itemsize + n // 64),
            (c4, lambda x, impl: ops.nvfp4_quantize(x, tiles, amax, impl=impl), n * itemsize + fp4_out),
            (c4t, lambda x, impl: ops.nvfp4_quantize(x, tiles, amax, columnwise=True, impl=impl),
             n * itemsize + fp4_out + fp4_out_t),
        ]
    return out


def selected(name: str, ops: str | None) -> bool:
    """Whether ``--ops`` (comma-separated op names or shell patterns; None: every op) selects op ``name``."""
    return not ops or any(fnmatch.fnmatchcase(name, pat) for pat in ops.split(","))


def _traced_planes(fn, arg, iters: int, pipelined: bool) -> list:
    """The planes of a ``jax.profiler`` trace of ``iters`` calls of ``fn(arg)`` (after one untraced call:
    compilation); ``pipelined``: dispatched back to back and waited for once (else each is waited for)."""
    import jax

    jax.block_until_ready(fn(arg))
    with tempfile.TemporaryDirectory(prefix="jq-profile-") as folder:   # the trace is read, then removed
        with jax.profiler.trace(folder):
            if pipelined:
                jax.block_until_ready([fn(arg) for _ in range(iters)])
            else:
                for _ in range(iters):
                    jax.block_until_ready(fn(arg))
        files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
        return list(jax.profiler.ProfileData.from_file(files[0]).planes) if files else []  # an iterator


def _gpu0_lines(planes: list) -> list:
    gpu = [pl for pl in planes if pl.name.startswith("/device:GPU:0")]
    return list(gpu[0].lines) if gpu else []


def kernel_profile(fn, arg, iters: int = 5, *, pipelined: bool = False, host: bool = False) -> dict:
    """Per-kernel device time of ``fn(arg)`` on the first GPU from a ``jax.profiler`` trace:
    ``{line: {event name: (µs per call, launches per call)}}`` for the device plane's "XLA Ops" line
    (HLO ops) and "Stream ..." lines (kernels and copies); none where there is no device plane (CPU).
    ``pipelined`` as in :func:`_traced_planes`; ``host``: also a "host" entry, every
    host-plane event (dispatch, thunks, launches) summed by name."""
    planes = _traced_planes(fn, arg, iters, pipelined)
    out = {}

    def add(key, events):
        total, count = collections.defaultdict(float), collections.Counter()
        for ev in events:
            total[ev.name] += ev.duration_ns / 1e3 / iters
            count[ev.name] += 1
        if total:
            out[key] = {name: (us, count[name] / iters) for name, us in total.items()}

    for line in _gpu0_lines(planes):
        if line.name == "XLA Ops" or line.name.startswith("Stream"):
            add(line.name, line.events)
    if host:
        add("host", [ev for pl in planes if pl.name.startswith("/host") for line in pl.lines for ev in line.events])
    return out


def stream_timeline(fn, arg, iters: int = 20) -> dict | None:
    """Where the device time of back-to-back calls goes: ``iters`` pipelined calls of ``fn(arg)``
    traced, every kernel, memset and device copy of GPU 0's streams in start order. Returns (None
    without a GPU trace) per call: ``span_us`` (first start to last end), ``busy_us`` (time during
    which an event runs), ``idle_us`` (their difference: the stream waiting between events),
    ``host_us`` (the host's time to dispatch a call, untraced: near the span, the calls are
    host-bound) and ``call``, one call in the middle as ``(gap before µs, duration µs, name)`` per
    event. A call's events are told apart by count (events ÷ iters): ``call`` is None when that
    does not divide."""
    import jax

    jax.block_until_ready(fn(arg))
    t0 = time.perf_counter()
    outs = [fn(arg) for _ in range(iters)]
    host = (time.perf_counter() - t0) / iters * 1e6   # untraced: the profiler slows the host down
    jax.block_until_ready(outs)
    events = _stream_events(_traced_planes(fn, arg, iters, True))
    if not events:
        return None
    span = (max(e for _, e, _ in events) - events[0][0]) / 1e3 / iters
    busy = _covered_ns(events) / 1e3 / iters
    call = None
    if len(events) % iters == 0:
        per = len(events) // iters
        first = per * (iters // 2)
        call = [((s - events[i - 1][1]) / 1e3, (e - s) / 1e3, name)
                for i, (s, e, name) in enumerate(events[first:first + per], start=first)]
    return dict(span_us=span, busy_us=busy, idle_us=span - busy, host_us=host, call=call)


def print_kernel_profile(label, fn, arg, iters: int = 5, top: int = 12, **options) -> dict:
    """Prints :func:`kernel_profile`'s busiest events per line (nothing on the CPU); returns it.
    ``options``: kernel_profile's ``pipelined`` and ``host``."""
    prof = kernel_profile(fn, arg, iters, **options)
    if prof:
        print(f"\nprofile: {label} ({iters} calls, device 0; µs per call)")
    for line, events in prof.items():
        total = sum(us for us, _ in events.values())
        print(f"  [{line}] " + ("events (nested ones overlap)" if line == "host" else f"busy {total:.1f} µs"))
        for name, (us, n) in sorted(events.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"    {us:9.1f}  x{n:<5g} {name[:90]}")
    return prof


def print_timeline(label, fn, arg, iters: int = 20) -> dict | None:
    """Prints :func:`stream_timeline` (nothing without a GPU trace); returns it."""
    tl = stream_timeline(fn, arg, iters)
    if tl:
        print(f"  timeline {label}: span {tl['span_us']:.1f} µs/call = busy {tl['busy_us']:.1f} + idle "
              f"{tl['idle_us']:.1f}; host dispatch {tl['host_us']:.1f} µs/call")
        for gap, dur, name in tl["call"] or ():
            print(f"    gap {gap:7.1f}  {dur:8.1f}  {name[:90]}")
    return tl


def gather_summary(prof: dict, received_bytes: float) -> str | None:
    """One line on :func:`kernel_profile`'s NCCL all-gather kernels: their time per call summed over
    every stream, their launches, their kernel names and ``received_bytes`` (per device per call)
    over that time. None where the profile has no all-gather kernel (one device, the CPU). Pieces on
    two streams may overlap, so the bandwidth is a lower bound. The names do not tell the protocol:
    NCCL's ring all-gather kernel is named ``..._RING_LL`` whatever protocol it runs (NVIDIA/nccl
    issue 2196); ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`` prints the choice."""
    us, launches, variants = 0.0, 0.0, set()
    for line, events in prof.items():
        if not line.startswith("Stream"):
            continue
        for name, (t, n) in events.items():
            if "AllGather" in name:
                us, launches = us + t, launches + n
                variants.add(name.split("(")[0].removeprefix("ncclDevKernel_"))
    if not launches:
        return None
    return (f"all-gather kernels: {us:.1f} µs per call in {launches:g} launches ({', '.join(sorted(variants))}); "
            f"{received_bytes / 1e6:.1f} MB received per device: {received_bytes / us / 1e3:.0f} GB/s")


def bf16_gather(mesh, axis: str = "fsdp"):
    """Plain JAX's way to full weights from fp32 master shards: cast each shard to bf16, all-gather."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    body = lambda s: jax.lax.all_gather(s.astype(jnp.bfloat16), axis, tiled=True)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(), check_vma=False))


def random_master(layout, mesh, axis: str = "fsdp"):
    """An fp32 master flat buffer of ``layout`` (normal * 0.02), sharded over ``axis`` of ``mesh``."""
    import jax
    import jax.numpy as jnp

    from jaxquant.zero.distributed import master_sharding

    return jax.jit(lambda key: jax.random.normal(key, (layout.total_size,), jnp.float32) * 0.02,
                   out_shardings=master_sharding(mesh, axis))(jax.random.key(0))


def group_step_rows(*, div: int, iters: int, repeats: int, ops=None, timeline: bool = False) -> list[dict]:
    """Times the master-weight step against the bf16 cast + all-gather on one Llama-3-8B layer (dims
    / ``div``), fsdp over every device; prints the table and returns its rows (STEP_FIELDS).
    ``timeline``: also each step's device timeline (:func:`print_timeline`, GPU 0)."""
    import jax
    import numpy as np

    from jaxquant.zero.distributed import gathered_bytes, quantize_master_weights
    from jaxquant.zero.layout import FlatLayout

    steps = [s for s in STEP_OPS if selected(s[0], ops)]
    if not steps:
        return []
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    layout = FlatLayout([(m // div, k // div) for _, (m, k) in LLAMA3_8B_LAYER], len(devices),
                        names=[n for n, _ in LLAMA3_8B_LAYER])
    master = random_master(layout, mesh)
    base = median_seconds(bf16_gather(mesh), master, iters=iters, repeats=repeats)
    print(f"\nmaster-weight step: one Llama-3-8B layer{' / ' + str(div) if div > 1 else ''} "
          f"({layout.total_size / 1e6:.1f}M parameters), fsdp = {len(devices)} device(s)")
    if len(devices) == 1:
        print("(one device: nothing is gathered, so the baseline is the bf16 cast alone and the step has no "
              "bytes to save; its targets are for 2+ devices)")
    print(f"{'op':22s} {'us':>9s} {'x bf16 gather':>14s} {'gathered MB':>12s}")
    print(f"{'bf16 cast+gather':22s} {base * 1e6:9.1f} {1.0:14.3f} {2 * layout.total_size / 2**20:12.2f}")
    rows = []
    for name, recipe, columnwise, split in steps:
        fn = jax.jit(lambda x, r=recipe, c=columnwise, sp=split: quantize_master_weights(
            x, layout, mesh=mesh, recipe=r, columnwise=c, manual_post_all_gather_processing=False, split=sp))
        t = median_seconds(fn, master, iters=iters, repeats=repeats)
        mb = gathered_bytes(layout, recipe) / 2**20
        rows.append(dict(op=name, devices=len(devices), params=layout.total_size, us=t * 1e6,
                         bf16_gather_us=base * 1e6, x_bf16_gather=t / base, gathered_mb=mb))
        print(f"{name:22s} {t * 1e6:9.1f} {t / base:14.3f} {mb:12.2f}", flush=True)
        if timeline:
            rows[-1]["timeline"] = print_timeline(name, fn, master)
    return rows


# The source checkout this module lies in (jaxquant/ and csrc/ below it in an editable install).
_CHECKOUT = Path(__file__).resolve().parents[2]
# Sources hashed by source_digest(), relative to the checkout root; scripts/gpu_suite.sh runs the same
# digest in shell (sha1 of the files' contents concatenated in byte-sorted path order).
SOURCE_SUFFIXES = (".py", ".cc", ".cu", ".cuh", ".h")


def source_digest(root: Path | None = None) -> str:
    """First 12 hex digits of the sha1 of jaxquant's Python and C++/CUDA sources (``jaxquant/``,
    ``csrc/``) as they lie on disk. It names the measured code where git's HEAD does not: a working
    tree copied onto a device machine keeps whatever HEAD its ``.git`` had."""
    import hashlib

    root = root or _CHECKOUT
    paths = [str(p.relative_to(root)) for d in ("csrc", "jaxquant") if (root / d).is_dir()
             for p in (root / d).rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES]
    digest = hashlib.sha1()
    for path in sorted(paths, key=str.encode):   # byte order, like `LC_ALL=C sort`
        digest.update((root / path).read_bytes())
    return digest.hexdigest()[:12]


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(_CHECKOUT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def check_args(args, gpu: bool) -> dict:
    """The run's sizes, dtypes, iters, repeats and stages from ``args`` and this backend's defaults, checked before
    any work: ``ValueError`` whose message starts with the option's name."""
    from jaxquant.primitives import formats
    from jaxquant.cli.errors import check_output_file
    from jaxquant.primitives.ops import INPUT_DTYPES

    sizes = []
    for size in (args.sizes or (GPU_SIZES if gpu else CPU_SIZES)).split(","):
        try:
            rows, cols = (int(v) for v in size.lower().split("x"))
        except ValueError:
            raise ValueError(f"--sizes: each size must be ROWSxCOLS, e.g. {CPU_SIZES}; got {size!r}") from None
        if rows < 1 or cols < 1:
            raise ValueError(f"--sizes: both dimensions must be positive, got {size!r}")
        sizes.append((rows, cols))
    dtypes = (args.dtypes or ("float32,bfloat16" if gpu else "float32")).split(",")
    inputs = [d.name for d in INPUT_DTYPES]
    for name in dtypes:
        if name not in inputs:
            raise ValueError(f"--dtypes: each must be one of the quantizers' input dtypes {', '.join(inputs)}; "
                             f"got {name!r}")
    for option, value in (("--iters", args.iters), ("--repeats", args.repeats)):
        if value is not None and value < 1:
            raise ValueError(f"{option}: must be at least 1, got {value}")
    stages = args.stages if args.stages is not None else gpu
    single = QUANTIZE_OPS + (STAGE_OPS if stages else ())
    available = single + (tuple(s[0] for s in STEP_OPS) if args.group else ())
    for pattern in args.ops.split(",") if args.ops else ():
        if not any(fnmatch.fnmatchcase(name, pattern) for name in available):
            off = ([] if stages else ["--stages adds " + ", ".join(STAGE_OPS)]) + ([] if args.group else
                                                                                   ["--group adds step_*"])
            raise ValueError(f"--ops: {pattern!r} selects none of this run's ops ({', '.join(available)})"
                             + (f"; {'; '.join(off)}" if off else ""))
    # no stage rows (nor their NVFP4 statistics) where --ops selects none of them
    stages = stages and any(selected(name, args.ops) for name in STAGE_OPS)
    # NVFP4's 16x16 tiles: its ops, and every --stages row (they start from nvfp4_stats, see cases())
    if stages or any("nvfp4" in name and selected(name, args.ops) for name in single):
        for rows, cols in sizes:
            formats.check_nvfp4_shape(rows, cols, "--sizes")
    if args.json:   # the results must not be lost at the end of the run
        check_output_file(args.json, "--json")
    return dict(sizes=sizes, dtypes=dtypes, iters=args.iters or (GPU_ITERS if gpu else CPU_ITERS),
                repeats=args.repeats or (GPU_REPEATS if gpu else CPU_REPEATS), stages=stages)


def run(args) -> int:
    import jax
    import jax.numpy as jnp

    gpu = jax.default_backend() == "gpu"
    try:
        settings = check_args(args, gpu)
    except ValueError as e:
        from jaxquant.cli.errors import refuse

        return refuse("jaxquant bench", str(e))
    iters, repeats = settings["iters"], settings["repeats"]
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"compute dtype bfloat16; times: median of {repeats} x {iters} dispatches")
    dev_time = gpu if args.device_time is None else args.device_time
    header = (f"{'op':18s} {'shape':>12s} {'dtype':>9s} {'us':>9s} {'x floor':>8s} {'xla us':>9s} "
              f"{'x xla':>7s}"
              + (f" | {'dev us':>8s} {'x floor':>8s} {'xla dev':>8s} {'x xla':>6s}" if dev_time else ""))
    if dev_time:
        print("left: wall clock per call (back-to-back dispatches); right of |: GPU kernel time per call "
              "(profiler), floor at the copy kernel's bandwidth")
    print(header)
    print("-" * len(header))
    rows_out, copies = [], []
    # Host cost of one dispatch of a jitted op on 4 elements: rows near it are dispatch-bound, not
    # kernel-bound (the batches are back-to-back asynchronous dispatches).
    dispatch_us = median_seconds(jax.jit(lambda v: v + 1), jnp.ones((4,), jnp.float32), iters=iters,
                                 repeats=repeats) * 1e6
    print(f"{'(dispatch, 4 elts)':18s} {'':>12s} {'':>9s} {dispatch_us:9.1f}")
    for rows, cols in settings["sizes"]:
        bw, bw_dev = copy_bandwidth(rows * cols, iters=iters, repeats=repeats, device_time=dev_time)
        copies.append(dict(shape=f"{rows}x{cols}", copy_gbps=bw / 1e9, copy_dev_gbps=bw_dev and bw_dev / 1e9))
        for dname in settings["dtypes"]:
            dtype = jnp.dtype(dname)
            x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32).astype(dtype)
            for name, fn, nbytes in cases(x, settings["stages"]):
                if not selected(name, args.ops):
                    continue
                custom_fn = jax.jit(lambda v, f=fn: f(v, "custom_call"))
                xla_fn = jax.jit(lambda v, f=fn: f(v, "reference"))
                custom = median_seconds(custom_fn, x, iters=iters, repeats=repeats)
                xla = median_seconds(xla_fn, x, iters=iters, repeats=repeats)
                floor = nbytes / bw
                row = dict(op=name, shape=f"{rows}x{cols}", dtype=dname, us=custom * 1e6, floor_us=floor * 1e6,
                           x_floor=custom / floor, xla_us=xla * 1e6, x_xla=custom / xla, bytes=nbytes,
                           **dict.fromkeys(DEVICE_FIELDS))
                line = (f"{name:18s} {row['shape']:>12s} {dname:>9s} {row['us']:9.1f} {row['x_floor']:8.2f} "
                        f"{row['xla_us']:9.1f} {row['x_xla']:7.2f}")
                kern, xla_kern = (device_seconds(custom_fn, x), device_seconds(xla_fn, x)) if bw_dev else (None, None)
                if kern and xla_kern:
                    dev_floor = nbytes / bw_dev
                    row.update(dev_us=kern * 1e6, dev_floor_us=dev_floor * 1e6, dev_x_floor=kern / dev_floor,
                               xla_dev_us=xla_kern * 1e6, dev_x_xla=kern / xla_kern)
                    line += f" | {kern * 1e6:8.1f} {kern / dev_floor:8.2f} {xla_kern * 1e6:8.1f} {kern / xla_kern:6.2f}"
                rows_out.append(row)
                print(line, flush=True)
                if args.timeline and gpu:
                    row["timeline"] = {impl: print_timeline(f"{name} {row['shape']} {dname} {impl}", f, x)
                                       for impl, f in (("custom_call", custom_fn), ("reference", xla_fn))}
        print(f"{'(copy x+1 fp32)':18s} {f'{rows}x{cols}':>12s} {'':>9s} {'':>9s} {'':>8s} {'':>9s} {'':>7s}  "
              f"{bw / 1e9:.0f} GB/s" + (f", kernel {bw_dev / 1e9:.0f} GB/s" if bw_dev else ""))
    group_rows = (group_step_rows(div=1 if gpu else 32, iters=iters, repeats=repeats, ops=args.ops,
                                  timeline=args.timeline and gpu)
                  if args.group else [])
    result = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  commit=_git_commit(), source_digest=source_digest(), compute_dtype="bfloat16", iters=iters,
                  repeats=repeats, copy=copies, dispatch_us=dispatch_us,
                  rows=rows_out, group_step=group_rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    else:
        print("no JSON written (--json PATH writes one)")
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.replace("``", "")  # plain text in --help
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated RxC (default {GPU_SIZES} on a GPU, {CPU_SIZES} elsewhere)")
    parser.add_argument("--dtypes", default=None,
                        help="input dtypes (default float32,bfloat16 on a GPU, float32 elsewhere)")
    parser.add_argument("--ops", default=None,
                        help="comma-separated op names or shell patterns to time (default: all), "
                             "e.g. 'quantize_fp8*,fp8_*'")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"dispatches per timed batch (default {GPU_ITERS} on a GPU, {CPU_ITERS} elsewhere)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed batches; the median is reported (default {GPU_REPEATS} on a GPU, "
                             f"{CPU_REPEATS} elsewhere)")
    parser.add_argument("--stages", action=argparse.BooleanOptionalAction, default=None,
                        help="also time each pass (stats, quantize) on its own (default: on a GPU)")
    parser.add_argument("--device-time", action=argparse.BooleanOptionalAction, default=None,
                        help="also report GPU kernel time per call from a jax.profiler trace, which leaves out "
                             "host dispatch (default: on a GPU)")
    parser.add_argument("--group", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the master-weight step on one Llama-3-8B layer against the bf16 cast + "
                             "all-gather, fsdp over every device (ops step_nvfp4, step_nvfp4+T, step_fp8, "
                             "step_fp8+T, each also -gathered: split=False; default on)")
    parser.add_argument("--timeline", action="store_true",
                        help="on a GPU, also print each row's device timeline of back-to-back calls (custom "
                             "calls and XLA; the master-weight steps): span per call, busy and idle time, and "
                             "one call's events with the stream's idle gap before each")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the results as JSON to PATH, in an existing directory (default: no JSON file)")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m jaxquant.cli.bench")
    configure_parser(p)
    a = p.parse_args()
    sys.exit(a.func(a))
