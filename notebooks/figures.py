"""Small matplotlib helpers shared by the lessons: pictures drawn from a kernel's own index math, never typed in."""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle


def _cell(ax, x, y, color, text=None, fontsize=7, edge="white", hatch=None):
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, lw=0.8, hatch=hatch))
    if text is not None:
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=fontsize)


def _frame(ax, width, height, title, xlabel=None, ylabel=None):
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)                      # row 0 at the top, like a matrix
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)


def draw_tree_attention_program(case, b, kvh, block_m, block_n):
    """What ONE program (sequence b, KV head kvh) of a one-tile-per-(sequence, KV head) tree-attention kernel reads.

    case: tree_attention inputs (q [B, T, Hq, Dh], k_cache [NB, BS, Hkv, Dh], block_table [B, max_blocks],
    cache_lens [B], tree_mask [T, T]). Four panels, all from the kernel's index math:
      1. the grid: one program per (b, kvh); program (b, kvh) serves query heads kvh*G .. kvh*G + G-1 (G = Hq/Hkv)
      2. its query tile: row r <-> tree node r // G, query head kvh*G + r % G; rows >= G*T are padding
      3. the cache pool, NB blocks x BS slots: position n of sequence b lives in block block_table[b, n // BS],
         slot n % BS; colour = which BLOCK_N-wide key tile of the loop reads it
      4. the tree keys: row r sees tree node j iff tree_mask[r // G, j]
    Returns the figure.
    """
    B, T, Hq, _ = case["q"].shape
    NB, BS, Hkv, _ = case["k_cache"].shape
    G = Hq // Hkv
    table, lens, mask = case["block_table"].cpu(), case["cache_lens"].cpu(), case["tree_mask"].cpu()
    node_colors = plt.get_cmap("tab10")
    tile_colors = plt.get_cmap("Blues")

    fig = plt.figure(figsize=(11, 7.2))
    grid = fig.add_gridspec(2, 3, height_ratios=[block_m, BS + 4], width_ratios=[Hkv + 1, 4, T + 2])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :]),
            fig.add_subplot(grid[0, 2])]

    # 1. the grid
    ax = axes[0]
    _frame(ax, Hkv, B, "the grid: one program per\n(sequence, KV head)", "KV head", "sequence")
    for s in range(B):
        for k in range(Hkv):
            chosen = (s, k) == (b, kvh)
            _cell(ax, k, s, "tab:orange" if chosen else "0.85",
                  f"b={s}, kvh={k}\nheads {k * G}..{k * G + G - 1}", fontsize=6, edge="k" if chosen else "white")

    # 2. the query tile
    ax = axes[1]
    _frame(ax, 4, block_m, f"its query tile: BLOCK_M = {block_m} rows\n(G = {G} heads x T = {T} nodes)")
    for r in range(block_m):
        if r < G * T:
            t, h = r // G, kvh * G + r % G
            _cell(ax, 0, r, node_colors(t % 10), f"{r}", fontsize=6)
            ax.text(1.1, r + 0.5, f"node {t}, head {h}", va="center", fontsize=7)
        else:
            _cell(ax, 0, r, "0.92", f"{r}", fontsize=6, hatch="//")
            ax.text(1.1, r + 0.5, "padding (masked)", va="center", fontsize=7, color="0.4")
    for side in ax.spines.values():
        side.set_visible(False)

    # 3. the cache pool (blocks as columns), and which slots this program reads
    owner = {}
    for s in range(B):
        for c in range(table.shape[1]):
            blk = int(table[s, c])
            if blk >= 0 and c * BS < int(lens[s]):
                owner[blk] = (s, c)
    n_tiles = max(1, -(-int(lens[b]) // block_n))
    ax = axes[2]
    _frame(ax, NB, BS + 2, f"the paged cache, {NB} blocks x {BS} slots: sequence {b}'s {int(lens[b])} tokens "
           f"(blue; shade = key tile 0..{n_tiles - 1} of BLOCK_N = {block_n} positions), other sequences' (grey), "
           "empty slots (dotted)", "block id (label above: sequence, block-table column)")
    ax.set_ylim(BS, -2)
    ax.set_xticks([blk + 0.5 for blk in range(NB)])
    ax.set_xticklabels([str(blk) for blk in range(NB)], fontsize=7)
    for blk in range(NB):
        s, c = owner.get(blk, (None, None))
        for slot in range(BS):
            if s == b and c * BS + slot < int(lens[b]):
                tile = (c * BS + slot) // block_n
                _cell(ax, blk, slot, tile_colors(0.35 + 0.6 * tile / max(1, n_tiles - 1)))
            elif s is not None and c * BS + slot < int(lens[s]):
                _cell(ax, blk, slot, "0.8")
            else:
                _cell(ax, blk, slot, "0.97", hatch="..")
        if s is not None:
            ax.text(blk + 0.5, -0.5, f"s{s}\nc{c}", ha="center", fontsize=6.5,
                    color="k" if s == b else "0.45", weight="bold" if s == b else "normal")

    # 4. the tree keys under the ancestor mask
    ax = axes[3]
    _frame(ax, T, block_m, "the tree keys each row sees\n(ancestor mask of its node)", "tree node j")
    for r in range(block_m):
        for j in range(T):
            sees = r < G * T and bool(mask[r // G, j])
            _cell(ax, j, r, node_colors((r // G) % 10) if sees else "0.95")
    ax.set_xticks([j + 0.5 for j in range(T)])
    ax.set_xticklabels([str(j) for j in range(T)], fontsize=7)

    fig.suptitle(f"program (b={b}, kvh={kvh}): its Q tile, the {n_tiles} key tile(s) of {block_n} cached positions "
                 f"it reads through block_table[{b}], then the tree", fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------------------
# 04-kv-append: the paged cache, the append grid, one program's copy, three KV layouts


def _seq_color(b):
    """Colour of sequence b (04-kv-append)."""
    return ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:olive")[b % 6]


def paged_cache_figure(owner, cached, arrows, T, accepted, BS, b_shown, title=""):
    """The block pool of a paged cache and where one sequence's accepted tree nodes go.

    owner [NB]: the sequence owning each block (-1: free). cached [NB][BS] bool: slot holds history before this
    step. arrows: (node, block, offset) for every token the step appends for sequence b_shown. T: tree nodes;
    accepted: the accepted node ids of b_shown in path order (root first). Drawn: the tree buffer of b_shown
    (top) and the pool, blocks in id order with their slots (bottom).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    NB = len(owner)
    gap = 0.6
    fig, ax = plt.subplots(figsize=(min(13, 1.0 + NB * (BS + gap) * 0.33), 3.2))
    tx0 = max(0.0, (NB * (BS + gap) - T * 1.2) / 2)                     # centre the tree buffer
    for n in range(T):
        acc = n in accepted
        ax.add_patch(Rectangle((tx0 + n * 1.2, 3), 1, 1, fc=_seq_color(b_shown) if acc else "0.92", ec="k", lw=0.6,
                               alpha=0.9 if acc else 1.0))
        ax.text(tx0 + n * 1.2 + 0.5, 3.5, str(n), ha="center", va="center", fontsize=8)
    ax.text(tx0 - 0.3, 3.5, f"tree buffer of seq {b_shown}\n(node ids)", ha="right", va="center", fontsize=8)
    for blk in range(NB):
        x0 = blk * (BS + gap)
        for s in range(BS):
            o = owner[blk]
            fc = "white" if o < 0 else _seq_color(o)
            alpha = 0.35 if (o >= 0 and not cached[blk][s]) else 0.85
            ax.add_patch(Rectangle((x0 + s, 0), 1, 1, fc=fc, ec="k", lw=0.5, alpha=alpha if o >= 0 else 1.0))
        label = f"block {blk}" + ("\nfree" if owner[blk] < 0 else f"\nseq {owner[blk]}")
        ax.text(x0 + BS / 2, -0.15, label, ha="center", va="top", fontsize=7)
    for j, (node, blk, off) in enumerate(arrows):
        sx, dx = tx0 + node * 1.2 + 0.5, blk * (BS + gap) + off + 0.5
        ax.annotate("", xy=(dx, 1.05), xytext=(sx, 2.95),
                    arrowprops=dict(arrowstyle="->", color="k", lw=1.0))
        ax.text(dx, 0.5, f"j{j}", ha="center", va="center", fontsize=7, fontweight="bold")
    ax.set_xlim(-0.5, NB * (BS + gap))
    ax.set_ylim(-1.1, 4.3)
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def append_grid_figure(dest, accept_len, n_chunks):
    """The launch grid of the append, one panel per sequence b.

    dest [B][max_tokens][L * n_chunks]: the cache slot the program (layer * n_chunks + chunk, j, b) writes, or -1
    for a program that exits at once (j > accept_len[b]).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    B = len(dest)
    fig, axes = plt.subplots(1, B, figsize=(3.0 * B, 2.5), squeeze=False)
    for b in range(B):
        d = np.array(dest[b])                                    # [max_tokens, L * n_chunks]
        ax = axes[0][b]
        ax.imshow(d >= 0, cmap="Blues", vmin=-0.3, vmax=1.3, aspect="auto", origin="lower")
        for (j, c), v in np.ndenumerate(d):
            ax.text(c, j, "exit" if v < 0 else f"s{v}", ha="center", va="center", fontsize=7,
                    color="0.5" if v < 0 else "k")
        ax.set_xticks(range(d.shape[1]), [f"l{c // n_chunks}c{c % n_chunks}" for c in range(d.shape[1])],
                      fontsize=7)
        ax.set_yticks(range(d.shape[0]))
        ax.set_xlabel("axis 0: layer x row chunk", fontsize=8)
        if b == 0:
            ax.set_ylabel("axis 1: token j", fontsize=8)
        ax.set_title(f"axis 2: sequence b = {b} (accept_len {accept_len[b]})", fontsize=8)
    fig.suptitle("one program per cell; s = destination slot (block * BS + offset)", fontsize=9)
    fig.tight_layout()
    return fig


def one_program_figure(tree_rows, cache_rows, row_len, src, dst, tree_breaks, cache_breaks, title=""):
    """What ONE program of the append reads and writes, on the flat [rows, Hkv*Dh] views of a tree buffer and a
    cache. src, dst: (row, first column, end column) of the chunk it copies; tree_breaks / cache_breaks: rows
    where a new layer starts (drawn as lines)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    views = ((axes[0], tree_rows, src, tree_breaks, "k_tree as [L*B*T, Hkv*Dh]", "reads"),
             (axes[1], cache_rows, dst, cache_breaks, "k_cache as [L*NB*BS, Hkv*Dh]", "writes"))
    for ax, n_rows, (r, c0, c1), breaks, name, verb in views:
        img = np.zeros((n_rows, row_len))
        img[r, :] = 1                                            # the token's row
        img[r, c0:c1] = 2                                        # the chunk this program copies
        ax.imshow(img, cmap="Greys", vmin=0, vmax=2.2, aspect="auto", interpolation="nearest")
        ax.add_patch(Rectangle((c0 - 0.5, r - 0.5), c1 - c0, 1, fill=False, ec="tab:red", lw=2))
        ax.annotate(f"{verb} row {r}, elements {c0}..{c1 - 1}", xy=(c0 - 0.5, r), xytext=(0.2, r - n_rows * 0.22),
                    fontsize=8, color="tab:red", arrowprops=dict(arrowstyle="->", color="tab:red"))
        starts = [0] + list(breaks)
        for k, y in enumerate(starts):
            if y:
                ax.axhline(y - 0.5, color="tab:blue", lw=0.8)
            ax.text(row_len - 0.6, y + 0.5, f"layer {k}", ha="right", va="top", fontsize=7, color="tab:blue")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("element within the token row", fontsize=8)
        ax.set_ylabel("token row", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def kv_layouts_figure(panels, width, read):
    """Where each token of each sequence sits in three KV layouts holding the same rows.

    panels: {layout name: (rows [B][capacity] = storage row of position p of sequence b, number of rows)}.
    The storage is drawn row-major, `width` rows per line; a cell shows "b:p". read: (b, n) outlines the rows of
    sequence b's first n positions (what attention reads).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.6), squeeze=False)
    rb, n_read = read
    for ax, (name, (rows, n_rows)) in zip(axes[0], panels.items()):
        where = {r: (b, p) for b, seq in enumerate(rows) for p, r in enumerate(seq)}
        lines = -(-n_rows // width)
        for r in range(n_rows):
            x, y = r % width, lines - 1 - r // width
            b, p = where.get(r, (-1, -1))
            read_here = b == rb and p < n_read
            ax.add_patch(Rectangle((x, y), 1, 1, fc=_seq_color(b) if b >= 0 else "white", alpha=0.55,
                                   ec="k", lw=2.0 if read_here else 0.4))
            ax.text(x + 0.5, y + 0.5, f"{b}:{p}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, width)
        ax.set_ylim(0, lines)
        ax.set_aspect("equal")
        ax.set_axis_off()
        ax.set_title(name, fontsize=9)
    fig.suptitle(f"storage rows (b:p = position p of sequence b); bold: sequence {rb}'s first {n_read} positions",
                 fontsize=9)
    fig.tight_layout()
    return fig


# ---- 06-profiling-and-speedup-tables, 07-evaluation: measurement pictures, drawn from rows --------------------
def roofline_figure(machines, marks=(1, 16, 64), title=""):
    """Attainable FLOP/s against arithmetic intensity I (FLOPs per byte moved): min(peak, bandwidth x I).

    machines: [(label, peak FLOP/s, bytes/s)]. marks: intensities marked on every line; for a verify step of T
    tree nodes over bf16 weights (2 FLOPs per 2-byte weight per node) I = T. The ridge point peak / bandwidth is
    where a machine stops being memory-bound. Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = np.logspace(-0.3, 3.3, 200)
    for k, (label, peak, bw) in enumerate(machines):
        color = plt.get_cmap("tab10")(k)
        ax.plot(xs, np.minimum(peak, bw * xs), color=color, lw=1.5,
                label=f"{label}: ridge at {peak / bw:.0f} FLOP/B")
        for m in marks:
            ax.plot([m], [min(peak, bw * m)], "o", color=color, ms=4)
    for m in marks:
        ax.axvline(m, color="0.8", lw=0.6, zorder=0)
        ax.text(m, 0.02, f" T={m}", fontsize=7, color="0.4", rotation=90, va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte); bf16 verify step of T nodes: I = T")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def cost_ratio_figure(curves, title=""):
    """c(T) = time(T-node verify step) / time(1-node step) against T. curves: [(label, Ts, cs, style)], style a
    matplotlib format string ('o-' for measured points, '--' for a model). The grey lines c = 1 (every node free,
    memory-bound) and c = T (every node full price, compute-bound) bound every curve."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    tmax = max(max(ts) for _, ts, _, _ in curves)
    ax.plot([1, tmax], [1, 1], color="0.6", lw=0.8, ls=":", label="c = 1 (memory-bound: nodes are free)")
    ax.plot([1, tmax], [1, tmax], color="0.6", lw=0.8, ls="-.", label="c = T (compute-bound)")
    for label, ts, cs, style in curves:
        ax.plot(ts, cs, style, label=label, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tree nodes T (root included)")
    ax.set_ylabel("c(T)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def published_speedups_figure(entries, title=""):
    """Horizontal bars of published speedups. entries: [(label, speedup, group)]; one colour per group (e.g. the
    hardware), a line at 1x (no gain)."""
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(g for _, _, g in entries))
    colors = {g: plt.get_cmap("tab10")(i) for i, g in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(8.0, 0.2 * len(entries) + 1.2))
    ys = range(len(entries))
    ax.barh(list(ys), [s for _, s, _ in entries], color=[colors[g] for _, _, g in entries])
    ax.set_yticks(list(ys), [lab for lab, _, _ in entries], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    for y, (_, s, _) in zip(ys, entries):
        ax.text(s, y, f" {s:.2f}x", va="center", fontsize=6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[g]) for g in groups]
    ax.legend(handles, groups, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="hardware",
              title_fontsize=6)
    ax.set_xlim(0, max(s for _, s, _ in entries) * 1.15)
    ax.set_xlabel("speedup over the same system's serial decoding (x)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def tau_cost_figure(points, title=""):
    """When MTP pays: tau (tokens per step) against c (time of an MTP step / time of a serial step), one labelled
    point per (label, c, tau). Speedup = tau / c, so points above the diagonal tau = c are faster than serial."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    hi = max(max(c for _, c, _ in points), max(t for _, _, t in points)) * 1.15
    ax.fill_between([0, hi], [0, hi], [hi, hi], color="tab:green", alpha=0.08, label="tau > c: MTP faster")
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="tau = c: break-even")
    for k, (label, c, tau) in enumerate(points):
        ax.plot([c], [tau], "o", ms=5)
        ax.annotate(f"{label} ({tau / c:.2f}x)", (c, tau), fontsize=7, xytext=(4, -10 + 9 * (k % 3)),
                    textcoords="offset points")                    # staggered: nearby points keep readable labels
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("c = MTP step time / serial step time")
    ax.set_ylabel("tau = tokens per MTP step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def mtp_step_figure(labels, parents, depth, accepted, bonus, title=""):
    """One MTP step drawn from its tensors: the candidate tree, the accepted path and the bonus token.

    labels [T]: each node's token as text (node 0 = the root, the newest committed token); parents [T] (-1 for the
    root); depth [T]; accepted: the accepted nodes in path order, root first; bonus: the bonus token's text (the
    target's choice after the deepest accepted node). Column d holds the depth-d nodes (drafted by head d - 1) in
    node order; the accepted path is green, the bonus blue (one column right of the deepest accepted node, in a row
    above the tree).
    """
    import matplotlib.pyplot as plt

    T = len(labels)
    row, count = [0] * T, {}
    for i in range(T):
        d = int(depth[i])
        row[i] = count.get(d, 0)
        count[d] = row[i] + 1
    D = max(count)
    fig, ax = plt.subplots(figsize=(1.5 * (D + 2), 0.9 + 0.36 * max(count.values())))
    on_path = set(accepted)
    for i in range(1, T):
        p = int(parents[i])
        both = i in on_path and p in on_path
        ax.plot([depth[p], depth[i]], [-row[p], -row[i]], color="tab:green" if both else "0.8",
                lw=2 if both else 0.8, zorder=1)
    for i in range(T):
        face = "tab:green" if i in on_path else "white"
        ax.text(depth[i], -row[i], labels[i], ha="center", va="center", fontsize=7, zorder=3,
                color="white" if i in on_path else "k",
                bbox=dict(boxstyle="round,pad=0.25", fc=face, ec="0.4", lw=0.6))
    last = accepted[-1]                                   # the bonus goes one level deeper, in a row of its own
    bx, by = depth[last] + 1, 1.0
    ax.annotate("", xy=(bx - 0.3, by - 0.15), xytext=(depth[last] + 0.25, -row[last] + 0.15),
                arrowprops=dict(arrowstyle="->", color="tab:blue"))
    ax.text(bx, by, "bonus " + bonus, ha="center", va="center", fontsize=7, color="white", zorder=3,
            bbox=dict(boxstyle="round,pad=0.25", fc="tab:blue", ec="tab:blue"))
    ax.set_xticks(range(D + 1), ["root"] + [f"depth {d}\nhead {d - 1}" for d in range(1, D + 1)], fontsize=7)
    ax.set_yticks([])
    ax.set_xlim(-0.6, D + 1.6)
    ax.set_ylim(-max(count.values()) + 0.4, 1.5)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def tau_by_category_figure(cats, tau, accept, simulated=None, title=""):
    """Left: tau (tokens per verify step) per category, measured, with the simulated value as a marker if given.
    Right: acceptance rate per depth, one line per category. cats [C]; tau [C]; accept [C][depths]; simulated [C]."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    x = range(len(cats))
    axes[0].bar(x, tau, color="tab:blue", label="measured here")
    if simulated is not None:
        axes[0].scatter(x, simulated, color="k", marker="_", s=400, zorder=3, label="simulated (training record)")
    axes[0].set_xticks(list(x), cats, rotation=25, fontsize=8)
    axes[0].set_ylabel("tau (tokens / step)")
    axes[0].legend(fontsize=7)
    for c, a in zip(cats, accept):
        axes[1].plot(range(1, len(a) + 1), a, marker="o", ms=3, label=c)
    axes[1].set_xticks(range(1, max(len(a) for a in accept) + 1))
    axes[1].set_xlabel("depth")
    axes[1].set_ylabel("acceptance rate")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def depth_trace_figure(traces, title=""):
    """traces {config name: {sequence label: [depth at each step]}}: one panel per runtime configuration. The k-th
    sequence's line is drawn 0.07 * k higher, so that equal depths stay visible as two lines."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(2.6 * len(traces), 2.4), sharey=True, squeeze=False)
    for ax, (name, seqs) in zip(axes[0], traces.items()):
        for k, (label, ds) in enumerate(seqs.items()):
            ax.step(range(len(ds)), [d + 0.07 * k for d in ds], where="post", label=label, lw=1.2)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("draft depth (0 = serial)", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def per_head_figure(panels, ylabel="accuracy", title=""):
    """panels {panel title: {series label: [value per head]}}: grouped bars, one group per head."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 2.8), sharey=True, squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        n = len(series)
        for k, (label, vals) in enumerate(series.items()):
            ax.bar([h + (k - (n - 1) / 2) * 0.8 / n for h in range(len(vals))], vals, 0.8 / n, label=label)
        H = max(len(v) for v in series.values())
        ax.set_xticks(range(H), [f"head {h}\n(t+{h + 2})" for h in range(H)], fontsize=7)
        ax.set_title(name, fontsize=8)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel, fontsize=8)
    axes[0][0].set_ylim(0, 1)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------------------
# 03a-tree-attention: a token tree beside its attention mask

def tree_and_mask_figure(parents, labels=None, cache_len=0, title=""):
    """A token tree beside its attention mask, as in Medusa's figure (Cai et al. 2024, arXiv 2401.10774).

    parents [T] (-1 for the root; parents come first); labels [T]: each node's text (default: its index);
    cache_len: cached positions drawn left of the tree keys (every node sees them). Left: the tree, one column per
    depth, node i on row i; right: the [T, cache_len + T] mask, row i = what node i's query sees, column j = key j.
    A node, its row's label and the keys it sees share one colour (its depth: the head that drafted it)."""
    import matplotlib.pyplot as plt

    parents = [int(p) for p in parents]
    T = len(parents)
    labels = [str(i) for i in range(T)] if labels is None else list(labels)
    depth, seen = [0] * T, [{i} for i in range(T)]
    for i in range(1, T):
        if parents[i] >= 0:
            depth[i] = depth[parents[i]] + 1
            seen[i] |= seen[parents[i]]
    color = [plt.get_cmap("tab10")(d % 10) for d in depth]
    D = max(depth)
    fig, (ax, am) = plt.subplots(1, 2, figsize=(3.2 + 1.1 * D + 0.32 * (cache_len + T), 1.2 + 0.3 * T),
                                 gridspec_kw=dict(width_ratios=[1.1 * (D + 1), 0.32 * (cache_len + T) + 0.6]))
    for i in range(1, T):
        if parents[i] >= 0:
            ax.plot([depth[parents[i]], depth[i]], [parents[i], i], color="0.55", lw=0.9, zorder=1)
    for i in range(T):
        ax.text(depth[i], i, labels[i], ha="center", va="center", fontsize=7, color="white", zorder=3,
                bbox=dict(boxstyle="round,pad=0.25", fc=color[i], ec="0.3", lw=0.5))
    ax.set_xticks(range(D + 1), ["root"] + [f"depth {d}\n(head {d - 1})" for d in range(1, D + 1)], fontsize=7)
    ax.set_yticks([])
    ax.set_xlim(-0.5, D + 0.5)
    ax.set_ylim(T - 0.5, -0.5)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title("the tree (node i on row i)", fontsize=9)

    for i in range(T):
        for c in range(cache_len):
            am.add_patch(plt.Rectangle((c, i), 1, 1, fc="0.7", ec="white", lw=0.5))
        for j in range(T):
            am.add_patch(plt.Rectangle((cache_len + j, i), 1, 1, fc=color[j] if j in seen[i] else "0.95",
                                       ec="white", lw=0.5))
    if cache_len:
        am.axvline(cache_len, color="r", lw=1)
    am.set_xlim(0, cache_len + T)
    am.set_ylim(T, 0)                                    # row i level with node i of the tree
    am.set_xticks([c + 0.5 for c in range(cache_len + T)],
                  [f"c{c}" for c in range(cache_len)] + labels, fontsize=7, rotation=90)
    am.set_yticks([i + 0.5 for i in range(T)], labels, fontsize=7)
    for tick, i in zip(am.get_yticklabels(), range(T)):
        tick.set_color(color[i])
    for tick, j in zip(am.get_xticklabels()[cache_len:], range(T)):
        tick.set_color(color[j])
    am.set_xlabel("key: " + ("cached position | " if cache_len else "") + "tree node", fontsize=8)
    am.set_ylabel("query: tree node", fontsize=8)
    am.set_title("its attention mask (coloured: visible)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def split_v_figure(pid_r, pid_v, valid, pick, blocks, tile, tops, D):
    """Lesson 02's split-V grid: which program owns each logit (r, j), what program `pick` reads (its LM-head rows,
    its z rows) and its logits tile with the tile top-k numbered. pid_r [R pad, 1], pid_v [1, V pad], valid [R pad,
    V pad] come from the kernel's index math (offs = pid * BLOCK + arange(BLOCK)); tops[r] = the top-k ids of tile
    row r (local to the tile)."""
    import torch
    from matplotlib.colors import ListedColormap

    (BLOCK_R, BLOCK_V), (i0, v0) = blocks, pick
    R, V = int(valid[:, 0].sum()), int(valid[0].sum())
    NR, NT = pid_r.shape[0] // BLOCK_R, pid_v.shape[1] // BLOCK_V
    r0, c0 = i0 * BLOCK_R, v0 * BLOCK_V
    owner = torch.where(valid, ((pid_r + pid_v) % 2).float(), float("nan"))
    owner[(pid_r == i0) & (pid_v == v0) & valid] = 2.0
    lm_read = torch.zeros(D, NT * BLOCK_V)
    lm_read[:, c0:min(c0 + BLOCK_V, V)] = 2.0
    lm_read[:, V:] = float("nan")
    z_read = torch.zeros(NR * BLOCK_R, D)
    z_read[r0:r0 + BLOCK_R] = 2.0
    z_read[R:] = float("nan")
    cmap = ListedColormap(["#deebf7", "#9ecae1", "#08519c"])       # two program shades, and the program we follow
    cmap.set_bad("#d9d9d9")                                         # masked: past R or past V
    fig = plt.figure(figsize=(11, 4.6))
    gs = fig.add_gridspec(2, 2, width_ratios=(3.2, 1), height_ratios=(1, 1.4))
    panels = ((gs[0, 0], owner, f"the grid: program (i, v) computes logits [rows of block i] x [ids of tile v]; "
               f"R={R}, V={V}", "vocabulary id j", "row r = b*H + h"),
              (gs[1, 0], lm_read, f"program {pick} reads lm_head[{c0}:{c0 + BLOCK_V}] (drawn transposed, [D, V]): "
               "no other program reads these rows", "vocabulary id j", "d"),
              (gs[0, 1], z_read, f"... and z[{r0}:{r0 + BLOCK_R}] (rows >= {R} masked)", "d", "row r"))
    for spec, img, title, xlabel, ylabel in panels:
        ax = fig.add_subplot(spec)
        ax.imshow(img, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if img is owner:
            for i in range(NR):
                for v in range(NT):
                    cx = (v * BLOCK_V + min((v + 1) * BLOCK_V, V)) / 2 - 0.5      # centre of the unmasked part
                    cy = (i * BLOCK_R + min((i + 1) * BLOCK_R, R)) / 2 - 0.5
                    ax.text(cx, cy, f"({i},{v})", ha="center", va="center", fontsize=8,
                            color="w" if (i, v) == tuple(pick) else "k")
    ax = fig.add_subplot(gs[1, 1])
    ax.imshow(tile, cmap="Greys", alpha=0.5, aspect="auto", interpolation="nearest")
    for r, top in enumerate(tops):
        for rank, j in enumerate(top):
            ax.text(j, r, str(rank + 1), ha="center", va="center", fontsize=9, color="tab:red", fontweight="bold")
    ax.set_title(f"its logits tile in registers, tile top-{len(tops[0])} numbered", fontsize=9)
    ax.set_xlabel(f"id - {c0}")
    ax.set_ylabel(f"row - {r0}")
    fig.tight_layout()
    return fig


def speedup_ladder_figure(panels, title=""):
    """Speedup ladders side by side, one panel per machine: panels = [(panel title, rungs)], rungs bottom to top as
    dicts(label, tok_s, ratio_text, note): a horizontal bar per rung (tokens/s), the ratio over the rung it names
    at the bar's end, and the rung's tau and c(T) (or what else it says) under its label."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 0.75 * max(len(r) for _, r in panels) + 1.3),
                             squeeze=False)
    for ax, (ptitle, rungs) in zip(axes[0], panels):
        y = range(len(rungs))
        ax.barh(list(y), [r["tok_s"] for r in rungs], color=[f"C{i}" for i in y], alpha=0.8)
        top = max(r["tok_s"] for r in rungs)
        for i, r in enumerate(rungs):
            ax.text(r["tok_s"] + 0.01 * top, i, r.get("ratio_text", ""), va="center", fontsize=8)
        ax.set_yticks(list(y))
        ax.set_yticklabels([f"{r['label']}\n{r.get('note', '')}".strip() for r in rungs], fontsize=8)
        ax.set_xlim(0, top * 1.55)
        ax.set_xlabel("decode tokens/s (batch 1)")
        ax.set_title(ptitle, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def step_timeline_figure(lanes, total_ms, title=""):
    """A profiler timeline of one step: lanes = {lane name: [(start_ms, duration_ms, category)]}, one row of spans per
    lane (e.g. the host's ops, the device's kernels), coloured by category."""
    import matplotlib.pyplot as plt
    cats = list(dict.fromkeys(c for spans in lanes.values() for _, _, c in spans))
    color = {c: f"C{i}" for i, c in enumerate(cats)}
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(lanes) + 1.2))
    for i, (lane, spans) in enumerate(lanes.items()):
        for c in cats:
            bars = [(s, d) for s, d, k in spans if k == c]
            if bars:
                ax.broken_barh(bars, (i - 0.35, 0.7), color=color[c], label=c if i == 0 or c not in
                               {k for sp in list(lanes.values())[:i] for _, _, k in sp} else None)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(lanes), fontsize=8)
    ax.set_xlim(0, total_ms)
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=7, ncol=min(len(cats), 5), loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig
