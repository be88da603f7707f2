"""The cubin/SASS readers and the layout evaluator on small synthetic inputs (no compiler)."""

import struct

import pytest

from hopper_fmha.kernels import inspect
from hopper_fmha.kernels.layouts import compare, layout_values, parse_layout

pytestmark = pytest.mark.cpu


def synthetic_cubin(registers: int, frame: int, kernel: str = "my_kernel") -> bytes:
    """A minimal ELF64 with .strtab, .symtab and the .nv.info records ptxas writes."""
    strtab = b"\0" + kernel.encode() + b"\0"
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, 0, 0, 0)  # symbol 1: the kernel
    nv_info = (
        struct.pack("<BBHII", 0x04, 0x2F, 8, 1, registers)  # EIATTR_REGCOUNT
        + struct.pack("<BBH", 0x03, 0x1B, 255)  # a 4-byte record (EIATTR_MAXREG_COUNT) to skip
        + struct.pack("<BBHII", 0x04, 0x11, 8, 1, frame)  # EIATTR_FRAME_SIZE
    )
    names = [b"", b".shstrtab", b".strtab", b".symtab", b".nv.info"]
    shstrtab = b"\0".join(names) + b"\0"
    name_offsets = [shstrtab.index(n + b"\0") if n else 0 for n in names]
    data = [b"", shstrtab, strtab, symtab, nv_info]
    out = bytearray(64)
    offsets = []
    for d in data:
        offsets.append(len(out))
        out += d
    shoff = len(out)
    for name, d, offset in zip(name_offsets, data, offsets, strict=True):
        out += struct.pack("<IIQQQQIIQQ", name, 0, 0, 0, offset, len(d), 0, 0, 0, 0)
    out[:16] = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    struct.pack_into("<Q", out, 0x28, shoff)
    struct.pack_into("<HHH", out, 0x3A, 64, len(data), 1)
    return bytes(out)


def test_kernel_resources_reads_nv_info():
    assert inspect.kernel_resources(synthetic_cubin(236, 0)) == {
        "kernel": "my_kernel",
        "registers": 236,
        "stack_bytes": 0,
    }
    assert inspect.kernel_resources(synthetic_cubin(255, 1120))["stack_bytes"] == 1120


def test_kernel_resources_rejects_non_elf():
    with pytest.raises(ValueError, match="ELF"):
        inspect.kernel_resources(b"not a cubin")


# Lines as nvdisasm -c prints them for the paper kernel (trimmed), plus a predicated one.
SASS = """
        /*0bb0*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ, !UPT ;
        /*0bc0*/                   HGMMA.64x128x16.F32 R24, gdesc[UR12], R24, gsb0 ;
        /*0bd0*/                   HGMMA.64x64x16.F32.BF16 R88, R24, gdesc[UR4].tnspB, R88 ;
        /*0be0*/              @!P0 UTMALDG.4D [UR16], [UR6], desc[URZ] ;
        /*0bf0*/                   UTMASTG.4D [UR8], [UR4] ;
        /*0c00*/                   STL.64 [R1+0x8], R4 ;
        /*0c10*/                   LDL.LU R4, [R1+0x8] ;
        /*0c20*/                   UTMACCTL.PF [UR10] ;
"""


def test_sass_summary_counts():
    summary = inspect.sass_summary(SASS)
    assert summary == {
        "hgmma_ss": 2,
        "hgmma_rs": 1,
        "utmaldg": 1,
        "utmastg": 1,
        "ldl": 1,
        "stl": 1,
        "hgmma_shapes": ["64x64x16", "64x128x16"],
    }
    assert not inspect.paper_structure_ok(summary)  # it spills
    assert inspect.paper_structure_ok(summary | {"ldl": 0, "stl": 0})


def test_sass_without_nvdisasm_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(inspect, "find_nvdisasm", lambda: None)
    with pytest.raises(RuntimeError, match="pip install nvidia-cuda-nvdisasm"):
        inspect.sass(synthetic_cubin(1, 0))


def test_layout_values_colexicographic():
    assert layout_values((2, 3), (3, 1)) == [0, 3, 1, 4, 2, 5]
    assert layout_values(((2, 2), 2), ((1, 4), 2)) == [0, 1, 4, 5, 2, 3, 6, 7]


def test_size_one_mode_stride_is_irrelevant():
    # CuTe C++ prints a size-1 mode's stride as _0 where another printer may keep e.g. 64.
    paper = parse_layout("((_2,_2,_16),_1,_1):((_1,_2,_4),_0,_0)")
    assert paper == (((2, 2, 16), 1, 1), ((1, 2, 4), 0, 0))
    assert compare(paper, paper) == "identical"
    assert compare((paper[0], ((1, 2, 4), 64, 0)), paper) == "equivalent"
    assert compare((paper[0], ((1, 2, 8), 0, 0)), paper) == "DIFFERENT"
