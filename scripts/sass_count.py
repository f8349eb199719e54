#!/usr/bin/env python3
"""SASS instruction counts of the CUDA kernels, without a GPU: compiles the CUDA sources for one
architecture (build.py's flags), disassembles them with cuobjdump and prints each matching kernel's
instruction count and its most frequent opcodes, with a split into the integer/logic (ALU) and FMA
pipes. On an H200 the software E2M1 casts are bound by the ALU pipe (ncu: 65-76% busy), so
moving work to the FMA pipe shows here before a GPU run times it; on an H100 they are memory-bound.

  python3 scripts/sass_count.py --kernel 'nvfp4_quantize_kernel<1, 0, 1>' [--base HEAD~1] [--arch sm_90]

--base REV also compiles csrc/ as it is at git revision REV and prints both. cuobjdump comes from
$CUOBJDUMP, PATH, or the CUDA toolkit; without one, `pip download nvidia-cuda-cuobjdump` has it.
--kernel is a regex on the mangled name; a pattern `name<1, 0, 1>` also matches the mangled bool
template arguments `nameILb1ELb0ELb1E`. VIADD, whose pipe is not documented, counts in neither pipe.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import build  # noqa: E402  (the repository's build script: same flags as the extension)

# Opcodes by pipe (Hopper): the ALU pipe (logic, permute, shift, integer add/compare/min/max, float
# min/max) does 16 lanes a cycle per SM sub-partition; the FMA pipe 32 for FFMA/FMUL/FADD and 16 for IMAD
# (CUDA programming guide throughput table: 64 integer multiply-adds per clock per SM).
ALU = {"LOP3", "PRMT", "LEA", "IADD3", "VIMNMX", "IMNMX", "FMNMX", "ISETP", "FSETP", "SHF", "SEL", "FSEL", "PLOP3"}
FMA = {"FFMA", "FMUL", "FADD", "IMAD", "HFMA2"}


def find_cuobjdump() -> str:
    for candidate in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")):
        if candidate:
            return candidate
    nvcc = build.find_nvcc()
    if nvcc and (build.cuda_home(nvcc) / "bin" / "cuobjdump").exists():
        return str(build.cuda_home(nvcc) / "bin" / "cuobjdump")
    raise SystemExit("cuobjdump not found: set $CUOBJDUMP (pip download nvidia-cuda-cuobjdump has one)")


def compile_sass(csrc: Path, arch: str) -> str:
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found")
    flags = [f for f in build._common_flags("_jaxquant_cuda", "Cuda", arch) if f != "-fPIC"]
    flags = [f"-I{csrc}" if f == f"-I{build.CSRC}" else f for f in flags]
    cuobjdump, out = find_cuobjdump(), []
    with tempfile.TemporaryDirectory() as tmp:
        for source in build.CUDA_SOURCES:
            cubin = Path(tmp) / (source.stem + ".cubin")
            subprocess.run([nvcc, *flags, "-fmad=false", f"-arch={arch}", "-cubin", str(csrc / source.name),
                            "-o", str(cubin)], check=True, capture_output=True)
            out.append(subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                                      text=True).stdout)
    return "\n".join(out)


def kernel_counts(sass: str, pattern: str) -> dict[str, collections.Counter]:
    mangled = re.sub(r"<([^>]*)>", lambda m: "I" + "".join(f"Lb{v.strip()}E" for v in m.group(1).split(",")) + "E",
                     pattern)
    result = {}
    for block in sass.split("Function : ")[1:]:
        name = block.split("\n", 1)[0].strip()
        if not (re.search(pattern, name) or mangled in name):
            continue
        ops = collections.Counter()
        for line in block.splitlines():
            m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m:
                ops[m.group(1)] += 1
        result[name] = ops
    return result


def report(label: str, counts: dict[str, collections.Counter]) -> None:
    for name, ops in counts.items():
        total, alu, fma = sum(ops.values()), sum(ops[o] for o in ALU), sum(ops[o] for o in FMA)
        print(f"{label}: {name}\n  {total} instructions, ALU pipe {alu}, FMA pipe {fma}; "
              + ", ".join(f"{o} {n}" for o, n in ops.most_common(12)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", required=True, help="regex on the mangled name, or name<args> as above")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--base", help="git revision whose csrc/ to compare against")
    args = parser.parse_args()
    builds = [("this tree", build.CSRC)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.base, "csrc"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            builds.insert(0, (args.base, Path(tmp) / "csrc"))
        for label, csrc in builds:
            counts = kernel_counts(compile_sass(csrc, args.arch), args.kernel)
            if not counts:
                raise SystemExit(f"{label}: no kernel matches {args.kernel!r}")
            report(label, counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
