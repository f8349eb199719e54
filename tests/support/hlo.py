"""Readers of lowered (StableHLO) and compiled (HLO) program text: the collectives and GEMMs a program runs."""

import math
import re


def replica_group_size(line: str) -> int:
    """Devices per replica group, in the three spellings of XLA's HLO printer: explicit lists
    ``{{0,1},{2,3}}``, iota ``[groups,size]<=[n]``, and mesh axes ``mesh['fsdp'=1,'tp'=2] {'tp'}``
    (XLA:GPU, jaxlib 0.11); -1 if the line has none."""
    groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if groups:
        return len(groups.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        sizes = {k.strip("'"): int(v) for k, v in re.findall(r"('[^']+')=(\d+)", mesh.group(1))}
        return math.prod(sizes[a.strip().strip("'")] for a in mesh.group(2).split(",") if a.strip())
    return -1


def collectives(hlo: str) -> list[tuple[str, str, int]]:
    """(kind, result type, replica group size) of every all-gather / all-reduce / all-to-all /
    collective-permute in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        hit = re.search(r"=\s*(\S+)\s+(all-gather|all-reduce|all-to-all|collective-permute)(?:-start)?\(", line)
        if not hit:
            continue
        size = replica_group_size(line)
        found.append((hit.group(2), hit.group(1), size))
    return found


def collective_types(text, name):
    """(operand type, result type) of every ``stablehlo.<name>`` in a lowered module's text."""
    out = []
    for m in re.finditer(rf'"stablehlo\.{name}"', text):
        sig = re.search(r"\}\) : \((tensor<[^>]*>)\) -> (tensor<[^>]*>)", text[m.end():])
        out.append(sig.groups())
    return out


def gemms(hlo: str) -> list:
    """(backend, operand element types) of each GEMM of compiled GPU HLO: cuBLAS custom calls and
    Triton GEMM fusions (XLA's autotuner picks between them per GEMM; jaxlib 0.11 on 2 GPUs names them
    ``__triton_nested_gemm_fusion``). A fusion's operand types are read from its computation's header,
    since the call site names its operands without types."""
    found = []
    for line in hlo.splitlines():
        if "custom-call(" in line and "__cublas" in line:
            kind = re.search(r'custom_call_target="([^"]+)"', line).group(1)
            operands = line.split("custom-call(", 1)[1].split("), ", 1)[0]
        elif " fusion(" in line and re.search(r'"kind":"__triton\w*gemm\w*"', line):
            kind = "triton_gemm"
            callee = re.search(r"calls=(%[\w.-]+)", line).group(1)
            header = re.search(rf"^\s*{re.escape(callee)} \((.*)\) ->", hlo, re.M)
            operands = header.group(1) if header else ""
        else:
            continue
        found.append((kind, tuple(sorted(set(re.findall(r"\b(f8e4m3fn|f8e5m2|bf16|f16|f32)\[", operands))))))
    return found


def max_reductions(text: str) -> list[str]:
    """Operand types of every ``stablehlo.all_reduce`` whose reduction is a maximum, in a lowered module's text (the
    amax reductions of the casts)."""
    out = []
    for m in re.finditer(r'"stablehlo\.all_reduce"', text):
        region = text[m.end(): m.end() + 600]
        sig = re.search(r"\}\) : \((tensor<[^>]*>)\) -> (tensor<[^>]*>)", region)
        if "stablehlo.maximum" in region[: sig.start() if sig else 600]:
            out.append(sig.group(1) if sig else "?")
    return out
