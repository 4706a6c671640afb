"""Render README.md (the model card) from the recorded runs in records/ — no number is typed by hand.

    python data/tiny-stdlib-llama/make_card.py          # run last: it also writes the sha256 of every file
"""
import os
import sys

from mtp_lab.records import md_table, percents as pct, read_json, sha256_file, write_text

HERE = os.path.dirname(os.path.abspath(__file__))
REC = os.path.join(HERE, "records")


def load(*parts):
    return read_json(os.path.join(REC, *parts))


def fmt(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def checksums():
    rows = []
    for dirpath, dirnames, filenames in os.walk(HERE):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, HERE).replace(os.sep, "/")
            if rel != "README.md":
                rows.append((rel, sha256_file(full), os.path.getsize(full)))
    return rows


def tau_table(gen, sim_tp, sim_val):
    names = list(dict.fromkeys(list((gen or {}).get("trees", {})) + list(sim_tp or {}) + list(sim_val or {})))
    body = []
    for n in names:
        g = (gen or {}).get("trees", {}).get(n, {})
        nodes = g.get("nodes") or (sim_tp or {}).get(n, {}).get("nodes") or (sim_val or {}).get(n, {}).get("nodes")
        body.append((n, nodes, fmt(g.get("tau")), fmt((sim_tp or {}).get(n, {}).get("tau")),
                     fmt((sim_val or {}).get(n, {}).get("tau")),
                     " / ".join(f"{a:.2f}" for a in g.get("accept_rate_per_depth", []))))
    return md_table(["tree", "nodes", "τ measured with `generate` (third-party prompts)", "τ simulated, third-party",
                     "τ simulated, held-out stdlib", "accept rate per depth (`generate`)"], body)


def comparison(plain, joint):
    if not (plain and joint):
        return "_The comparison runs have not been recorded (records/compare_plain, records/compare_joint)._"
    pj, pf = plain.get("joint"), plain.get("frozen")
    jj, jf = joint.get("joint"), joint.get("frozen")
    if not (pj and pf and jj and jf):
        return "_Incomplete comparison records._"

    def tau(f, name):
        return f.get("thirdparty_greedy", {}).get("tau_simulated", {}).get(name, {}).get("tau")

    rows = [("MTP loss weight λ during base training", pj["mtp_weight"], jj["mtp_weight"]),
            ("base training steps / tokens", f"{pj['steps']} / {pj['tokens']}", f"{jj['steps']} / {jj['tokens']}"),
            ("held-out next-token loss (nats)", fmt(pj["val_ntp_loss"]), fmt(jj["val_ntp_loss"])),
            ("joint heads' own top-1 % on held-out text (before distillation)", "– (untrained)",
             pct(jj["head_top1_real"])),
            ("heads: frozen-base distillation steps", pf["steps"], jf["steps"]),
            ("head top-1 % on held-out greedy continuations", pct(pf["heldout_greedy"]["top1"]),
             pct(jf["heldout_greedy"]["top1"])),
            ("head top-1 % vs real held-out text", pct(pf["heldout_real"]["top1_vs_text"]),
             pct(jf["heldout_real"]["top1_vs_text"])),
            ("τ chain-4, third-party (simulated)", fmt(tau(pf, "chain-4")), fmt(tau(jf, "chain-4"))),
            ("τ tuned-16, third-party (simulated)", fmt(tau(pf, "tuned-16")), fmt(tau(jf, "tuned-16"))),
            ("τ tuned-64, third-party (simulated)", fmt(tau(pf, "tuned-64")), fmt(tau(jf, "tuned-64"))),
            ("distinct-token ratio of greedy continuations", fmt(pf["thirdparty_greedy"]["distinct_ratio"]),
             fmt(jf["thirdparty_greedy"]["distinct_ratio"]))]
    return md_table(["", "plain LM base + frozen-base heads", "joint MTP base + frozen-base heads"], rows)


