"""The verify forward replayed from CUDA graphs (generate's cuda_graph=True): `step.verify` hands it the step's
inputs when a `GraphedVerify` is in the step's plan."""
import torch


class GraphedVerify:
    """The verify forward (+ logits) captured as CUDA graphs, one per tree size, replayed with new inputs.

    The rows must be the same at every call (graph mode runs the whole batch every step, finished rows frozen).

    Possible because, with value checks off, every kernel's launch grid depends only on tensor shapes and the
    block table's width; the cache, block table and lengths are read from their (static) storage at replay.
    Inputs are copied into static buffers; outputs are overwritten by the next replay.
    """

    def __init__(self):
        self.graphs = {}

    def run(self, model, cache, rows, tokens, positions, tree, ops):
        """tokens [A, T], positions [A, T] -> hidden [A, T, D], k_tree, v_tree, logits [A, T, V], as `step.verify`
        (views of the graph's static outputs); the first call at a tree size captures its graph."""
        if tree.size not in self.graphs:
            self.graphs[tree.size] = _Captured(model, cache, rows, tree, ops)
        return self.graphs[tree.size](tokens, positions)


class _Captured:
    """One tree size's verify forward, captured after two warm-up runs (compiles and autotuning stay outside)."""

    def __init__(self, model, cache, rows, tree, ops):
        self.model, self.cache, self.rows, self.mask, self.ops = model, cache, rows, tree.mask, ops
        self.tokens = torch.zeros(len(rows), tree.size, dtype=torch.int64, device=model.device)
        self.positions = cache.cache_lens[rows].long()[:, None] + tree.depth[None, :]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm-up: compile/autotune outside the capture
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()

    def _run(self):
        h, k, v = self.model.forward_tree(self.tokens, self.positions, self.mask, self.cache, self.rows, self.ops,
                                          check_values=False)
        return h, k, v, self.model.logits(h, self.model.exact_mode(self.ops))

    def __call__(self, tokens, positions):
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out
