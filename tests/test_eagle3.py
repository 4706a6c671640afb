"""EAGLE-3's drafter (eagle3.py): training forward = decoding step, lossless decoding, the field's file format, bad
files."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp_triton as mt
from mtp_triton.drafters_mtp import ModuleDrafter
from mtp_triton.eagle3 import Eagle3Module, default_taps, load_eagle3
from mtp_triton.generate import causal_chains
from hf_models import make_hf
from test_mtp_module import perturbed

PROMPTS = [[5, 17, 33, 42, 90, 1], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
TAPS = (0, 1, 2)                      # the tiny model has 2 layers: the embeddings, after layer 0, after layer 1


@pytest.fixture(scope="module")
def model():
    return mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))


def random_eagle3(model, seed=0, token_map=None, scale=0.3, taps=TAPS, **draft):
    """A drafter with random (not identity-like) weights, so that its drafts disagree with the model now and then."""
    return perturbed(Eagle3Module.from_target(model, token_map, taps, draft or None).to(model.dtype), seed, scale)


@torch.no_grad()
def _features(model, seq, taps):
    tokens, positions, mask, _ = causal_chains([seq], model.device)
    h, _, _, feats = model.forward_tree(tokens, positions, mask, model.new_cache([len(seq)]), torch.arange(1),
                                        mt.ops.get_ops("torch"), exact=False, taps=taps)
    return h, feats                                                                  # [1, S, D], [1, S, 3D]


def test_taps_are_the_residual_streams(model):
    """forward_tree(taps=) returns the residual stream entering each tapped layer: tap 0 is the embedding, tap L the
    stream the final norm reads (its RMSNorm is the final-norm hidden state)."""
    seq = [3, 9, 27, 81, 40]
    h, feats = _features(model, seq, TAPS)
    D = model.config.hidden_size
    torch.testing.assert_close(feats[..., :D], model.embed_tokens(torch.tensor([seq])))
    torch.testing.assert_close(model.norm(feats[..., 2 * D:]), h)


@torch.no_grad()
def test_unroll_is_the_decoding_step(model):
    """Training's unrolled forward and the engine's paged-cache step compute the same drafter: step 0 over a sequence
    is one causal chain through the cache (fc over the target's features), and step 1 at index m is a depth-1 node
    reading the block's own y^(0)_{m-1} (no fc) and attending to the cache entries < m and itself."""
    mod = random_eagle3(model)
    seq = [3, 9, 27, 81, 40, 120, 7, 77, 5]
    S = len(seq) - 1
    feats = _features(model, seq, TAPS)[1][:, :S]
    nxt = torch.tensor([seq[1:]])
    embed = model.embed_tokens.weight
    y0, y1 = mod.unroll(embed, feats, nxt, 2)
    ops, eng = mt.ops.get_ops("torch"), mod.engine(model)
    x, a = mod.step_inputs(embed, feats, nxt)
    assert a.shape[-1] == 2 * model.config.hidden_size
    tokens, positions, mask, _ = causal_chains([list(range(S))], model.device)
    g, _, _ = eng.forward_tree(None, positions, mask, eng.new_cache([S]), torch.arange(1), ops, exact=False,
                               embeds=x, attn_in=a)
    torch.testing.assert_close(g, y0, rtol=1e-9, atol=1e-9)
    for m in (1, 4, S - 1):
        cache = eng.new_cache([S + 1])
        _, k, v = eng.forward_tree(None, positions[:, :m], mask[:, :m, :m], cache, torch.arange(1), ops, exact=False,
                                   embeds=x[:, :m], attn_in=a[:, :m])
        ops.kv_append(cache.k, cache.v, cache.block_table, cache.cache_lens, k, v, torch.arange(m)[None],
                      torch.tensor([m - 1]))
        cache.cache_lens += m
        nx, na = mod.step_inputs(embed, y0[:, m - 1:m], nxt[:, m:m + 1], own=True)
        out, _, _ = eng.forward_tree(None, torch.tensor([[m]]), torch.ones(1, 1, dtype=torch.bool), cache,
                                     torch.arange(1), ops, exact=False, embeds=nx, attn_in=na)
        torch.testing.assert_close(out[:, 0], y1[:, m], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("runtime", [None, mt.RuntimeConfig(fallback_threshold=1.0, fallback_window=1,
                                                           fallback_steps=2)])
def test_greedy_is_serial(model, runtime):
    """Greedy MTP with EAGLE-3's drafter and its dynamic tree emits the serial tokens (batch of 3, lengths differ),
    with serial fallback steps in between too; a draft vocabulary of 150 of the 203 ids."""
    serial = mt.generate(model, PROMPTS, 30, mtp=False).tokens
    mod = random_eagle3(model, token_map=torch.arange(0, 203)[torch.arange(203) % 4 != 3], depth=3, top_k=4, beam=2,
                        nodes=9)
    res = mt.generate(model, PROMPTS, 30, drafter=mod, runtime=runtime)
    assert res.tokens == serial
    assert res.stats.verified_nodes_per_step <= 9


@pytest.mark.parametrize("batch", [1, 4])
def test_bf16_batches_are_serial(batch):
    m = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=torch.bfloat16)
    prompts = (PROMPTS + [[100, 3, 64]])[:batch]
    serial = mt.generate(m, prompts, 12, mtp=False, block_size=1).tokens
    mod = random_eagle3(m, scale=3.0, depth=3, top_k=4, beam=2, nodes=9)
    res = mt.generate(m, prompts, 12, drafter=ModuleDrafter(mod, m, mt.ops.get_ops("torch", m.device)),
                      runtime=dict(size_by_cost=False), block_size=1)
    assert res.tokens == serial


@torch.no_grad()
def test_features_and_tokens_line_up(model):
    """A logit lens on the final stream (taps (L,), fc = I, o and down zero: y = u) scores, at the newest committed
    index, the model's own next token: so its depth-1 draft must be the step's root, after prefill and after every
    step (a drafter whose (feature, token) pairs were off by one index would not reproduce it)."""
    from mtp_triton.generate import prefill
    from mtp_triton.sampling import Sampler
    from mtp_triton.step import StepInputs, mtp_step
    mod = Eagle3Module.from_target(model, taps=(2,), draft=dict(depth=2, top_k=1, beam=1, nodes=3))
    ops = mt.ops.get_ops("torch")
    d = ModuleDrafter(mod, model, ops)
    caps = [len(p) + 40 for p in PROMPTS]
    cache = model.new_cache(caps)
    hidden, feats = prefill(model, PROMPTS, cache, ops, all_hidden=True, taps=d.taps)
    roots = model.logits(hidden).argmax(-1)
    d.start(PROMPTS, feats, roots, caps, cache.block_size)
    rows = torch.arange(len(PROMPTS))
    for _ in range(6):
        _, tokens, _, _ = d.draft(rows, roots, hidden, depths=[2] * len(PROMPTS))
        assert torch.equal(tokens[:, 1], roots)                      # depth 1 = the model's argmax at the root's index
        step = mtp_step(model, cache, rows, StepInputs(roots, hidden, depths=[2] * len(PROMPTS)), d, Sampler(), ops)
        roots, hidden = step.bonus, step.hidden


# ---- files: EAGLE-3's format ----------------------------------------------------------------------------------------
EAGLE3_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
                "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
                "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}


def test_save_writes_eagle3_names_and_config(model, tmp_path):
    ids = torch.arange(0, 203, 2)
    mod = random_eagle3(model, token_map=ids)
    mod.save(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert set(sd) == EAGLE3_NAMES
    D = model.config.hidden_size
    assert sd["fc.weight"].shape == (D, 3 * D) and sd["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * D
    assert torch.equal(torch.arange(len(ids)) + sd["d2t"], ids) and int(sd["t2d"].sum()) == len(ids)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == len(ids) and cfg["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    back = mt.load_drafter(str(tmp_path))
    assert isinstance(back, Eagle3Module) and back.taps == TAPS and torch.equal(back.token_map, ids)
    for k, v in mod.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def _published_like(model, path, fmt="safetensors", **edit):
    """A drafter folder written the way EAGLE-3's own training code saves one (names listed here, not by our save):
    a Llama config with draft_vocab_size and no taps, the target's embedding beside the drafter's weights."""
    D, c = model.config.hidden_size, model.config
    Hq, Hkv, Dh, I, V, Vd = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, 203, 64
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2                                # noqa: E731
    used = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    sd = {"fc.weight": r(D, 3 * D), "norm.weight": 1 + r(D), "lm_head.weight": r(Vd, D),
          "d2t": used - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, used, True),
          "embed_tokens.weight": model.embed_tokens.weight.detach().clone(),
          "midlayer.hidden_norm.weight": 1 + r(D), "midlayer.input_layernorm.weight": 1 + r(D),
          "midlayer.post_attention_layernorm.weight": 1 + r(D),
          "midlayer.self_attn.q_proj.weight": r(Hq * Dh, 2 * D), "midlayer.self_attn.k_proj.weight": r(Hkv * Dh, 2 * D),
          "midlayer.self_attn.v_proj.weight": r(Hkv * Dh, 2 * D), "midlayer.self_attn.o_proj.weight": r(D, Hq * Dh),
          "midlayer.mlp.gate_proj.weight": r(I, D), "midlayer.mlp.up_proj.weight": r(I, D),
          "midlayer.mlp.down_proj.weight": r(D, I)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D,
           "intermediate_size": I, "num_attention_heads": Hq, "num_key_value_heads": Hkv, "head_dim": Dh,
           "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": V,
           "draft_vocab_size": Vd, "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    for k, v in edit.items():
        (cfg if k in cfg or k.startswith("cfg_") else sd)[k.removeprefix("cfg_")] = v
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors")
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return used


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_published_format_drafter_loads_and_is_lossless(model, tmp_path, fmt):
    """Synthetic weights in EAGLE-3's published layout (no checkpoint can be downloaded here) load through
    load_drafter, take the target's default taps (the tiny model's L = 2 needs explicit ones: (0, 1, 2) via the
    config), and decode to the serial tokens."""
    used = _published_like(model, tmp_path, fmt, cfg_eagle_aux_hidden_state_layer_ids=list(TAPS))
    mod = mt.load_drafter(str(tmp_path))
    assert isinstance(mod, Eagle3Module) and torch.equal(mod.token_map, used)
    res = mt.generate(model, PROMPTS, 20, drafter=mod.with_draft(depth=3, top_k=4, beam=2, nodes=9))
    assert res.tokens == mt.generate(model, PROMPTS, 20, mtp=False).tokens


def test_default_taps_come_from_the_target(tmp_path, model):
    _published_like(model, tmp_path)
    mod = load_eagle3(str(tmp_path))
    assert mod.taps is None and default_taps(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="reads target layers"):        # (2, 1, -1) for L = 2: not a real layer
        ModuleDrafter(mod, model, mt.ops.get_ops("torch"))


@pytest.mark.parametrize("edit,match", [
    (dict(cfg_target_hidden_size=7), "target_hidden_size"),
    (dict(cfg_num_hidden_layers=2), "one block"),
    (dict(d2t=torch.zeros(64)), "d2t must hold integers"),
    (dict(t2d=torch.ones(203, dtype=torch.bool)), "t2d does not mark"),
    (dict(d2t=torch.zeros(10, dtype=torch.int64)), "d2t has shape"),
    (dict(**{"fc.weight": torch.zeros(3, 3)}), "mis-shaped"),
    (dict(**{"lm_head.weight": torch.full((64, 64), float("nan"))}), "non-finite"),
])
def test_bad_files_are_refused(model, tmp_path, edit, match):
    _published_like(model, tmp_path, cfg_eagle_aux_hidden_state_layer_ids=list(TAPS), **edit)
    with pytest.raises(ValueError, match=match):
        mt.load_drafter(str(tmp_path))


def test_torn_files_are_refused(model, tmp_path):
    _published_like(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"torn")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        mt.load_drafter(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not a readable JSON"):
        load_eagle3(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eagle3_on_the_gpu_kernels_is_lossless():
    """EAGLE-3's path with the Triton kernels (tree_attention and kv_append on its cache with attn_in, the taps of the
    target's verify forward, fused_draft over its own LM head and d2t map): greedy output equals serial decoding."""
    gpu = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), device="cuda", dtype=torch.float32)
    cpu = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))
    mod = random_eagle3(cpu, token_map=torch.arange(0, 203, 2), depth=3, top_k=4, beam=2, nodes=8).to("cuda")
    serial = mt.generate(gpu, PROMPTS, 24, mtp=False, kernels="triton").tokens
    assert mt.generate(gpu, PROMPTS, 24, drafter=mod, kernels="triton").tokens == serial
