"""scripts/train_gpt.py on CPU: a tiny GPT trains with SDPA, the JSON and PNG are written, the
`both` path runs (hopper stood in for by SDPA), and the agreement rule accepts equal curves and
rejects different ones. The GPU run differs in the attention, the sizes and bf16 autocast."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_torch_thread")]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_gpt.py"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

# 2 layers, d_model 64, seqlen 32, vocab 32: about a second of training per 30 steps.
TINY = [
    "--device", "cpu", "--steps", "30", "--layers", "2", "--d-model", "64", "--heads", "2",
    "--seqlen", "32", "--batch", "8", "--vocab", "32", "--lr", "3e-3",
    "--warmup", "5", "--window", "5", "--min-drop", "0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["train_gpt"]


def test_sdpa_trains_and_writes_outputs(train_gpt, tmp_path, capsys):
    assert train_gpt.main([*TINY, "--attention", "sdpa", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "train_gpt.json").read_text())
    losses = result["runs"]["sdpa"]["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(32), abs=0.3)  # starts near uniform
    assert result["runs"]["sdpa"]["final_loss"] < 0.9 * losses[0]
    assert result["runs"]["sdpa"]["tokens_per_s"] > 0
    assert result["ok"] and result["config"]["d_model"] == 64 and result["dtype"] == "fp32"
    assert {"torch", "device", "hopper_fmha", "git_commit"} <= result["environment"].keys()
    printed = capsys.readouterr().out
    assert "PASS" in printed
    if HAVE_MATPLOTLIB:  # the plot (the bench extra); without it the run says so and passes
        png = (tmp_path / "train_gpt.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) < 60_000
    else:
        assert not (tmp_path / "train_gpt.png").exists() and "no plot: matplotlib" in printed


def test_both_with_sdpa_standing_in_for_hopper(train_gpt, tmp_path, monkeypatch):
    """The `both` path (gradient check, two runs, comparison, two-curve plot) on CPU: 'hopper' is
    SDPA here, so the runs are bit-identical and must agree."""
    monkeypatch.setattr(train_gpt, "get_attention", lambda name, device, cfg: train_gpt.sdpa_attention)
    assert train_gpt.main([*TINY, "--steps", "25", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "train_gpt.json").read_text())
    assert result["runs"]["hopper"]["losses"] == result["runs"]["sdpa"]["losses"]
    assert result["comparison"]["agree"] and result["comparison"]["max_abs_diff_smoothed"] == 0
    assert result["gradient_check"]["ok"]
    # fp32 on CPU: the candidate's gradients are the reference's.
    assert result["gradient_check"]["rel_err"]["hopper"] < 1e-5
    assert not HAVE_MATPLOTLIB or (tmp_path / "train_gpt.png").stat().st_size < 60_000


def test_hopper_without_a_hopper_gpu_exits_cleanly(train_gpt, capsys):
    assert train_gpt.main([*TINY, "--attention", "hopper"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err


def test_agreement_rule(train_gpt):
    curve = [1.0 + 5.0 * math.exp(-i / 10) for i in range(100)]
    assert train_gpt.curves_agree(curve, list(curve))
    assert train_gpt.curves_agree([x * 1.01 for x in curve], curve)  # 1% apart: within 2%
    assert not train_gpt.curves_agree([x * 1.5 for x in curve], curve)  # far apart at the end
    assert not train_gpt.curves_agree([6.0] * 100, [6.0] * 100)  # equal, but neither trained
    assert not train_gpt.curves_agree([*curve[:-1], math.nan], curve)  # a non-finite loss
    assert train_gpt.smooth([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]
