"""The compiled CPU step: the decoder layer (`model.layer`) through `torch.compile`'s inductor C++ backend.

Why. On a CPU a small model's decode step is dominated by dispatch, not by arithmetic or memory: SmolLM2-135M's
eager bf16 step makes ~120 matmul calls (on prepacked weights, near the copy bandwidth) and a few thousand small
ATen calls (views, copies, norms, RoPE, the batch-invariant attention's gathers), each a few microseconds. Inductor
fuses the element-wise work of a layer into a handful of C++ loops and leaves the matmuls to oneDNN.

What is compiled: one function, `model.layer`, the same for all L layers (its weights are inputs, not constants),
so one compiled graph serves every layer of the target and the MTP module's block. Shapes are dynamic (the node
count T and the cache length vary every step), so a generation does not recompile as its context grows; inductor
makes separate graphs only where a size is 0 or 1 (T = 1 for serial steps; no shared cache chunk yet). The linear
layers are `packed.PackedLinear` calls, which reach the graph as one custom op each (inductor cannot lower oneDNN's
packed matmul on a weight that is an input). Prefill stays eager (one call per generation).

Batch 1, up to 32 nodes. A batch of several sequences, or a tree of more than invariant.MATMUL_ROWS nodes (whose
linear layers go in pieces of 32 rows), runs the same function eagerly. Compiled, a bf16 tree step of 3 sequences
was seen not to round like their serial steps (one token of 120 differed in tests/test_compiled.py's batch case),
which batch 1 never showed; the cause (a reduction that inductor vectorizes differently for another row count is
the likely one) is not found yet.

Exact numerics in every dtype. The compiled kind always runs the batch-invariant path (`invariant.attention`,
`invariant.linear`): a tree step is bit-identical to serial steps in bf16 and in fp32, because both run the same
compiled code and every reduction follows absolute positions, not the node count (tests/test_compiled.py).

Compile time: about 10-30 s on first use per (dtype, model shape) on a 2-core CPU; inductor keeps the compiled code
in its on-disk cache (TORCHINDUCTOR_CACHE_DIR, by default a folder under the system's temp dir), so a later process
loads it in a second or two. MTP_TRITON_COMPILE=0 makes kernels="auto" pick the eager twins instead.
"""
import functools
import os
import shutil

import torch

from .model import layer


def available(force=False):
    """Does kernels='auto' compile here: a C++ compiler for inductor (g++, or $CXX), and MTP_TRITON_COMPILE is not
    0 (force=True: ignore MTP_TRITON_COMPILE)."""
    wanted = force or os.environ.get("MTP_TRITON_COMPILE", "1") != "0"
    return wanted and shutil.which(os.environ.get("CXX", "g++")) is not None


@functools.cache
def compiled_layer():
    """`model.layer` compiled once per process (graphs per dtype and shape family are made on first call).

    Dynamo keeps its compiled graphs per code object, at most `recompile_limit` (8 by default) of them, and runs
    the function eagerly past that. One model and dtype already makes up to 8 (T = 1 or more, batch 1 or more, an
    empty shared cache or not); a process with two dtypes or models needs more, so the limit is raised to 64 (a
    process-wide dynamo setting; it never lowers a limit set higher)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    return torch.compile(layer, dynamic=True)
