"""What ptxas made of a kernel, read without a GPU: registers, stack, and the SASS instructions.

`compile_report()` compiles kernels for sm_90a and checks that each is the kernel the paper
describes: GEMM-I as SS-WGMMA (`HGMMA ... gdesc[..]` A operand: Q from shared memory), GEMM-II
as RS-WGMMA (`HGMMA ... R<n>` A operand: P from registers), TMA loads (`UTMALDG`), and no
local-memory traffic (`LDL`/`STL`: register spills).

Registers and stack come from the cubin's `.nv.info` section, where ptxas records them per
kernel: the "Used N registers" and "N bytes stack frame" of `ptxas -v` (checked against
`options="remarks{ptx}"`).
SASS needs nvdisasm >= the DSL's CUDA (13.4): `pip install nvidia-cuda-nvdisasm`.
"""

from __future__ import annotations

import collections
import importlib.metadata
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from .cache import KernelKey, compile_kernel

# `.nv.info` attributes (EIATTR_*); records are (format u8, attribute u8, payload), and for
# format EIFMT_SVAL the payload is a u16 size and that many bytes: here u32 symbol index, u32 value.
_EIFMT_SVAL = 0x04
_EIATTR_FRAME_SIZE = 0x11  # ptxas -v "N bytes stack frame" (1120 at d128 128x128, 0 without spills)
_EIATTR_REGCOUNT = 0x2F


def _elf_sections(cubin: bytes) -> dict[str, bytes]:
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file (a cubin)")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return cubin[start : cubin.index(b"\0", start)].decode()

    return {name(h[0]): cubin[h[4] : h[4] + h[5]] for h in headers}


def _symbol_names(symtab: bytes, strtab: bytes) -> list[str]:
    names = []
    for offset in range(0, len(symtab), 24):  # Elf64_Sym
        (st_name,) = struct.unpack_from("<I", symtab, offset)
        names.append(strtab[st_name : strtab.index(b"\0", st_name)].decode())
    return names


def kernel_resources(cubin: bytes) -> dict:
    """{"kernel", "registers", "stack_bytes"} of the one kernel in `cubin` (registers per thread)."""
    sections = _elf_sections(cubin)
    info = sections.get(".nv.info")
    if info is None:
        raise ValueError("cubin has no .nv.info section")
    per_symbol: dict[int, dict[int, int]] = collections.defaultdict(dict)
    i = 0
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt != _EIFMT_SVAL:  # EIFMT_NVAL/BVAL/HVAL: 4 bytes in all
            i += 4
            continue
        (size,) = struct.unpack_from("<H", info, i + 2)
        if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
            symbol, value = struct.unpack_from("<II", info, i + 4)
            per_symbol[symbol][attr] = value
        i += 4 + size
    kernels = {s: a for s, a in per_symbol.items() if _EIATTR_REGCOUNT in a}
    if len(kernels) != 1:
        raise ValueError(f"expected one kernel with a register count in .nv.info, found {len(kernels)}")
    ((symbol, attrs),) = kernels.items()
    names = _symbol_names(sections.get(".symtab", b""), sections.get(".strtab", b""))
    return {
        "kernel": names[symbol] if symbol < len(names) else f"symbol {symbol}",
        "registers": attrs[_EIATTR_REGCOUNT],
        "stack_bytes": attrs.get(_EIATTR_FRAME_SIZE, 0),
    }


def find_nvdisasm() -> str | None:
    """nvdisasm from the nvidia-cuda-nvdisasm wheel, else $CUDA_HOME/bin, else PATH."""
    try:
        dist = importlib.metadata.distribution("nvidia-cuda-nvdisasm")
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f)))
            if f.name == "nvdisasm" and path.is_file():
                return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvdisasm").is_file():
            return str(Path(root) / "bin" / "nvdisasm")
    return shutil.which("nvdisasm")