def replot():
    """Curves are drawn from the logged rows (records/*_curve.csv), never by hand."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from mtp_lab.train_heads import plot_curve_csv
    for dirpath, _, filenames in os.walk(REC):
        for name in sorted(filenames):
            if name.endswith("_curve.csv"):
                plot_curve_csv(os.path.join(dirpath, name))


def main():
    replot()
    cfg = read_json(os.path.join(HERE, "config.json"))
    corpus = load("corpus.json") or {}
    stages = [j for j in (load("train_joint.json"), load("train_joint_2.json")) if j]
    joint = stages[-1] if stages else {}          # the final state of the base
    frozen = load("train_frozen.json") or {}
    gen = load("tau_generate.json")
    heads_meta = read_json(os.path.join(HERE, "heads", "heads.json"))
    acc = read_json(os.path.join(HERE, "heads", "accuracy.json"))
    compare = {k: {"joint": load(f"compare_{k}", "train_joint.json"), "frozen": load(f"compare_{k}", "train_frozen.json")}
               for k in ("plain", "joint")}
    with open(os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts", "build_embedded_model.sh")) as f:
        script = f.read()
    tp = frozen.get("thirdparty_greedy", {})
    hg = frozen.get("heldout_greedy", {})
    hr = frozen.get("heldout_real", {})
    H = heads_meta["num_heads"]
    sums = checksums()
    total = sum(s for _, _, s in sums)
    env = (gen or {}).get("env", {})
    default_tree = None
    try:
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        from mtp_triton.tree import DEFAULT_TREE
        default_tree = DEFAULT_TREE
    except Exception:
        pass
    best = max(((n, t["tau"]) for n, t in (gen or {}).get("trees", {}).items()), key=lambda x: x[1], default=None)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    model_table = md_table(["", ""], [
        ("architecture", f"`LlamaForCausalLM`, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
                         f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} key-value heads (GQA), "
                         f"head dim {hd}, MLP {cfg['intermediate_size']}"),
        ("vocabulary", f"{cfg['vocab_size']} (byte-level BPE trained on the training split; `<|endoftext|>` = id "
                       f"{cfg['eos_token_id']} is EOS, BOS and PAD)"),
        ("embeddings", "tied" if cfg.get("tie_word_embeddings") else "untied (separate `lm_head.weight`)"),
        ("context", f"{cfg['max_position_embeddings']} positions (RoPE); trained on windows of "
                    f"{joint.get('config', {}).get('seq_len')} tokens"),
        ("parameters", f"{joint.get('params', 0):,} (base) + {H} × ({cfg['hidden_size']}² + {cfg['hidden_size']}) = "
                       f"{H * (cfg['hidden_size'] ** 2 + cfg['hidden_size']):,} (heads)"),
        ("weights", f"fp32 safetensors; the folder totals {total / 2 ** 20:.1f} MiB")])
    stage_table = md_table(["stage", "steps", "tokens", "minutes", "tokens/s", "peak LR", "held-out next-token loss",
                            "joint heads' top-1 on held-out text, %"],
                           [(i + 1, j["steps"], f"{j['tokens']:,}", f"{j['train_seconds'] / 60:.1f}", j["tokens_per_s"],
                             j["config"]["lr"], fmt(j["val_ntp_loss"]), pct(j["head_top1_real"]))
                            for i, j in enumerate(stages)], indent="   ")
    acc_table = md_table(["measured on", "top-1", "top-5"], [
        (f"greedy continuations of {hg.get('prompts')} held-out stdlib prompts (target: the base's greedy token)",
         pct(hg.get("top1", [])), pct(hg.get("top5", []))),
        ("held-out stdlib text, vs the real next tokens", pct(hr.get("top1_vs_text", [])),
         pct(hr.get("top5_vs_text", []))),
        ("held-out stdlib text, vs the base's argmax", pct(hr.get("top1_vs_base", [])),
         pct(hr.get("top5_vs_base", [])))])
    files_table = md_table(["file", "sha256", "bytes"], [(f"`{r}`", f"`{h}`", s) for r, h, s in sums])

    md = f"""# tiny-stdlib-llama — a {joint.get('params', 0) / 1e6:.1f} M-parameter Llama trained on the Python standard library, with {H} MTP heads

