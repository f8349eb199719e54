"""scripts/sass_count.py reads cuobjdump's SASS listing: per kernel, the opcode counts (predicates and
modifiers stripped) and the match of `name<1, 0, 1>` against the mangled bool template arguments."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SASS = """
        code for sm_90
                Function : _ZN8jaxquant6kernelILb1ELb0ELb1EEEvPKv
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   FFMA R2, R3, 6291307, R4 ;             /* 0x4ac0006b03027823 */
        /*0020*/               @!P0 FMUL R5, R6, 0.5 ;                    /* 0x3f00000006058820 */
        /*0030*/                   LOP3.LUT R7, R7, 0x7f800000, RZ, 0xc0, !PT ;
        /*0040*/                   LOP3.LUT R8, R8, 0xffff0000, RZ, 0xc0, !PT ;
        /*0050*/                   LEA.HI R9, R9, R9, RZ, 0xa ;
                ..........
                Function : _ZN8jaxquant6kernelILb1ELb0ELb0EEEvPKv
        /*0000*/                   LOP3.LUT R7, R7, 0x7f800000, RZ, 0xc0, !PT ;
"""


def _load():
    spec = importlib.util.spec_from_file_location("sass_count", ROOT / "scripts" / "sass_count.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sass_count_counts_opcodes_of_the_matching_kernel():
    sass_count = _load()
    counts = sass_count.kernel_counts(SASS, "kernel<1, 0, 1>")
    assert list(counts) == ["_ZN8jaxquant6kernelILb1ELb0ELb1EEEvPKv"]
    ops = counts["_ZN8jaxquant6kernelILb1ELb0ELb1EEEvPKv"]
    assert ops == {"LDC": 1, "FFMA": 1, "FMUL": 1, "LOP3": 2, "LEA": 1}
    assert sum(ops[o] for o in sass_count.ALU) == 3 and sum(ops[o] for o in sass_count.FMA) == 2
    assert len(sass_count.kernel_counts(SASS, "kernelILb1ELb0ELb")) == 2  # a plain regex matches both
