"""The SASS check of .ci/compile_cuda.sh: it flags the uniform-register reads ptxas 13.0 left unwritten in
lqe-w4a16-mma (an illegal instruction on the H200) and nothing in a kernel whose registers are all written."""
import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_check", ROOT / ".ci" / "sass_check.py")
sass_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_check)

# Excerpts of cuobjdump -sass output of csrc/gemm/w4a16_mma.cu (sm_90a, nvcc 13.0), encodings cut.
BROKEN = """
        Function : _ZN3lqe16w4a16_mma_kernelI6__halfLi4ELi1EEEvNS0_7MmaArgsE
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0130*/                   UMOV UR8, 0xf0 ;
        /*0170*/                   USHF.L.U32 UR9, UR9, 0x14, URZ ;
        /*02f0*/                   ULDC.64 UR16, c[0x0][0x208] ;
        /*0790*/              @!PT LDS RZ, [RZ] ;
        /*07a0*/                   LDGSTS.E.BYPASS.128 [R118+UR0], desc[UR1][R6.64] ;
        /*08f0*/                   LDGSTS.E.BYPASS.128 [R111+0x2000], desc[UR16][R6.64], P0 ;
        /*0900*/                   EXIT ;
"""
FIXED = """
        Function : _ZN3lqe16w4a16_mma_kernelI6__halfLi4ELi1EEEvNS0_7MmaArgsE
        /*0130*/                   UMOV UR8, 0xf0 ;
        /*0170*/                   USHF.L.U32 UR9, UR9, 0x14, URZ ;
        /*02f0*/                   ULDC.64 UR16, c[0x0][0x208] ;
        /*07a0*/                   LDGSTS.E.BYPASS.128 [R118], desc[UR8][R6.64] ;
        /*07b0*/               @P1 LDGSTS.E.BYPASS.128 [R118+0x800], desc[UR8][R10.64+-0x800] ;
        /*08f0*/                   LDGSTS.E.BYPASS.128 [R111+0x2000], desc[UR16][R6.64], P0 ;
        /*0900*/                   IADD3 R4, P0, R2, UR16, RZ ;
        /*0910*/                   EXIT ;
        Function : _ZN3lqe5otherEv
        /*0000*/                   S2UR UR7, SR_CTAID.X ;
        /*0010*/                   UIMAD.WIDE UR14, UR7, 0x2000, URZ ;
        /*0020*/                   IADD3 R19, P0, RZ, -UR15, RZ ;
"""


def test_flags_the_unwritten_registers_of_the_miscompiled_copy():
    problems = sass_check.check(BROKEN)
    assert len(problems) == 1
    assert "/*07a0*/" in problems[0] and "UR0, UR1, UR2 never written" in problems[0]


def test_passes_when_every_read_is_written_in_its_own_function():
    assert sass_check.check(FIXED) == []  # desc pairs, .64 / .WIDE destinations, S2UR, predicated instructions


def test_registers_are_per_function():
    # UR16 written in the first function does not cover a read in the second
    text = FIXED + "        /*0030*/                   IADD3 R4, P0, R2, UR16, RZ ;\n"
    problems = sass_check.check(text)
    assert len(problems) == 1 and "_ZN3lqe5otherEv" in problems[0] and "UR16 never written" in problems[0]


def test_command_line_exit_codes():
    def run(text):
        return subprocess.run([sys.executable, str(ROOT / ".ci" / "sass_check.py"), "--name", "x.cu"],
                              input=text, capture_output=True, text=True)
    bad, good, empty = run(BROKEN), run(FIXED), run("no sass here\n")
    assert bad.returncode == 1 and "x.cu" in bad.stdout and "UR1" in bad.stdout
    assert good.returncode == 0 and good.stdout == ""
    assert empty.returncode == 2 and "no SASS" in empty.stderr


# A PDL kernel's shape (wna16_gemm_kernel, sm_90a): a block with no tile waits and leaves; the others stream their
# first weights (LDG.NA.128, CCTL prefetch, LDGSTS), wait (ACQBULK), then read the activations and store.
PDL_OK = """
        Function : _ZN3lqe17wna16_gemm_kernelEv
        /*0000*/                   ISETP.GE.AND P0, PT, R98, R95, PT ;
        /*0010*/              @!P0 BRA 0x50 ;
        /*0020*/                   ACQBULK ;
        /*0030*/                   PREEXIT ;
        /*0040*/                   BRA 0xb0 ;
        /*0050*/                   LDG.E.NA.128.CONSTANT R8, desc[UR8][R8.64] ;
        /*0060*/                   CCTL.E.PF1 [R28] ;
        /*0070*/                   LDGSTS.E.BYPASS.128 [R5+0x1000], desc[UR8][R96.64] ;
        /*0080*/                   LDGDEPBAR ;
        /*0090*/                   ACQBULK ;
        /*00a0*/                   LDG.E.CONSTANT R116, desc[UR8][R12.64] ;
        /*00b0*/                   STG.E.64 desc[UR8][R2.64], R4 ;
        /*00c0*/                   EXIT ;
        Function : _ZN3lqe5plainEv
        /*0000*/                   LDG.E.CONSTANT R1, desc[UR8][R2.64] ;
        /*0010*/                   EXIT ;
"""


def test_pdl_paths_all_wait_before_any_global_access():
    assert sass_check.check_pdl(PDL_OK) == []  # (plain: no ACQBULK, not a PDL kernel)


def test_pdl_flags_an_activation_load_hoisted_above_the_wait():
    hoisted = PDL_OK.replace("/*0060*/                   CCTL.E.PF1 [R28] ;",
                             "/*0060*/                   LDG.E.CONSTANT R116, desc[UR8][R12.64] ;")
    problems = sass_check.check_pdl(hoisted)
    assert len(problems) == 1 and "/*0060*/ LDG.E.CONSTANT" in problems[0], problems


def test_pdl_flags_a_path_that_skips_the_wait():
    # the no-tile block branches straight to the store and exit: its path never waits (the predicated wait does not
    # count either)
    skipped = PDL_OK.replace("/*0010*/              @!P0 BRA 0x50 ;", "/*0010*/              @!P0 BRA 0x50 ;\n"
                             "        /*0015*/               @P1 BRA 0xb0 ;")
    problems = sass_check.check_pdl(skipped)
    assert [p.split()[1] for p in problems] == ["/*00b0*/", "/*00c0*/"], problems
    predicated = PDL_OK.replace("/*0090*/                   ACQBULK ;", "/*0090*/               @P2 ACQBULK ;")
    assert [p.split()[1] for p in sass_check.check_pdl(predicated)] == ["/*00a0*/", "/*00b0*/", "/*00c0*/"]
