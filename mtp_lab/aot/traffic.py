"""Bytes each kernel launch must move through HBM, and the bandwidth floor that follows.

One formula per @triton.jit kernel, written from what the kernel reads and writes. Each counts *compulsory*
traffic: every byte the launch must read or write, counted once (re-reads that a perfect L2 would serve are not
counted; where the amount depends on runtime values — accepted tokens, the walk down the tree — the least any
launch moves is counted). So `min_bytes / HBM bandwidth` is a floor: no launch of that shape can finish sooner.

`a` maps the kernel's parameter names to what the launcher passed (`driver.TensorInfo` for tensors: shape,
itemsize, nbytes; plain values for ints and constexprs); `case` is the launch-matrix entry (`launches.Case`), for
the quantities that live in tensor *values* (cache_lens) and so are not visible in the arguments.
"""


def _resblock(a, case):
    # reads x [B, D], res_weight [H, D, D], res_bias [H, D] (not with RES off: z = x); writes z [B, H, D]: as hi + lo
    # halves (SPLIT_OUT) or fp32
    z = a["z_hi_ptr"].nbytes + (a["z_lo_ptr"].nbytes if a["SPLIT_OUT"] else 0)
    weights = a["w_ptr"].nbytes + a["b_ptr"].nbytes if a.get("RES", True) else 0
    return a["x_ptr"].nbytes + weights + z


def _vocab_tile(a, case):
    # reads z [R, D] (hi + lo halves when SPLIT, else fp32) and the LM head rows [G, V, D] once; writes per (row,
    # vocab tile) TOP_K int64 keys, m and s fp32
    z = a["z_hi_ptr"].nbytes + (a["z_lo_ptr"].nbytes if a["SPLIT"] else 0)
    return z + a["lm_ptr"].nbytes + a["key_ptr"].nbytes + a["m_ptr"].nbytes + a["s_ptr"].nbytes


def _merge(a, case):
    # reads the partials (keys [R, NT, TOP_K] int64, m, s [R, NT] fp32) and, with a draft vocabulary (HAS_MAP), the
    # token_map entries of the selected rows: R * TOP_K int64 (as many bytes as ids), at most the whole map;
    # writes ids int64 + logprobs fp32 [R, TOP_K]
    mapped = min(a["map_ptr"].nbytes, a["ids_ptr"].nbytes) if a["HAS_MAP"] else 0
    return sum(a[k].nbytes for k in ("key_ptr", "m_ptr", "s_ptr", "ids_ptr", "logp_ptr")) + mapped


def _visible_cache(a, case):
    """(cached tokens, block-table entries) a launch must read per sequence: all case.ctx tokens, or with a sliding
    window W (USE_WINDOW) the last W - 1 of them: the root sits at position ctx and sees positions p > ctx - W; a
    deeper node sees no older position (the kernel reads no cache tile older than the shallowest row's window)."""
    ctx, BS = case.ctx, a["BS"]
    lo = max(0, ctx - a["window"] + 1) if a.get("USE_WINDOW") else 0
    if ctx <= lo:
        return 0, 0
    return ctx - lo, (ctx - 1) // BS - lo // BS + 1


def _tree_attention(a, case):
    # q [B, T, Hq, Dh] read; the cached K and V that some node can see, 2 * B * tokens * Hkv * Dh * elt (only the
    # ctx tokens in use, or a window's, not the whole block pool); the tree K/V [B, T, Hkv, Dh] x 2 (every node sees
    # itself); the mask [T, T] (or [B, T, T]) as bytes; the block-table entries of those tokens (int32) and
    # cache_lens [B] int32; with a window, the node depths (count_ptr, [T] or [B, T] int32).
    # Output: out [B, T, Hq, Dh] without split-KV (SPLIT false), else the fp32 partials [n_splits, B, T, Hq, Dh] and
    # their lse [n_splits, B, T, Hq] (the run-time split count: the launcher allocates exactly n_splits slices).
    q, k_tree, mask = a["q_ptr"], a["k_tree_ptr"], a["mask_ptr"]
    B, T, Hq, Dh = q.shape
    tokens, entries = _visible_cache(a, case)
    cache = 2 * B * tokens * a["Hkv"] * Dh * q.itemsize
    tables = B * entries * 4 + B * 4
    depths = a["count_ptr"].nbytes if a.get("USE_WINDOW") else 0
    out = a["part_ptr"].nbytes + a["lse_ptr"].nbytes if a["SPLIT"] else a["out_ptr"].nbytes
    return q.nbytes + cache + 2 * k_tree.nbytes + mask.nbytes + tables + depths + out