def sass(cubin: bytes) -> str:
    """The SASS of `cubin` (nvdisasm -c). Raises RuntimeError if nvdisasm is missing or fails."""
    binary = find_nvdisasm()
    if binary is None:
        raise RuntimeError(
            "nvdisasm not found: `pip install nvidia-cuda-nvdisasm` (>= 13.4, the DSL's CUDA), "
            "or set CUDA_HOME to a CUDA >= 13.4 toolkit"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        result = subprocess.run([binary, "-c", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{binary} -c failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


# `/*0bb0*/  @!P0 HGMMA.64x128x16.F32 R24, gdesc[UR12], RZ, !UPT ;`: opcode and operands.
_INSTRUCTION = re.compile(
    r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]*)?\s*([^;]*);", re.M
)
_HGMMA_SHAPE = re.compile(r"^\.(\d+x\d+x\d+)")


def sass_summary(sass_text: str) -> dict:
    """Instruction counts that tell the paper kernel's structure, and the HGMMA shapes used.

    hgmma_ss: WGMMAs with A from shared memory (descriptor operand); hgmma_rs: A from registers.
    """
    counts = collections.Counter()
    shapes = set()
    for opcode, modifiers, operands in _INSTRUCTION.findall(sass_text):
        if opcode == "HGMMA":
            a_operand = operands.split(",")[1].strip() if "," in operands else ""
            counts["hgmma_rs" if re.fullmatch(r"R\d+", a_operand) else "hgmma_ss"] += 1
            shape = _HGMMA_SHAPE.match(modifiers or "")
            if shape:
                shapes.add(shape.group(1))
        elif opcode in ("UTMALDG", "UTMASTG", "LDL", "STL"):
            counts[opcode.lower()] += 1
    summary = {name: counts[name] for name in ("hgmma_ss", "hgmma_rs", "utmaldg", "utmastg", "ldl", "stl")}
    summary["hgmma_shapes"] = sorted(shapes, key=lambda s: tuple(int(x) for x in s.split("x")))
    return summary


def paper_structure_ok(summary: dict) -> bool:
    """SS-WGMMA (GEMM-I) and RS-WGMMA (GEMM-II) present, TMA loads present, no spills."""
    return bool(summary["hgmma_ss"] and summary["hgmma_rs"] and summary["utmaldg"]) and not (
        summary["ldl"] or summary["stl"]
    )


def inspect_kernel(key: KernelKey) -> dict:
    """Compile `key` for sm_90a (timed) and report its resources and SASS structure.

    The SASS fields are absent and `ok` is None when nvdisasm is not installed.
    """
    with tempfile.TemporaryDirectory() as dump_dir:  # --keep-cubin also writes the file there
        t0 = time.perf_counter()
        compiled = compile_kernel(key, options=f"--keep-cubin --dump-dir={dump_dir}")
        seconds = time.perf_counter() - t0
    resources = kernel_resources(compiled.artifacts.CUBIN)
    row = {
        "config": key.slug(),
        "compile_s": seconds,
        "registers": resources["registers"],
        "stack_bytes": resources["stack_bytes"],
    }
    try:
        summary = sass_summary(sass(compiled.artifacts.CUBIN))
    except RuntimeError as e:
        row["ok"] = None
        row["note"] = str(e)
        return row
    row.update(summary)
    row["hgmma_shapes"] = " ".join(summary["hgmma_shapes"])
    row["ok"] = paper_structure_ok(summary)
    return row


def shipped_keys(dtype: str = "float16", causal: bool = False, variants=("paper",)) -> list[KernelKey]:
    """One key per variant and head dim: the configuration `config.select_config` picks for it, as
    `flash_attn_func` launches it without return_lse."""
    from hopper_fmha.config import SUPPORTED_HEAD_DIMS, launch_config, select_config

    configs = [select_config(d, variant) for variant in variants for d in SUPPORTED_HEAD_DIMS]
    return [
        KernelKey.from_config(
            dtype, causal, launch_config(cfg, causal, 4096, exact_lse=False) if cfg.variant == "ws" else cfg
        )
        for cfg in configs
    ]


def compile_report(keys: list[KernelKey] | None = None) -> list[dict]:
    """`inspect_kernel` for each key (default: both variants' shipped configs); a failed compile is a row
    with `error`."""
    rows = []
    for key in shipped_keys(variants=("paper", "ws")) if keys is None else keys:
        try:
            rows.append(inspect_kernel(key))
        except Exception as e:
            rows.append({"config": key.slug(), "ok": False, "error": f"{type(e).__name__}: {e}"})
    return rows
