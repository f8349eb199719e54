"""Where a training step's time goes: GPU 0's kernels from a Perfetto trace attributed, by their HLO op in the compiled
program, to the categories of issue 55 (ms a step each), as a markdown table (one column per config) and a stacked-bar
PNG.

    from breakdown import breakdown, table, plot
    rows = [(config, breakdown(trace_dir, open(hlo_path).read(), steps=3)) for ...]
    print(table(rows)); plot(rows, "breakdown.png")

``bench_e2e.py --profile DIR`` and ``bench_flax.py --profile DIR`` do this for every config they run (the trace under
``DIR/<flags>/<config>/``, the compiled HLO beside it as ``<config>.hlo.txt``, the table printed and
``DIR/breakdown.png`` written at the end).

**What is read from the trace** (``jax.profiler.trace(dir, create_perfetto_trace=True)``, the newest
``*.trace.json.gz`` under ``dir``): complete events (``"ph": "X"``: ``ts``, ``dur``, ``name``, ``pid``, ``tid``) of the
process whose ``process_name`` metadata names ``GPU:0`` (all its threads, as ``bench_e2e.exposed_collectives``
reads them; threads named as derived views, ``XLA Ops`` / ``XLA Modules`` / ``Steps`` / ``Framework ...``, are left
out where present). Without a GPU process (a CPU run), the host's events that carry ``args.hlo_op`` with
``args.device_ordinal`` 0 (XLA:CPU's thunk executor writes one per thunk; checked with jax 0.10.2 on the CPU). Per
event, ``args.hlo_op`` (the HLO instruction's name) and ``args.hlo_module`` (the program's name): an event of another
program than the HLO text's ``HloModule`` is not attributed. An event without ``args.hlo_op`` (or whose op is a
``while`` / ``conditional`` / ``call`` container, e.g. a command buffer) is attributed by its kernel ``name`` when
that is an instruction's name (XLA names its fusion kernels after the fusion); otherwise it is counted in
``unattributed``, except NCCL kernels (``nccl`` in the name), which count as collectives as in
``exposed_collectives``. ``detail["attributed_by"]`` says how many events each way took.

**What is read from the HLO** (``compiled.as_text()`` of the step, the program the trace ran): per instruction, its
opcode, ``custom_call_target``, output dtypes, operands (and so their dtypes), the computations it calls (a fusion's
body, a reduce's reducer) and its ``metadata={op_name=...}``.

**Categories** (first match wins; kernel ms summed, so kernels that overlap on several streams both count):

* ``collective_total`` / ``collective_exposed``: collective ops (all-gather, all-reduce, reduce-scatter, all-to-all,
  collective-permute, send / recv; their ``-start`` / ``-done`` and ``async-*`` wrappers); exposed is the part of
  their time no other kernel of GPU 0 overlaps (``exposed_collectives``'s interval logic, one copy: here);
* ``attention``: cuDNN flash attention custom calls (``custom_call_target`` containing ``fmha``); on paths without
  them (XLA's attention, the CPU) only ops whose metadata ``op_name`` says ``dot_product_attention`` or names one of
  ``jax.nn.dot_product_attention``'s einsums (``BTNH,BSNH->BNTS``, ``BNTS,BSNH->BTNH``): the softmax between them has
  no such scope and counts as ``norm_elementwise`` there;
* ``quantize``: jaxquant's FFI custom calls (targets ``jq_*``: amax, stats, cast, cast-transpose, NVFP4 scales ...)
  but its GEMMs (``GEMM_FFI_TARGETS``: ``jq_fp8_gemm``, an ``fp8_gemm``; ``jq_bf16_gemm``, NVFP4's on Hopper, whose
  operands are bf16: a ``bf16_gemm``);
* ``fp8_gemm`` / ``bf16_gemm``: GEMMs (``dot`` / ``convolution``, cuBLAS custom calls, fusions whose body holds a dot,
  e.g. Triton / cuDNN GEMM fusions; a custom call of another target whose kernel name reads as a GEMM, e.g. the
  collective GEMMs of ``overlap="fused"``), ``fp8_gemm`` when an operand of the GEMM (or of its fusion) is 8- or 4-bit
  floating point (``f8*`` / ``f4*``: the FP8 and FP4 GEMMs), ``bf16_gemm`` otherwise (bf16, f32);
* ``quantize`` also: other fusions whose output is ``f8*`` / ``f4*`` or that reduce an ``abs`` with ``maximum``
  (an amax), but an optimizer-scope fusion that also reduces an amax (the FP8 weights' amax taken in their update)
  is ``optimizer``;
* ``optimizer``: ops whose ``op_name`` holds the scope ``OPTIMIZER_SCOPE`` ("optimizer"; a fusion when any op in it
  does). optax's own code leaves no trace in the HLO (no name scope; its frames are not in the stack frames jax
  keeps), so the benchmarks wrap their optimizer in ``scoped_optimizer`` (``jax.named_scope``: metadata only, the same
  compiled code). A step whose optimizer is not so wrapped reports its update inside ``norm_elementwise``;
* ``norm_elementwise``: every other fusion and plain HLO op (norms, activations, residual adds, casts to bf16, copies);
* ``other``: custom calls of other targets, and events attributed only to a container op (a while loop's memcpy);
* ``idle``: the time GPU 0 runs no kernel between its first and last kernel of the trace;
* ``unattributed``: events that could not be tied to an instruction of this HLO (see above).

Every value is ms per step (the trace's total over ``steps``). ``detail`` (a dict, not ms) holds the trace span per
step (``span_ms``), the events attributed each way, the programs seen, and each category's largest ops.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import Counter, defaultdict

GEMM_FFI_TARGETS = ("jq_fp8_gemm", "jq_bf16_gemm")   # jaxquant's FFI targets that are GEMMs (csrc/cuda_gemm.cu)
CATEGORIES = ("fp8_gemm", "bf16_gemm", "attention", "quantize", "norm_elementwise", "optimizer", "collective_total",
              "collective_exposed", "idle", "other", "unattributed")
# stacked in the PNG: the categories that do not overlap each other (collective_total holds the hidden part too)
STACKED = tuple(c for c in CATEGORIES if c != "collective_total")
OPTIMIZER_SCOPE = "optimizer"

LOW_PRECISION = re.compile(r"^f(8|4)")           # f8e4m3fn, f8e5m2, f8e8m0fnu (MX scales), f4e2m1fn ...
COLLECTIVE_OPS = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
                  "collective-broadcast", "send", "recv"}
CONTAINER_OPS = {"while", "conditional", "call"}
ATTENTION_TARGET = re.compile(r"fmha", re.I)
ATTENTION_OP_NAME = re.compile(r"dot_product_attention|BTNH,BSNH->BNTS|BNTS,BSNH->BTNH")
GEMM_TARGET = re.compile(r"^__cublas|gemm|matmul", re.I)
DERIVED_THREADS = re.compile(r"^(XLA Ops|XLA Modules|Steps|Framework|Source code|TensorFlow)")
GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm100_", re.I)
# jaxquant/tp/collective_gemm.py's kernels (overlap="fused"): GEMM and transfers in one kernel, named after
# their Pallas bodies; they count as computation that hides nothing but themselves
COLLECTIVE_GEMM_KERNEL = re.compile(r"collective_(gather_gemm|gemm_scatter)")
# the one-block cross-GPU barrier XLA launches before each Mosaic GPU kernel that addresses other GPUs
# (single-process meshes: docs/sp.md); its time is the wait for the slowest GPU
BARRIER_KERNEL = re.compile(r"barrier", re.I)


# ----------------------------------------------------------------------------------------------
# The trace (shared with bench_e2e.exposed_collectives)
# ----------------------------------------------------------------------------------------------


def load_trace(path):
    """The event list of the newest ``*.trace.json.gz`` under ``path`` (None when there is none)."""
    files = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        return None
    with gzip.open(files[-1]) as f:
        events = json.load(f)
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def gpu0_events(events):
    """GPU 0's complete events (kernels, memcpys) of a trace's ``events``; [] when no process names GPU 0. Threads
    named as derived views of the same kernels (``DERIVED_THREADS``) are left out where a trace has them."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    gpu0 = {pid for pid, name in names.items() if "GPU:0" in name or name.endswith("/device:GPU:0")}
    derived = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e.get("pid") in gpu0 and DERIVED_THREADS.match(str(e.get("args", {}).get("name", "")))}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu0 and "dur" in e
            and (e["pid"], e.get("tid")) not in derived]


def cpu_events(events, device=0):
    """A CPU run's per-op events: the host's complete events carrying ``args.hlo_op`` of ``device``."""
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "hlo_op" in e.get("args", {})
            and str(e["args"].get("device_ordinal", device)) == str(device)]


def merge(ivs):
    """Sorted intervals merged where they touch or overlap."""
    out = []
    for a, b in ivs:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(a, b, merged):
    """How much of [a, b] the sorted, disjoint intervals ``merged`` cover (a binary search to the first
    one that can overlap, not a scan of all of them)."""
    import bisect

    i = max(bisect.bisect_right(merged, (a,)) - 1, 0)
    total = 0.0
    for c, d in merged[i:]:
        if c >= b:
            break
        total += max(0.0, min(b, d) - max(a, c))
    return total


def collective_times(comm, comp):
    """(total, hidden) µs of the collective intervals ``comm``: their union's length, and how much of it the
    union of the computation intervals ``comp`` overlaps (exposed = total - hidden)."""
    comm_u, comp_u = merge(sorted(comm)), merge(sorted(comp))
    total = sum(b - a for a, b in comm_u)
    return total, sum(covered(a, b, comp_u) for a, b in comm_u)


def idle_gaps(busy, named, steps, top=4):
    """Idle ms per step between GPU 0's merged kernel intervals ``busy``, and the ``top`` largest gaps as
    (ms, kernel ending before it, kernel starting after it), names cut to 50 characters."""
    gaps = [(c - b, b, c) for (_, b), (c, _) in zip(busy, busy[1:])]
    ending = {round(iv[1], 3): name for iv, name in named}
    starting = {round(iv[0], 3): name for iv, name in named}
    largest = sorted(gaps, reverse=True)[:top]
    return {"idle_ms": sum(g for g, _, _ in gaps) / steps / 1e3,
            "largest_gaps": [(round(g / 1e3, 3), ending.get(round(b, 3), "?")[:50], starting.get(round(c, 3), "?")[:50])
                             for g, b, c in largest]}


