"""The compiled kind of ops (mtp_triton/compiled.py): `model.layer` through torch.compile on the CPU.

It runs the batch-invariant numerics in every dtype, so a tree step is bit-identical to the serial steps along each
node's path (bf16 here, with a branching tree, an empty and a chunked shared cache and a sliding window), MTP emits
the serial tokens (batch 1, and a batch of three, whose sequences give the tokens they give alone), and an fp32 model
still decodes as transformers does. Tiny models: compiling their layer takes seconds a graph."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton import compiled
from mtp_triton.generate import prefill
from mtp_triton.ops import get_ops
from mtp_triton.tree import PRESETS, Tree
from hf_models import hf_greedy, make_hf

pytestmark = pytest.mark.skipif(not compiled.available(), reason="no C++ compiler for torch.compile")


def _cache_with(model, ops, prompt, extra):
    cache = model.new_cache([len(prompt) + extra])
    prefill(model, [prompt], cache, ops)
    return cache


def _serial_path(model, ops, prompt, tokens, path):
    """The final hidden state and logits of the last node of `path` (node ids), decoded one node per step."""
    cache = _cache_with(model, ops, prompt, len(path) + 1)
    rows = torch.tensor([0])
    for j in path:
        n = int(cache.cache_lens[0])
        h, kt, vt = model.forward_tree(tokens[:, j:j + 1], torch.tensor([[n]]), torch.ones(1, 1, dtype=torch.bool),
                                       cache, rows, ops, check_values=False)
        blk, slot = int(cache.block_table[0, n // cache.block_size]), n % cache.block_size
        cache.k[:, blk, slot], cache.v[:, blk, slot] = kt[:, 0, 0], vt[:, 0, 0]
        cache.cache_lens[0] += 1
    return h[0, 0], model.logits(h)[0, 0]


NAME = "mistral-win8-gqa-hd16-v203-L2"           # a sliding window of 8: the window's masks are compiled too


# no shared chunk yet; one shared chunk of 32 positions; a tree of 65 nodes (its linear layers go in row pieces)
@pytest.mark.parametrize("n,preset", [(5, "medusa-16"), (45, "medusa-16"), (70, "medusa-64")])
def test_compiled_tree_step_is_bit_identical_to_serial_steps(n, preset):
    model = mt.LlamaEngine.from_hf(make_hf(NAME), dtype=torch.bfloat16)
    ops = get_ops("compiled")
    tree = Tree.from_choices(PRESETS[preset])
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    tokens = torch.randint(0, model.config.vocab_size, (1, tree.size), generator=g)
    cache = _cache_with(model, ops, prompt, tree.size)
    with torch.no_grad():
        h, _, _ = model.forward_tree(tokens, n + tree.depth[None], tree.mask, cache, torch.tensor([0]), ops,
                                     check_values=False)
        logits = model.logits(h)
        for i in range(tree.size):
            path = [j for j in range(tree.size) if tree.mask[i, j]]           # ancestors by depth, then i
            hs, ls = _serial_path(model, ops, prompt, tokens, path)
            assert torch.equal(hs, h[0, i]) and torch.equal(ls, logits[0, i]), (NAME, n, preset, i)


PROMPTS = [[5, 17, 33, 42, 90, 1] * 6, [7, 8, 9], list(range(10, 47))]


@pytest.mark.parametrize("batch", [1, 3])              # a batch runs each sequence through the batch-1 graphs
def test_compiled_bf16_mtp_equals_serial(batch):
    model = mt.LlamaEngine.from_hf(make_hf(NAME), dtype=torch.bfloat16)
    heads = mt.init_heads(model, num_heads=4, seed=2)
    for p in [[q] for q in PROMPTS] if batch == 1 else [PROMPTS]:
        serial = mt.generate(model, p, 40, mtp=False, kernels="compiled")
        assert serial.stats.kernels == "compiled"
        for tree in ("chain-4", "medusa-16", "medusa-64"):
            assert mt.generate(model, p, 40, heads=heads, tree=tree, kernels="compiled").tokens == serial.tokens
        if batch > 1:                                   # each sequence of the batch decodes as it does alone
            assert serial.tokens == [mt.generate(model, [q], 40, mtp=False, kernels="compiled").tokens[0] for q in p]


def test_compiled_fp32_greedy_matches_transformers():
    hf = make_hf(NAME, dtype=torch.float32)
    model = mt.LlamaEngine.from_hf(hf)
    prompts = [[5, 17, 33, 42, 90, 1] * 7, [7, 8, 9]]
    ref = hf_greedy(hf, prompts, 24)
    heads = mt.init_heads(model, num_heads=3, seed=1)
    for p, want in zip(prompts, ref):
        assert mt.generate(model, [p], 24, mtp=False, kernels="compiled").tokens == [want]
        assert mt.generate(model, [p], 24, heads=heads, tree="medusa-16", kernels="compiled").tokens == [want]


def test_auto_stays_eager_on_a_cpu_and_compiled_is_the_cpu_path():
    assert get_ops("auto", "cpu").kind == "torch"          # compiled is asked for by name (compiled.py says why)
    assert get_ops("compiled", "cpu").kind == "compiled"
    with pytest.raises(ValueError, match="CPU path"):
        get_ops("compiled", "cuda")