def _exact_tree_attention(a, case):
    # the batch-invariant variant: as `_tree_attention` (each sequence's visible cache counted once: at best its
    # nodes share it through L2), with the ancestor table [B, T, T] and depths [B, T] int32 instead of the mask, and
    # out [B, T, Hq, Dh] (no split-KV)
    q = a["q_ptr"]
    B, T, Hq, Dh = q.shape
    tokens, entries = _visible_cache(a, case)
    cache = 2 * B * tokens * a["Hkv"] * Dh * q.itemsize
    return (q.nbytes + cache + 2 * a["k_tree_ptr"].nbytes + a["anc_ptr"].nbytes + a["depth_ptr"].nbytes
            + B * entries * 4 + B * 4 + a["out_ptr"].nbytes)


def _combine_splits(a, case):
    # reads n_splits fp32 partials [R, Dh] and lse [R] (the run-time count, not the MAX_SPLITS bucket); writes
    # out [R, Dh] in q's dtype
    R, Dh, S = a["R"], a["Dh"], a["n_splits"]
    return S * R * (Dh + 1) * 4 + R * Dh * a["out_ptr"].itemsize


def _tree_accept(a, case):
    # reads draft, parents, target tokens; writes accept_len [B], accept_nodes [B, T], next_token [B] (all int64)
    return sum(a[k].nbytes for k in ("draft_ptr", "parents_ptr", "target_ptr", "accept_len_ptr",
                                     "accept_nodes_ptr", "next_ptr"))


def _tree_accept_sums(a, case):
    # reads every node's target distribution once (probs [B, T, V]); writes the chunk and group sums and counts
    return a["probs_ptr"].nbytes + sum(a[k].nbytes for k in ("sums_ptr", "nnz_ptr", "gsums_ptr", "gnnz_ptr"))


def _tree_accept_walk(a, case):
    # per sequence, whatever is accepted: p_parent(x_c) of every non-root node (T - 1 gathers, read for all
    # accept tests at once), the group sums of the parents (the root's at least: NG) and the group counts of the
    # last node (NG), one group's CPP chunk sums and counts, and one chunk of probabilities (min(CHUNK, V) ids) for
    # the residual draw; plus tokens, parents, uniforms and the outputs
    B, T, V = a["probs_ptr"].shape
    NG, CPP, CHUNK = a["NG"], a["CPP"], a["CHUNK"]
    elt, acc = a["probs_ptr"].itemsize, a["sums_ptr"].itemsize
    per_seq = NG * (acc + 4) + CPP * (acc + 4) + min(CHUNK, V) * elt + (T - 1) * elt
    small = sum(a[k].nbytes for k in ("draft_ptr", "parents_ptr", "u_accept_ptr", "u_sample_ptr",
                                      "accept_len_ptr", "accept_nodes_ptr", "next_ptr"))
    return B * per_seq + small


def _kv_append(a, case):
    # per layer and sequence at least the root's K and V row [Hkv * Dh] are read from the tree buffers and written
    # to the cache: 2 (K, V) x 2 (read, write) x L x B x ROW x elt; each accepted draft adds the same again.
    # Index reads: accept_len, cache_lens, one block-table entry and accept_nodes[b, 0] per sequence.
    L, B = a["k_tree_ptr"].shape[:2]
    elt = a["k_tree_ptr"].itemsize
    return 2 * 2 * L * B * a["ROW"] * elt + B * (8 + 4 + 4 + 8)


MIN_BYTES = {
    "_resblock_kernel": _resblock,
    "_vocab_tile_kernel": _vocab_tile,
    "_merge_kernel": _merge,
    "_tree_attention_kernel": _tree_attention,
    "_exact_tree_attention_kernel": _exact_tree_attention,
    "_combine_splits_kernel": _combine_splits,
    "_tree_accept_kernel": _tree_accept,
    "_tree_accept_sums_kernel": _tree_accept_sums,
    "_tree_accept_walk_kernel": _tree_accept_walk,
    "_kv_append_kernel": _kv_append,
}


def min_bytes(kernel, args, case):
    """Compulsory HBM bytes of one launch, or None for a kernel without a formula (say so in the report)."""
    formula = MIN_BYTES.get(kernel)
    return None if formula is None else int(formula(args, case))


def floor_us(nbytes, bytes_per_s):
    """The bandwidth floor in microseconds: nbytes / bandwidth."""
    return None if nbytes is None else nbytes / bytes_per_s * 1e6
