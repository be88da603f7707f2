"""Test tiers (markers in pyproject.toml): cpu runs anywhere, compile needs the CuTe DSL, gpu a Hopper.

Plain `pytest` runs every tier the machine can and skips the rest with the reason.
"""

import importlib.util
import os
import zlib

import pytest
import torch


def _hopper_present() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


HOPPER = _hopper_present()
if not torch.cuda.is_available():
    # The DSL snapshots its environment at import: the target must be set before `import cutlass`
    # so that kernels compile for sm_90a on a machine with no GPU to query.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _gpu_skip_reason() -> str:
    if not torch.cuda.is_available():
        return "needs a Hopper GPU (sm_90); no CUDA GPU found"
    major, minor = torch.cuda.get_device_capability()
    return f"needs a Hopper GPU (sm_90); found {torch.cuda.get_device_name()} (sm_{major}{minor})"


def _cutlass_missing() -> str | None:
    if importlib.util.find_spec("cutlass") is None:
        return "needs the CuTe DSL (pip install nvidia-cutlass-dsl); `cutlass` not found"
    try:
        import cutlass  # noqa: F401
    except Exception as e:  # an installed but broken DSL must skip with its reason, not error
        return f"needs the CuTe DSL; `import cutlass` failed: {type(e).__name__}: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    if not HOPPER:
        skip_gpu = pytest.mark.skip(reason=_gpu_skip_reason())
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    if any("compile" in item.keywords for item in items):
        reason = _cutlass_missing()
        if reason is not None:
            skip_compile = pytest.mark.skip(reason=reason)
            for item in items:
                if "compile" in item.keywords:
                    item.add_marker(skip_compile)


@pytest.fixture(scope="session")
def _session_kernel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(autouse=True)
def _private_kernel_cache(request, monkeypatch, _session_kernel_cache):
    """Tests without the GPU keep compiled kernels in a disk cache of this session's own: host
    tests stand in for kernels by patching their compile functions, which a kernel a GPU run
    saved under ~/.cache (or $HOPPER_FMHA_CACHE_DIR) must not bypass. GPU tests use the user's."""
    if "hopper_gpu" not in request.fixturenames:
        monkeypatch.setenv("HOPPER_FMHA_CACHE_DIR", str(_session_kernel_cache))


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of small CPU problems (`pytest.mark.usefixtures`): one torch thread is faster
    than two there, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hopper_gpu(request) -> torch.device:
    """The CUDA device of a Hopper GPU; skips the test on any other machine. Seeds torch's global
    generators from the test's id, so that what a test draws without a generator of its own (e.g.
    `torch.randn_like(out)` for dout) does not depend on which tests ran before it in the process."""
    if not HOPPER:
        pytest.skip(_gpu_skip_reason())
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return torch.device("cuda", torch.cuda.current_device())


def pytest_terminal_summary(terminalreporter):
    """The compile tier's kernels: registers per thread and stack as ptxas reported them."""
    rows = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, row in getattr(report, "user_properties", ()):
                if name == "kernel_resources":
                    rows[row["config"]] = row
    if not rows:
        return
    terminalreporter.section("kernels compiled for sm_90a: registers per thread (ptxas)")
    width = max(len(config) for config in rows)
    terminalreporter.write_line(f"{'config':<{width}}  regs  stack B  compile s")
    for config, row in rows.items():
        terminalreporter.write_line(
            f"{config:<{width}}  {row['registers']:>4}  {row['stack_bytes']:>7}  {row['compile_s']:>9.1f}"
        )


def pytest_runtest_logreport(report):
    """With $HOPPER_FMHA_TEST_REPORT set (scripts/gpu_tier.py sets one per process), append each
    test's outcome, and a failure's text, to that file as it happens: a process stopped at the
    time budget keeps what it ran."""
    path = os.environ.get("HOPPER_FMHA_TEST_REPORT")
    if not path or (report.when != "call" and not (report.failed or report.skipped)):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.nodeid} {report.duration:.2f}s\n")
        if report.failed:
            text = report.longreprtext
            f.write(text if len(text) <= 4000 else text[:1000] + "\n[...]\n" + text[-3000:])
            f.write("\n")
