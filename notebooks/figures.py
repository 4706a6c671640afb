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
