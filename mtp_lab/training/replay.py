"""The held-out measuring core of head distillation: the teacher-forced cache of answers, the heads' ranks on
it, their accuracies and the exact greedy tau of any tree (used by `distill`, `measure` and `retree`).

cache      one teacher-forced pass stores, at every answer position t, the final-norm hidden state x_t and the
           base's own next-token distribution over the draft vocabulary (its top-K, renormalised); a later run with
           more answers extends the cache (`extend_cache`), keeping its draft vocabulary
ranks      at every position, the rank of the base's greedy token t + h + 2 among head h's top-K (`head_ranks`)
tau        greedy MTP emits the serial tokens, so replaying the serial answer with the heads' ranks at each
           accepted position gives the tokens per step a real run would have (`simulate_tau`)
"""
import collections

import torch
import torch.nn.functional as F

from mtp_triton.drafters import bf16_draft
from mtp_triton.generate import causal_chains
from mtp_triton.ops import get_ops


@torch.no_grad()
def answer_hidden(model, rows, batch=16):
    """Per row: x [n, D] (model dtype, CPU), the final-norm hidden states at the positions whose next token is answer
    token 0 .. n-1 (i.e. the last prompt token and the answer tokens but the last), and the answer ids [n]."""
    ops = get_ops("torch", model.device)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]) + len(rows[i]["answer_ids"]))
    res = [None] * len(rows)
    for i in range(0, len(order), batch):
        part = [rows[j] for j in order[i:i + batch]]
        dev = model.device
        tokens, positions, mask, _ = causal_chains([r["prompt_ids"] + r["answer_ids"] for r in part], dev)
        B, S = tokens.shape
        cache = model.new_cache([S] * B)
        h, _, _ = model.forward_tree(tokens, positions, mask, cache, torch.arange(B, device=dev), ops,
                                     check_values=False, exact=False)
        for b, (j, r) in enumerate(zip(order[i:i + batch], part)):
            P, n = len(r["prompt_ids"]), len(r["answer_ids"])
            res[j] = (h[b, P - 1:P - 1 + n].cpu(), torch.tensor(r["answer_ids"]))
    return res


@torch.no_grad()
def build_cache(model, rows, token_map, top_k=16, batch=16, num_heads=4):
    """Flat training arrays over every answer position: x [N, D]; the base's top-K over the draft vocab there
    (rows of lm_head[token_map], renormalised) tgt_idx [N, K], tgt_p [N, K]; greedy [N] the base's greedy token
    (full vocab); root [N] the answer's token after position i (the root the heads read when drafting there);
    ok [N, H]: head h at position i has a target (position i + h + 1 is in the same answer)."""
    lm = model.lm_head.weight.detach()
    sub = lm[token_map]                                                           # [V', D]
    xs, idx, ps, greedy, ok, roots = [], [], [], [], [], []
    for x, ans in answer_hidden(model, rows, batch):
        n = x.shape[0]
        logits = model.logits(x.to(model.device)).float()                        # [n, V]
        greedy.append(logits.argmax(-1).cpu())
        sl = torch.log_softmax(F.linear(x.to(model.device), sub).float(), -1)    # [n, V']
        p, i = sl.exp().topk(top_k, dim=-1)
        idx.append(i.to(torch.int32).cpu())
        ps.append((p / p.sum(-1, keepdim=True)).to(torch.float16).cpu())
        xs.append(x)
        roots.append(ans)
        pos = torch.arange(n)[:, None] + torch.arange(1, num_heads + 1)[None, :]  # [n, H] the target's position
        ok.append(pos <= n - 1)
    return dict(x=torch.cat(xs), tgt_idx=torch.cat(idx), tgt_p=torch.cat(ps), greedy=torch.cat(greedy),
                ok=torch.cat(ok), root=torch.cat(roots), token_map=token_map, top_k=top_k,
                keys=[answer_key(r) for r in rows])


def add_roots(cache, rows):
    """A cache written before `root` was stored: its roots are the rows' answer ids, in order."""
    if "root" not in cache:
        root = torch.cat([torch.tensor(r["answer_ids"]) for r in rows])
        if root.numel() != cache["x"].shape[0]:
            raise ValueError(f"cache has {cache['x'].shape[0]} positions but the answers have {root.numel()} tokens: "
                             "delete the cache file to rebuild it")
        cache["root"] = root
    return cache


def answer_key(r):
    """An answer row's identity in a cache: prompt id and mode (rows made outside `write_answers` may lack them)."""
    return f"{r.get('id')}/{r.get('mode', 'greedy')}"


def cache_keys(cache, rows):
    """The rows a cache covers, in order. A cache written before `keys` was stored covers a prefix of the answers
    file (it was built from the whole file, and answers are only ever appended): the prefix whose token count is
    the cache's size."""
    if "keys" in cache:
        return list(cache["keys"])
    N, n = cache["x"].shape[0], 0
    for k, r in enumerate(rows):
        if n == N:
            return [answer_key(q) for q in rows[:k]]
        n += len(r["answer_ids"])
    if n == N:
        return [answer_key(q) for q in rows]
    raise ValueError(f"cache has {N} positions, which is no prefix of the answers: delete the cache file to rebuild it")


