"""Compile kernels for a GPU on a machine without one: a stand-in Triton driver and tensors without storage.

How the real launchers are made to compile (and only compile) their kernels:

* `MetaCuda` is a tensor whose `.device` says `cuda:0` but whose data is a PyTorch *meta* tensor (shape,
  strides and dtype, no storage), so a Llama-sized KV cache costs no memory. Every op on it runs on the meta
  tensor underneath; `data_ptr()` is 0 (16-byte aligned, as fresh CUDA allocations are), which is what Triton's
  binder looks at to specialise pointer arguments.
* `CudaOnMeta` (a TorchFunctionMode) turns `torch.empty(..., device="cuda")` and friends inside the launchers
  into MetaCuda tensors.
* `FakeDriver` is the Triton driver: `get_current_target()` returns the GPUTarget we compile for.
* `gpu_session(arch)` puts those in place and replaces `JITFunction.run` so that every `kernel[grid](...)` the
  launcher makes runs Triton's own binder (specialisation, constexprs, num_warps/num_stages) and compiler with
  `warmup=True` — compiled, never launched — and is recorded as a `Launch`. It also shows the launchers the
  architecture's SM count where they ask `torch.cuda` for it.

Value checks read tensor data, which meta tensors do not have: call the launchers with check_values=False.
Python-int indexing (`t[0]`) is not supported on MetaCuda (PyTorch would need a CUDA device guard): build
per-layer tensors directly.
"""
import contextlib
import functools
import inspect
import sys
import types
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

CUDA = torch.device("cuda", 0)


class MetaCuda(torch.Tensor):
    """A tensor that reports device cuda:0 and holds a meta tensor (no storage)."""

    @staticmethod
    def __new__(cls, meta):
        r = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                device=CUDA, requires_grad=False)
        r._meta = meta
        return r

    def data_ptr(self):
        return 0

    def __repr__(self):
        return f"MetaCuda(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            if isinstance(x, MetaCuda):
                return x._meta
            if isinstance(x, torch.device) and x.type == "cuda":
                return torch.device("meta")
            return x
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: MetaCuda(x) if isinstance(x, torch.Tensor) and x.device.type == "meta" else x, out)


def meta_cuda(shape, dtype):
    """An empty `shape` tensor of `dtype` that says it lives on cuda:0 (contiguous)."""
    return MetaCuda(torch.empty(shape, dtype=dtype, device="meta"))


class CudaOnMeta(TorchFunctionMode):
    """Inside this mode, factory calls with device=cuda make MetaCuda tensors instead of touching CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "meta"
            return tree_map(lambda x: MetaCuda(x) if isinstance(x, torch.Tensor) else x, func(*args, **kwargs))
        return func(*args, **kwargs)


def _driver_base():
    from triton.backends.driver import DriverBase
    return DriverBase


def make_fake_driver(target, device_id):
    """A Triton driver with no GPU behind it: it names `target` as the current target and `device_id` as the
    device (one id per target keeps Triton's per-device kernel caches apart). Nothing can be launched."""

    class FakeDriver(_driver_base()):
        def __init__(self):
            self.target = target

        @classmethod
        def is_active(cls):
            return False                      # never picked by Triton's own driver discovery

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("FakeDriver cannot build launchers")

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            return CUDA

        def get_benchmarker(self):
            raise RuntimeError("FakeDriver: nothing can be timed without a GPU")

        def get_current_device(self):
            return device_id

        def get_current_stream(self, device=None):
            return 0

        def set_current_device(self, device):
            pass

    FakeDriver.__abstractmethods__ = frozenset()   # other Triton versions may declare more abstract methods
    return FakeDriver()


@dataclass
class Launch:
    """One `kernel[grid](...)` call made by a launcher, compiled for the session's target."""
    kernel: str                         # the @triton.jit function's name
    grid: tuple
    args: dict                          # parameter name -> value (tensors as TensorInfo)
    compiled: object = None             # triton CompiledKernel, None if compilation failed
    error: str = ""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple
    dtype: str
    itemsize: int

    @property
    def nbytes(self):
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


def _describe(value):
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(value.shape), str(value.dtype).replace("torch.", ""), value.element_size())
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)                    # tl.dtype constexprs and the like


def _bind(fn, args, kwargs):
    """Parameter name -> value for a jit call (kwargs that are not parameters are launch options)."""
    params = inspect.signature(fn.fn).parameters
    bound = inspect.signature(fn.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    return dict(bound.arguments)


def _error_text(exc, limit=600):
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:limit]


@contextlib.contextmanager
def gpu_session(arch, device_id=0):
    """Compile-only mode for one architecture (a `hardware.Arch`). Yields the list of `Launch`es recorded.

    Patches, and restores on exit: Triton's active driver, `JITFunction.run`, `torch.cuda.get_device_properties`
    / `get_device_capability` / `current_device`; clears the kernel modules' functools caches (SM counts) on
    entry and exit; turns device=cuda factory calls into meta tensors.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", arch.capability, 32)
    launches = []
    original_run = JITFunction.run

    def compile_only_run(self, *args, grid, warmup, **kwargs):
        try:
            named = _bind(self, args, kwargs)
        except TypeError:
            named = {}
        if callable(grid):
            grid = grid(named)
        launch = Launch(self.fn.__name__, tuple(int(g) for g in grid),
                        {k: _describe(v) for k, v in named.items()})
        launches.append(launch)
        try:
            launch.compiled = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:           # a compile error is a finding: record it, let the launcher go on
            launch.error = _error_text(exc)
        return launch.compiled

    props = types.SimpleNamespace(multi_processor_count=arch.launcher_sms, major=arch.capability // 10,
                                  minor=arch.capability % 10, name=f"compile-only {arch.name}",
                                  total_memory=0)
    patches = {
        (JITFunction, "run"): compile_only_run,
        (torch.cuda, "get_device_properties"): lambda device=None: props,
        (torch.cuda, "get_device_capability"): lambda device=None: (props.major, props.minor),
        (torch.cuda, "current_device"): lambda: 0,
    }
    saved = {key: getattr(*key) for key in patches}
    driver = triton.runtime.driver
    previous = driver._active if hasattr(driver, "_active") else None
    _clear_kernel_caches()
    try:
        for (obj, name), value in patches.items():
            setattr(obj, name, value)
        driver.set_active(make_fake_driver(target, device_id))
        with CudaOnMeta():
            yield launches
    finally:
        for (obj, name), value in saved.items():
            setattr(obj, name, value)
        if hasattr(driver, "_active"):
            driver._active = previous
        _clear_kernel_caches()


def _clear_kernel_caches():
    """functools caches in the kernel modules (e.g. the SM count) must not leak from one target to the next."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("mtp_triton.kernels.") or module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
