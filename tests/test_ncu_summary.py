"""scripts/ncu_sass_summary.py (CPU tier): opcodes of SASS lines and the per-opcode sums of a
source-page CSV, on a small synthetic one in ncu's layout."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

_path = Path(__file__).parent.parent / "scripts" / "ncu_sass_summary.py"
_spec = importlib.util.spec_from_file_location("ncu_sass_summary", _path)
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

CSV = """"Kernel Name","kernel_ours"
"Address","Source","Instructions Executed","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier"
"0x10","@P0 FMUL R1, R2, R3","1,000","50","10","5"
"0x20","FMUL R4, R2, R3","500","20","2","1"
"0x30","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2","300","10","0","9"
"0x40","@!UP1 STS [R1], R2","200","4","1","0"
"""


def test_opcode_drops_predicates_keeps_or_drops_modifiers():
    assert summary.opcode("@!UP1 STS.128 [R1], R4", base=False) == "STS.128"
    assert summary.opcode("@P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", base=True) == "SYNCS"
    assert summary.opcode("@PT BRA `(.L_x_3)", base=False) == "BRA"
    assert summary.opcode("   ", base=False) == ""


def test_sums_by_opcode_and_stall_shares(tmp_path, capsys):
    path = tmp_path / "ours.csv"
    path.write_text(CSV)
    kernel, header, sums = summary.read(str(path), base=False)
    assert "kernel_ours" in kernel and header[1] == "Source"
    expected = {"FMUL": 1500.0, "SYNCS.PHASECHK.TRANS64.TRYWAIT": 300.0, "STS": 200.0}
    assert dict(sums["Instructions Executed"]) == expected
    summary.main([str(path), str(path), "--metric", "executed"])
    out = capsys.readouterr().out
    assert "diff             +0" in out.replace(",", "")
    # stall reasons only (not the sampling totals): long_sb 13 of 28, barrier 15 of 28
    assert "stall_barrier" in out and "53.6%" in out and "46.4%" in out
    assert "Sampling (All Samples)" not in out.split("stall columns")[1]
    with pytest.raises(SystemExit, match="matches"):
        summary.main([str(path), "--metric", "stall"])  # more than one header