def extend_cache(model, cache, rows, num_heads):
    """Add the rows a cache does not cover yet (new answers), with the cache's own draft vocabulary and top-K (the
    vocabulary is fixed by the first cache built; delete the file to choose it again). -> (cache, rows added)."""
    keys = cache_keys(cache, rows)
    have = set(keys)
    if cache["ok"].shape[1] != num_heads:
        raise ValueError(f"cache was built for {cache['ok'].shape[1]} heads, not {num_heads}: delete it to rebuild")
    if "root" not in cache:
        by_key = {answer_key(r): r for r in rows}
        cache = add_roots(cache, [by_key[k] for k in keys])
    gone = have - {answer_key(r) for r in rows}
    if gone:
        raise ValueError(f"cache holds {len(gone)} answers that are not in the answer rows (e.g. {min(gone)}): "
                         "delete the cache file to rebuild it for this prompt set")
    new = [r for r in rows if answer_key(r) not in have]
    if new:
        more = build_cache(model, new, cache["token_map"], cache["top_k"], num_heads=num_heads)
        for f in ("x", "tgt_idx", "tgt_p", "greedy", "ok", "root"):
            cache[f] = torch.cat([cache[f], more[f]])
    cache["keys"] = keys + [answer_key(r) for r in new]
    return cache, len(new)


def head_inputs(heads, embed, cache, i, dtype):
    """x'_i = x_i + P e_root(i) at positions i (x_i for heads without root input), in `dtype`; embed [V, D]: the
    model's input embedding."""
    x = cache["x"][i].to(dtype)
    return heads.head_input(x, embed[cache["root"][i]].to(dtype) if heads.root_input else None)


def path_inputs(heads, embed, cache, i, x, h):
    """s_h at positions i: x' plus head h's token inputs, teacher-forced (the drafted token at depth j of the path
    that would be accepted is the answer's token t + 1 + j, cache["root"][i + j]); x [len(i), D] = x' there. Only the
    min(h, Q) tokens the head reads are gathered, nearest first."""
    n = min(h, heads.token_inputs)
    if n == 0:
        return x
    N = cache["root"].shape[0]
    recent = torch.stack([embed[cache["root"][(i + h - q).clamp(max=N - 1)]] for q in range(n)], -2)  # [len(i), n, D]
    return heads.path_input(x, recent.to(x.dtype))             # (positions past an answer's end have no target)


@torch.no_grad()
def head_ranks(heads, model, cache, K=8, batch=4096):
    """ranks [N, H]: the rank of the base's greedy token t + h + 2 among head h's top-K at t (K = not found;
    -1 = no target), scoring the draft vocabulary as a bf16 engine on a CPU drafts (`drafters.bf16_draft`). Heads with token inputs read the answer's own
    tokens t + 2 .. t + h + 1 as the path: exactly what they read at the node a greedy step would accept next."""
    sub = model.lm_head.weight.detach()[cache["token_map"]].to(torch.bfloat16)
    tmap = cache["token_map"]
    N, H = cache["x"].shape[0], heads.num_heads
    out = torch.full((N, H), -1, dtype=torch.int64)
    w, b = heads.res_weight.detach().to(torch.bfloat16), heads.res_bias.detach().to(torch.bfloat16)
    embed = model.embed_tokens.weight.detach()
    for s in range(0, N, batch):
        pos = torch.arange(s, min(s + batch, N))
        x = head_inputs(heads, embed, cache, pos, torch.bfloat16)
        for h in range(H):
            xh = path_inputs(heads, embed, cache, pos, x, h)
            top = bf16_draft(xh, w[h:h + 1], b[h:h + 1], sub, K, token_map=tmap)[0][:, 0]   # [n, K] token ids
            t = torch.arange(s, s + x.shape[0]) + h + 1
            valid = cache["ok"][s:s + x.shape[0], h]
            want = cache["greedy"][t.clamp(max=N - 1)]
            hit = top == want[:, None]
            r = torch.where(hit.any(-1), hit.float().argmax(-1), K)
            out[s:s + x.shape[0], h] = torch.where(valid, r, -1)
    return out


def accuracy(ranks, K=8):
    """acc [H, K]: acc[h, r] = P(rank r of head h is the base's greedy token), over positions with a target."""
    H = ranks.shape[1]
    acc = torch.zeros(H, K, dtype=torch.float64)
    for h in range(H):
        r = ranks[:, h]
        r = r[r >= 0]
        for k in range(K):
            acc[h, k] = (r == k).double().mean() if r.numel() else 0.0
    return acc


def simulate_tau(ranks, lengths, tree):
    """Exact greedy tau of `tree` on held-out answers from the heads' ranks (see the module docstring, step 5).

    ranks [N, H] concatenated per answer (lengths: positions per answer). At answer index j the step accepts the
    longest tree path (m_1 .. m_d) with m_k = ranks[j, k - 1] (the rank of the true token j + k among head k-1's
    candidates), then moves to j + accepted + 1."""
    children = collections.defaultdict(dict)
    for i, p in enumerate(tree.paths[1:], 1):
        children[p[:-1]][p[-1]] = p
    emitted = steps = 0
    start = 0
    for n in lengths:
        j = 0
        r = ranks[start:start + n].tolist()
        while j < n - 1:
            path, d = (), 0
            while d < len(r[j]) and r[j][d] >= 0 and r[j][d] in children[path]:
                path = children[path][r[j][d]]
                d += 1
            emitted += min(d + 1, n - 1 - j)            # drafts + bonus, but nothing past the answer's end
            j += d + 1
            steps += 1
        start += n
    return emitted / max(steps, 1)


def lengths_of(rows):
    return [len(r["answer_ids"]) for r in rows]
