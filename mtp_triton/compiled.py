"""The compiled CPU step: the decoder layer (`model.layer`) through `torch.compile`'s inductor C++ backend.

Why. On a CPU a small model's decode step is dominated by dispatch, not by arithmetic or memory: SmolLM2-135M's
eager step makes one matmul call per linear layer (on prepacked weights) and thousands of small ATen calls (views,
copies, norms, RoPE, the batch-invariant attention's gathers), each a few microseconds. Inductor fuses the element-wise
work of a layer into a handful of C++ loops and leaves the matmuls to oneDNN.

What is compiled: one function, `model.layer`, the same for all L layers (its weights are inputs, not constants),
so one compiled graph serves every layer of the target and the MTP module's block. Shapes are dynamic (the node
count T and the cache length vary every step), so a generation does not recompile as its context grows; inductor
makes separate graphs only where a size is 0 or 1 (T = 1 for serial steps; no shared cache chunk yet). The linear
layers are `packed.PackedLinear` calls, which reach the graph as one custom op each (inductor cannot lower oneDNN's
packed matmul on a weight that is an input). Prefill stays eager (one call per generation).

Batches and big trees. A batch of several sequences runs through the batch-1 graphs one sequence at a time
(`forward_tree` does the loop), so a sequence rounds the same in a batch and alone: a graph compiled for B > 1 may
vectorise or split its loops otherwise than the B = 1 graph, and so round a sequence otherwise than its serial
steps. Trees of any node count share one graph for T > 1: the linear layers'
custom op splits rows into invariant.linear's pieces of at most 32 itself, out of the compiler's sight (packed.py).
The price is that a batch streams the weights once per sequence, not once per step.

Exact numerics in every dtype. The compiled kind always runs the batch-invariant path (the exact twin's attention,
kernels/tree_attention_ref.py, on a plan `forward_tree` builds outside the graph; `invariant.linear`): a tree step is
bit-identical to serial steps in bf16 and in fp32, because both run the same compiled code and every reduction follows
absolute positions, not the node count (tests/test_compiled.py).

Compile time and why the kind is opt-in. `warm_up` compiles the graphs of a generation before its timers start:
minutes cold for a small model on a small CPU (tens of seconds a graph), and still tens of seconds in a later process
with inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, by default a folder under the system's temp dir), most of it
dynamo tracing the step again, and in fp32 the compiled kind gives up the plain twins for the exact path. Whether it
pays is a measurement (the README's library-defaults A/B records it), so kernels="auto" stays eager on a CPU and
"compiled" is asked for by name.
"""
import functools
import os
import shutil
import time

import torch

from .model import layer


def available():
    """Can kernels='compiled' run here: a C++ compiler for inductor (g++, or $CXX)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


@functools.cache
def compiled_layer():
    """`model.layer` compiled once per process (graphs per dtype and shape family are made on first call).

    Dynamo keeps its compiled graphs per code object, at most `recompile_limit` (8 by default) of them, and runs
    the function eagerly past that. One model and dtype makes 4 (T = 1 or more, an empty shared cache or not; a batch
    runs through the same one-sequence graphs); a process with several dtypes or models needs more, so the limit is
    raised to 64 (a process-wide dynamo setting; it never lowers a limit set higher)."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 64)
    # no duck sizing: two sizes that happen to be equal when first traced (a 64-wide tail and head_dim 64) would share
    # one symbol, and the graph would be compiled again whenever they differ
    torch.fx.experimental._config.use_duck_shape = False
    return torch.compile(layer, dynamic=True)


_WARM = set()


@torch.no_grad()
def warm_up(model, ops):
    """Compile every graph a generation can need, before it is timed (a batch runs one sequence at a time through
    the same graphs): the serial step (T = 1) and tree steps (T > 1), each with an empty shared cache and with shared
    chunks, at two tail widths. Once per process and
    (dtype, model shape); a no-op afterwards. Returns the seconds it took (0.0 when already warm)."""
    cfg = model.config
    key = (model.dtype, str(model.device), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
           cfg.head_dim, cfg.intermediate_size, cfg.qk_norm, cfg.qkv_bias, cfg.attention_bias, cfg.mlp_bias)
    if key in _WARM:
        return 0.0
    t0 = time.perf_counter()
    for n in (0, 40, 140):                          # no shared chunk (tail 64 or 96 wide); shared chunks
        cache = model.new_cache([n + 64])              # several blocks (a size of 1 would be a graph of its own)
        cache.cache_lens.fill_(n)
        for T in (1, 2, 7):
            depth = torch.arange(T, device=model.device)
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=model.device))
            model.forward_tree(torch.zeros(1, T, dtype=torch.long, device=model.device), n + depth[None], mask,
                               cache, torch.zeros(1, dtype=torch.long, device=model.device), ops, check_values=False)
    _WARM.add(key)
    return time.perf_counter() - t0
