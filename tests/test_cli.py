"""The CLI: `info` and `demo` tell what happened on this machine, and the exit code agrees."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hopper_fmha
from hopper_fmha import cli
from hopper_fmha.reference import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
no_hopper = pytest.mark.skipif(HOPPER, reason="on a Hopper GPU the demo runs the kernel (gpu tier)")
SRC = str(Path(hopper_fmha.__file__).resolve().parents[1])


def run_module(*args):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "hopper_fmha", *args], capture_output=True, text=True, env=env, timeout=900
    )


@pytest.mark.cpu
def test_info(capsys):
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"torch               {torch.__version__}" in text
    assert "nvidia-cutlass-dsl  4.8.1" in text
    if not torch.cuda.is_available():
        assert "no CUDA GPU found" in text
    if HOPPER:
        assert "can run here (sm_90)" in text
    else:
        assert "compile only here" in text or "unavailable" in text


@pytest.mark.cpu
def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


@pytest.mark.cpu
def test_python_dash_m():
    result = run_module("info")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hopper-fmha")


# ---- demo without a Hopper GPU ----


def fake_kernels(monkeypatch, **attrs):
    monkeypatch.setattr(cli, "_import_kernels", lambda: (SimpleNamespace(**attrs), None))


@pytest.mark.cpu
@no_hopper
def test_demo_cpu_without_compile_report(monkeypatch, capsys):
    fake_kernels(monkeypatch)
    assert cli.main(["demo"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("No Hopper GPU here")
    assert text.count(" ok\n") == 2  # emulator vs reference, non-causal and causal
    assert "no compile_report() yet: no kernel was compiled" in text
    assert "demo passed (CPU only: no kernel was run)" in text


@pytest.mark.cpu
@no_hopper
def test_demo_cpu_prints_compile_report(monkeypatch, capsys):
    report = [
        {"kernel": "paper_float16_d64_128x64_full", "ok": True, "seconds": 1.25},
        {"kernel": "paper_float16_d128_64x128_causal", "ok": True, "seconds": 2.5},
    ]
    fake_kernels(monkeypatch, compile_report=lambda: report)
    assert cli.main(["demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("kernel "))
    assert lines[header].split() == ["kernel", "ok", "seconds"]
    assert lines[header + 1].split() == ["paper_float16_d64_128x64_full", "True", "1.25"]


@pytest.mark.cpu
@no_hopper
@pytest.mark.parametrize(
    "kernels",
    [
        pytest.param(dict(compile_report=lambda: [{"kernel": "a", "ok": False}]), id="kernel-not-ok"),
        pytest.param(
            dict(compile_report=lambda: {"kernel": "a", "error": "ptxas: too many resources"}), id="error"
        ),
        pytest.param(dict(compile_report=lambda: 1 / 0), id="report-raises"),
    ],
)
def test_demo_cpu_fails_when_compile_fails(monkeypatch, capsys, kernels):
    fake_kernels(monkeypatch, **kernels)
    assert cli.main(["demo"]) == 1
    assert "demo FAILED" in capsys.readouterr().out


@pytest.mark.cpu
@no_hopper
def test_demo_cpu_fails_when_kernels_do_not_import(monkeypatch, capsys):
    monkeypatch.setattr(
        cli, "_import_kernels", lambda: (None, "ModuleNotFoundError: No module named 'cutlass'")
    )
    assert cli.main(["demo"]) == 1
    assert "cannot be imported, so no kernel was compiled" in capsys.readouterr().out


@pytest.mark.cpu
@no_hopper
def test_demo_cpu_fails_when_emulator_is_off(monkeypatch, capsys):
    fake_kernels(monkeypatch)
    monkeypatch.setattr(cli, "CPU_DEMO_TOL", -1.0)  # no error can pass
    assert cli.main(["demo"]) == 1
    assert capsys.readouterr().out.count("FAIL (tolerance -1.0)") == 2


@pytest.mark.compile
@no_hopper
def test_demo_subprocess_with_real_kernels():
    # The real kernels package: compiles whatever its compile_report() covers.
    result = run_module("demo")
    # The lines that say what failed first: pytest cuts a long message from its start.
    failed = [line for line in result.stdout.splitlines() if "FAIL" in line or "err" in line]
    assert result.returncode == 0, "\n".join(failed) + "\n" + result.stdout + result.stderr
    assert "demo passed (CPU only: no kernel was run)" in result.stdout


# ---- the Hopper demo's checks, driven on CPU with a stand-in kernel ----


def demo_args():
    return SimpleNamespace(batch=1, seqlen=67, heads=2, head_dim=64, dtype="float16", warmup=1, repeats=3)


@pytest.mark.cpu
@pytest.mark.parametrize("offset,code", [(0.0, 0), (0.01, 1)], ids=["exact", "off-by-0.01"])
def test_demo_gpu_checks_against_reference(monkeypatch, capsys, offset, code):
    def fake_flash_attn_func(q, k, v, causal=False, return_lse=False):
        out, lse = reference(q, k, v, causal=causal)
        out = (out + offset).to(q.dtype)
        return (out, lse) if return_lse else out

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", fake_flash_attn_func)
    monkeypatch.setattr(cli, "_time_ms", lambda fn, warmup, repeats: (fn(), 2.0)[1])
    assert cli._demo_gpu(demo_args(), torch.device("cpu")) == code
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("causal "))
    assert [line.split()[0] for line in lines[header + 1 : header + 3]] == ["False", "True"]
    assert ("demo passed" in lines) == (code == 0)
    # 4·B·H·N²·d FLOPs in 2 ms, halved for causal
    tflops = 4 * 2 * 67 * 67 * 64 / 2e-3 / 1e12
    assert f"{tflops:.3g}" in lines[header + 1] and f"{tflops / 2:.3g}" in lines[header + 2]


@pytest.mark.gpu
def test_demo_on_hopper(capsys):
    assert cli.main(["demo", "--repeats", "3"]) == 0
    assert "demo passed" in capsys.readouterr().out


# ---- extension subcommands ----


@pytest.mark.cpu
def test_extensions(monkeypatch, tmp_path, capsys):
    (tmp_path / "fmha_ext_ok.py").write_text(
        "def register(subparsers):\n"
        "    p = subparsers.add_parser('hello')\n"
        "    p.set_defaults(func=lambda args: print('hello from ext') or 7)\n"
    )
    (tmp_path / "fmha_ext_broken.py").write_text("import fmha_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(
        cli,
        "EXTENSIONS",
        (("hello", "fmha_ext_ok"), ("broken", "fmha_ext_broken"), ("missing", "fmha_ext_missing")),
    )
    assert cli.main(["hello"]) == 7
    assert capsys.readouterr().out == "hello from ext\n"
    assert cli.main(["broken"]) == 1
    assert "fmha_dependency_that_is_not_installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a module not written yet adds no subcommand
        cli.main(["missing"])