# ----------------------------------------------------------------------------------------------
# The HLO
# ----------------------------------------------------------------------------------------------


class Instr:
    __slots__ = ("name", "opcode", "target", "out_dtypes", "operands", "calls", "op_name", "computation")

    def __repr__(self):
        return f"Instr({self.name}, {self.opcode}, {self.target}, {self.out_dtypes})"


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_DTYPE = re.compile(r"\b([a-z][a-z0-9]*)\[")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|"
                    r"false_computation)=\{?([%\w.\-, ]+)\}?")


def _balanced(s, i):
    """The index just past the parenthesis group that opens at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j + 1
    return len(s)


class Hlo:
    """The instructions of an HLO module's text (``compiled.as_text()``): ``instrs[name]`` (an ``Instr``: opcode,
    custom_call_target, output dtypes, operand names, called computations, metadata op_name) and ``computations[name]``
    (its instruction names, the root last)."""

    def __init__(self, text):
        self.module = None
        self.instrs, self.computations, self.roots = {}, {}, {}
        comp = None
        for line in text.splitlines():
            if line.startswith("HloModule"):
                self.module = re.match(r"HloModule\s+([\w.\-]+)", line).group(1)
                continue
            m = _HEADER.match(line)
            if m and not line.startswith((" ", "\t")):
                comp = m.group(1)
                self.computations[comp] = []
                continue
            if line.startswith("}"):
                comp = None
                continue
            m = _INSTR.match(line) if comp else None
            if m:
                ins = self._parse(m.group(1), m.group(2), comp)
                self.instrs[ins.name] = ins
                self.computations[comp].append(ins.name)
                if line.lstrip().startswith("ROOT"):
                    self.roots[comp] = ins.name
        self._bodies = {}

    @staticmethod
    def _parse(name, rest, comp):
        ins = Instr()
        ins.name, ins.computation = name, comp
        end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
        ins.out_dtypes = tuple(_DTYPE.findall(rest[:end]))
        after = rest[end:].lstrip()
        m = re.match(r"([\w\-]+)\(", after)
        ins.opcode = m.group(1) if m else after.split("(")[0].strip()
        close = _balanced(after, m.end() - 1) if m else 0
        ins.operands = tuple(re.findall(r"%?([A-Za-z_][\w.\-]*)", after[m.end():close - 1] if m else ""))
        attrs = after[close:]
        t = re.search(r'custom_call_target="([^"]*)"', attrs)
        ins.target = t.group(1) if t else None
        ins.calls = tuple(c.strip().lstrip("%") for m in _CALLS.finditer(attrs) for c in m.group(1).split(",")
                          if c.strip())
        o = re.search(r'op_name="((?:[^"\\]|\\.)*)"', attrs)
        ins.op_name = o.group(1) if o else ""
        return ins

    def dtypes(self, names):
        return tuple(d for n in names if n in self.instrs for d in self.instrs[n].out_dtypes)

    def body(self, ins):
        """Every instruction of the computations ``ins`` calls, nested calls included (a fusion's body)."""
        if ins.name not in self._bodies:
            seen, stack, out = set(), list(ins.calls), []
            while stack:
                comp = stack.pop()
                if comp in seen or comp not in self.computations:
                    continue
                seen.add(comp)
                for n in self.computations[comp]:
                    out.append(self.instrs[n])
                    stack.extend(self.instrs[n].calls)
            self._bodies[ins.name] = out
        return self._bodies[ins.name]

    def _is_max_reducer(self, comp):
        root = self.instrs.get(self.roots.get(comp, ""))
        return root is not None and root.opcode == "maximum"

    def classify(self, ins, kernel=""):
        """The category of instruction ``ins`` (``kernel``: the kernel's name, read only for custom calls of unknown
        targets)."""
        inner = self.body(ins)
        everything = [ins] + inner
        opcodes = {i.opcode.removesuffix("-start").removesuffix("-done") for i in everything}
        if ins.opcode.startswith("async-") or ins.opcode.endswith(("-start", "-done", "-update")):
            if opcodes & COLLECTIVE_OPS:
                return "collective"
            if ins.opcode in ("async-done", "async-update") and ins.operands and ins.operands[0] in self.instrs:
                return self.classify(self.instrs[ins.operands[0]], kernel)
        if opcodes & COLLECTIVE_OPS:
            return "collective"
        targets = [i.target for i in everything if i.target]
        if any(ATTENTION_TARGET.search(t) for t in targets) or any(ATTENTION_OP_NAME.search(i.op_name)
                                                                  for i in everything):
            return "attention"
        if any(t in GEMM_FFI_TARGETS for t in targets):      # jaxquant's own GEMMs, by their operands' dtypes
            return "fp8_gemm" if any(LOW_PRECISION.match(d) for d in self.dtypes(ins.operands)) else "bf16_gemm"
        if any(t.startswith("jq_") for t in targets):
            return "quantize"
        gemms = [i for i in everything
                 if i.opcode in ("dot", "convolution") or (i.target and GEMM_TARGET.search(i.target))]
        if not gemms and ins.opcode == "custom-call" and (GEMM_KERNEL.search(kernel)
                                                          or COLLECTIVE_GEMM_KERNEL.search(kernel)):
            gemms = [ins]
        if gemms:
            dts = self.dtypes(ins.operands) + tuple(d for g in gemms for d in self.dtypes(g.operands))
            return "fp8_gemm" if any(LOW_PRECISION.match(d) for d in dts) else "bf16_gemm"
        if any(LOW_PRECISION.match(d) for d in ins.out_dtypes):
            return "quantize"
        # before the amax rule: the update of an FP8 weight's master also takes its amax for the next step
        # (TrainState.weight_amax), in the same fusion; the kernel is the optimizer's
        scope = re.compile(rf"(^|/){re.escape(OPTIMIZER_SCOPE)}(/|$)")
        if any(scope.search(i.op_name) for i in everything):
            return "optimizer"
        if any(i.opcode == "abs" for i in inner) and any(
                i.opcode == "reduce" and any(self._is_max_reducer(c) for c in i.calls) for i in inner):
            return "quantize"
        if ins.opcode == "custom-call" or ins.opcode in CONTAINER_OPS:
            return "other"
        return "norm_elementwise"


# ----------------------------------------------------------------------------------------------
# The breakdown
# ----------------------------------------------------------------------------------------------


def _module(name):
    m = re.match(r"[\w.\-]+", str(name))
    return m.group(0) if m else ""


def breakdown(trace_dir, hlo_text, steps, events=None) -> dict:
    """ms per step per category (``CATEGORIES``) of the newest trace under ``trace_dir`` (or of the trace ``events``
    given), its kernels attributed through ``hlo_text`` (the compiled HLO of the program traced) over ``steps``
    steps; plus ``detail`` (see the module's docstring). None when the trace has no GPU 0 or CPU op events."""
    if events is None:
        events = load_trace(trace_dir)
        if events is None:
            return None
    kernels = gpu0_events(events) or cpu_events(events)
    if not kernels:
        return None
    hlo = Hlo(hlo_text)
    module = _module(hlo.module) if hlo.module else None
    ms = dict.fromkeys(CATEGORIES, 0.0)
    how, modules, top = Counter(), Counter(), defaultdict(Counter)
    comm, comp, named, cache = [], [], [], {}
    for e in kernels:
        args, name = e.get("args", {}) or {}, e.get("name", "")
        dur = float(e["dur"])
        iv = (float(e["ts"]), float(e["ts"]) + dur)
        named.append((iv, name))
        op, label = args.get("hlo_op"), None
        if args.get("hlo_module") is not None:
            modules[str(args["hlo_module"])] += 1
        other_module = module and args.get("hlo_module") is not None and _module(args["hlo_module"]) != module
        ins = None if other_module else hlo.instrs.get(op)
        if ins is not None and ins.opcode not in CONTAINER_OPS:
            how["hlo_op"] += 1
        elif not other_module and name in hlo.instrs and hlo.instrs[name].opcode not in CONTAINER_OPS:
            ins = hlo.instrs[name]
            how["kernel_name"] += 1
        elif ins is not None:                       # a loop's or command buffer's own memcpy / kernel
            label = "other"
            how["container"] += 1
        elif "nccl" in name.lower() and not BARRIER_KERNEL.search(name):
            label = "collective"
            how["nccl_name"] += 1
        else:
            label = "unattributed"
            how["none"] += 1
        if label is None:
            key = (ins.name, name)
            if key not in cache:
                cache[key] = hlo.classify(ins, name)
            label = cache[key]
        if label == "collective":
            comm.append(iv)
        else:
            comp.append(iv)
            ms[label] += dur
        top[label][(ins.name if ins is not None else name)[:60]] += dur
    total, hidden = collective_times(comm, comp)
    busy = merge(sorted(comm + comp))
    gaps = idle_gaps(busy, named, steps)
    ms = {k: v / steps / 1e3 for k, v in ms.items()}
    ms.update(collective_total=total / steps / 1e3, collective_exposed=(total - hidden) / steps / 1e3,
              idle=gaps["idle_ms"])
    span = (max(b for (_, b), _ in named) - min(a for (a, _), _ in named)) / steps / 1e3
    ms["detail"] = {"span_ms": span, "attributed_by": dict(how), "modules": dict(modules), "hlo_module": hlo.module,
                    "events": len(kernels), "largest_gaps": gaps["largest_gaps"],
                    "top": {c: [(n, round(t / steps / 1e3, 3)) for n, t in top[c].most_common(5)] for c in top}}
    return ms


def collective_counts(hlo_text: str) -> dict:
    """Collectives of a compiled (scheduled) HLO module's text: ``sync``, those XLA left synchronous (an all-gather,
    reduce-scatter, all-reduce, all-to-all or collective-permute instruction of its own: nothing is scheduled under
    it, so whatever it costs is exposed), and ``async``, those split into a start and a done with instructions
    scheduled between."""
    kinds = r"all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
    return {"sync": len(re.findall(rf" (?:{kinds})\(", hlo_text)),
            "async": len(re.findall(rf" (?:{kinds})-start\(", hlo_text))}


# ----------------------------------------------------------------------------------------------
# Table and plot
# ----------------------------------------------------------------------------------------------


def table(rows) -> str:
    """Markdown: one row per category, one column per config; ``rows``: (config name, ``breakdown`` dict) pairs in the
    order the columns should have (plain beside jaxquant). The last rows: the trace's span per step, and the compile
    time where a row's dict has ``compile_s``."""
    rows = [(n, b) for n, b in rows if b]
    if not rows:
        return ""
    out = ["| ms per step | " + " | ".join(n for n, _ in rows) + " |", "| --- |" + " ---: |" * len(rows)]
    for c in CATEGORIES:
        out.append(f"| {c} | " + " | ".join(f"{b.get(c, 0.0):.2f}" for _, b in rows) + " |")
    out.append("| trace span | " + " | ".join(f"{b.get('detail', {}).get('span_ms', float('nan')):.2f}"
                                              for _, b in rows) + " |")
    if any("compile_s" in b for _, b in rows):
        out.append("| compile s | " + " | ".join(f"{b['compile_s']:.1f}" if "compile_s" in b else "-"
                                                for _, b in rows) + " |")
    return "\n".join(out)


def plot(rows, png_path):
    """A stacked bar per config (``rows`` as ``table``'s) of the categories that do not overlap each other
    (``STACKED``: every category but ``collective_total``, whose hidden part runs under other kernels), written to
    ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(n, b) for n, b in rows if b]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 3), 5))
    bottom = [0.0] * len(rows)
    colors = plt.get_cmap("tab20").colors
    for i, c in enumerate(STACKED):
        vals = [b.get(c, 0.0) for _, b in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, label=c, color=colors[i % len(colors)])
        bottom = [x + v for x, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [n for n, _ in rows], rotation=30, ha="right")
    ax.set_ylabel("ms per step (GPU 0 kernels, summed)")
    ax.legend(fontsize=8, bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def scoped_optimizer(opt, name=OPTIMIZER_SCOPE):
    """optax ``opt`` whose ``update`` runs under ``jax.named_scope(name)``: its ops' metadata ``op_name`` then holds
    ``name`` and ``breakdown`` reports them as ``optimizer`` (names only: the compiled code is the same)."""
    import jax
    import optax

    def update(updates, state, params=None, **extra):
        with jax.named_scope(name):
            return opt.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(opt.init, update)


def report(results, profile_dir):
    """The benchmarks' end of a ``--profile`` run: the table of every result with a ``breakdown`` (a column per
    config, in run order; the flag set named where there are several) printed, and ``profile_dir/breakdown.png``."""
    ok = [r for r in results if r.get("breakdown")]
    if not ok:
        return None
    several = len({r["flags"] for r in ok}) > 1
    rows = [(r["config"] + (f" ({r['flags']})" if several else ""), r["breakdown"] | {"compile_s": r["compile_s"]})
            for r in ok]
    print("\nWhere the step's time goes (GPU 0's kernels, on the CPU device 0's thunks, by HLO op, ms per step; "
          "benchmarks/breakdown.py):")
    print(table(rows))
    unattributed = [(n, b["detail"]["attributed_by"]) for n, b in rows if b["detail"]["attributed_by"].get("none")]
    for n, how in unattributed:
        print(f"{n}: events attributed by {how} (none: no HLO op found, counted as unattributed)")
    return plot(rows, os.path.join(profile_dir, "breakdown.png"))