Everything in this folder is produced by `scripts/build_embedded_model.sh` on a CPU and rendered into this card by
`make_card.py` from the recorded runs in `records/` (JSON / CSV / PNG). It exists so that the whole project runs
offline: notebooks, tests and benchmarks use it as the target model. It is a toy — a code-completion model that
has read ~{corpus.get('train_tokens', 0) / 1e6:.1f} M tokens — but it is a real `LlamaForCausalLM` whose greedy
continuations make MTP heads and trees measurable.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("data/tiny-stdlib-llama")
tok = AutoTokenizer.from_pretrained("data/tiny-stdlib-llama")
import mtp_triton
engine = mtp_triton.load_model("data/tiny-stdlib-llama")
heads = mtp_triton.load_heads("data/tiny-stdlib-llama/heads")      # {H} heads; heads/accuracy.json -> tuned trees
```

## Model
{model_table}

## Corpus
The standard library of Python {corpus.get('python')} (`{corpus.get('stdlib')}`): {corpus.get('py_files')} `*.py` files
(site-packages and test suites excluded) plus the {corpus.get('doc_topics')} documentation topics of
`pydoc_data/topics.py`; {corpus.get('documents')} documents, split held-out by document (sha256 of the path,
5 %): train {corpus.get('train_documents')} documents / {corpus.get('train_chars', 0):,} characters /
{corpus.get('train_tokens', 0):,} tokens; validation {corpus.get('val_documents')} / {corpus.get('val_chars', 0):,} /
{corpus.get('val_tokens', 0):,}. Corpus sha256 `{corpus.get('sha256')}` (it changes with the Python version: rebuild
with the same version to reproduce). Code in `mtp_lab/corpus.py`.

## Training (CPU, {joint.get('threads')} threads, machine shared with other jobs)
1. **Joint MTP pre-training** (`train_heads joint`): next-token loss + λ = {joint.get('mtp_weight')} × mean of
   {joint.get('num_heads')} head losses (DeepSeek-V3 §2.2; Gloeckle et al. 2024), the heads scored on a random
   {100 * joint.get('config', {}).get('head_frac', 0):.0f} % of positions per step, in {len(stages)} stage(s)
   (each with its own warm-up + cosine schedule; the second continues from the first):

{stage_table}

   In all {sum(j['steps'] for j in stages)} steps, {sum(j['tokens'] for j in stages):,} tokens
   ({sum(j['tokens'] for j in stages) / max(corpus.get('train_tokens', 1), 1):.2f} epochs), {sum(j['train_seconds'] for j in stages) / 60:.1f} min.
   **Held-out next-token loss {fmt(joint.get('val_ntp_loss'))} nats/token** (stdlib validation split); on the
   third-party prompts {fmt((gen or {}).get('prompt_loss_nats'))} nats/token.

""" + "".join(f"   ![joint training curve, stage {i + 1}](records/{n}_curve.png)\n" for i, n in
              enumerate(["train_joint", "train_joint_2"][:len(stages)])) + f"""

2. **Frozen-base self-distillation of {H} heads** (`train_heads frozen`, Medusa-1), initialised from the joint heads
   ({frozen.get('init_heads')} of them; deeper heads start as copies of the deepest): {frozen.get('targets')} targets (KL to the
   base's own distribution {'' if frozen.get('targets') == 'soft' else 'argmax '}at t + h + 1) on cached hidden states of
   {'; '.join(frozen.get('sequences', []))}; {frozen.get('steps')} steps in {frozen.get('train_seconds', 0) / 60:.1f} min
   (+ {frozen.get('generate_seconds', 0) + frozen.get('cache_seconds', 0):.0f} s to generate and cache).

   ![heads training curve](records/train_frozen_curve.png)

Total training time (the budget was 60 min of CPU): {sum(j['train_seconds'] for j in stages) / 60:.1f} min
joint + {frozen.get('train_seconds', 0) / 60:.1f} min heads + {(frozen.get('generate_seconds', 0) + frozen.get('cache_seconds', 0)) / 60:.1f} min
generating and caching = **{(sum(j['train_seconds'] for j in stages) + frozen.get('train_seconds', 0) + frozen.get('generate_seconds', 0) + frozen.get('cache_seconds', 0)) / 60:.1f} min**.
The 4 jointly trained heads are kept in `heads_joint/` (the starting point of step 2); `heads/` holds the final {H}.

## Heads: held-out accuracy (teacher-forced)
Head h predicts the token t + h + 2. Per head, head 0 first, in %:

{acc_table}

`heads/accuracy.json` holds the first row's full matrix `acc[h][r]` (h < {acc['num_heads']}, r < {acc['top_k']}): the
probability that rank r of head h is the base's greedy token; `Tree.from_accuracies(acc, budget)` turns it into the
tuned trees `tuned-N` below. It also records `tree_budget` = {acc.get('tree_budget')}: the size of the tuned tree a
decoder should use by default (set by the `eval` step of the build script).

## τ — tokens per verify step (bonus included), greedy
On the {tp.get('prompts')} held-out prompts of third-party code in `data/prompts/thirdparty_code.jsonl`
({(gen or {}).get('new_tokens', tp.get('new_tokens'))} new tokens each). "Measured" runs `mtp_triton.generate` (kernels
`{(gen or {}).get('kernels', '–')}`{f" = {gen['kernels_used']}" if (gen or {}).get('kernels_used') else ''}, on {env.get('device', '–')}); "simulated" replays the tree acceptance on the
base's greedy continuation with the heads' top-k at every position (exact for greedy decoding, no decoder involved).
{'Every tree reproduced the serial greedy output token for token.' if gen and all(t['identical_to_serial'] for t in gen['trees'].values()) else ''}
The package's default tree is `{default_tree}`.

{tau_table(gen, tp.get('tau_simulated'), hg.get('tau_simulated'))}

{f"Best measured: **{best[0]}, τ = {best[1]:.2f}**." if best else "_τ with `generate` not recorded yet: run the `eval` step of the build script._"}

## Greedy output
Distinct-token ratio of the greedy continuations (distinct / total tokens, averaged over prompts; 1 = no
repetition): third-party prompts {fmt((gen or {}).get('distinct_ratio', tp.get('distinct_ratio')))}, held-out stdlib
prompts {fmt(hg.get('distinct_ratio'))}. Sample (prompt `{(gen or {}).get('sample', {}).get('prompt_id', '')}`, last
40 prompt tokens, then the greedy continuation):

```python
{(gen or {}).get('sample', {}).get('prompt_tail', '')}⟨continuation⟩{(gen or {}).get('sample', {}).get('continuation', tp.get('sample', ''))}
```

## Frozen base vs joint training
Two smaller runs with identical budgets (same steps, batch, schedule, data order and seed), differing only in the
MTP loss weight of the base's training, each followed by the same frozen-base distillation of 4 heads (same data
recipe and steps; the plain base's heads start from zero as in Medusa, the joint base's from its joint heads).
τ here is simulated (exact for greedy, see above) on the third-party prompts:

{comparison(compare['plain'], compare['joint'])}

Reading it: at equal budget the MTP loss costs a little next-token loss (as Gloeckle et al. report for small models)
and buys clearly more predictable hidden states for the heads. Both small bases are far more repetitive than the
committed model (compare the distinct-token ratios), and repetition is what makes their τ high: τ on greedy
output measures how predictable the model's own continuation is, not how good it is.

## Exact commands (`scripts/build_embedded_model.sh`)
```bash
{script.strip()}
```

## Environment
Python {corpus.get('python')}; the `eval` step: {', '.join(f'{k} {v}' for k, v in env.items() if k in ('torch', 'triton', 'python', 'device', 'commit'))}.

## Files (sha256)
{files_table}
"""
    write_text(os.path.join(HERE, "README.md"), md)                 # replaced whole, or left as it was
    print(f"wrote {os.path.join(HERE, 'README.md')} ({len(sums)} files, {total / 2 ** 20:.1f} MiB)")


if __name__ == "__main__":
    main()
