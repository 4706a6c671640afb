"""Shared test setup.

* Interpreter mode when there is no GPU: TRITON_INTERPRET must be set before any @triton.jit runs,
  so it is set here, before mtp_triton is imported by any test.
* `gpu` marker: skipped without CUDA.
* `nan_like` / `poison`: NaN-filled outputs and padding, so an element a kernel forgets to write
  (or writes out of bounds) fails the test.
* MTP_TRITON_CACHE: the measured verify-step costs (mtp_triton.costs) go to a fresh folder, not ~/.cache.
* `assert_close`: one comparison that reports max-abs and max-relative error.
* `on_cpu`: test inputs copied to the CPU, for the twins' out-of-range checks.
"""
import os
import tempfile

import pytest
import torch

from mtp_triton.kernels import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()              # before any test module imports a kernel
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MTP_TRITON_CACHE", tempfile.mkdtemp(prefix="mtp-triton-costs-"))  # measured c(T), per run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_close(actual, expected, atol=1e-5, rtol=1e-5, what=""):
    """torch.testing-style check that prints max-abs and max-relative error on failure."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert not torch.isnan(a).any(), f"{what}: output has NaN (an element was not written?)"
    diff = (a - e).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel = (diff / e.abs().clamp_min(1e-12)).max().item() if diff.numel() else 0.0
    ok = bool((diff <= atol + rtol * e.abs()).all())
    assert ok, f"{what}: max abs err {max_abs:.3e}, max rel err {rel:.3e} (atol={atol}, rtol={rtol})"


def poison(shape, dtype, device=DEVICE):
    """A NaN-filled tensor (ints: filled with a huge sentinel)."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -(2 ** 31) + 7, dtype=dtype, device=device)


def on_cpu(case):
    """A dict of test inputs with every tensor copied to the CPU (a twin fed out-of-range indices raises IndexError
    there; on a GPU the same gather is a device-side assert, which leaves the process's CUDA context unusable)."""
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}


@pytest.fixture
def device():
    return DEVICE
