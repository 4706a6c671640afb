"""Candidate trees (Medusa-style): which top-k ranks of which heads are verified together.

A tree is a set of paths of top-k ranks. The path (r1, r2, ..., rd) is the node whose draft token is
rank r_d of head d-1, child of the node (r1, ..., r_{d-1}); the root () is the last committed token.
With H heads the deepest node has depth H. Nodes are ordered by depth, then lexicographically, so
parents always come before children (parents[i] < i) and the root is node 0.

Example:
    >>> t = Tree.from_choices([(0,), (1,), (0, 0)])
    >>> t.parents.tolist(), t.depth.tolist(), t.rank.tolist()
    ([-1, 0, 0, 1], [0, 1, 1, 2], [0, 0, 1, 0])
"""
from dataclasses import dataclass
import heapq
import operator

import torch


def _rank(r, path):
    """A top-k rank as an int; ValueError for anything but an integer (bools and floats included)."""
    if isinstance(r, bool) or getattr(r, "dtype", None) == torch.bool:
        raise ValueError(f"Tree: ranks must be integers, got {r!r} in {path!r}")
    try:
        return operator.index(r)
    except TypeError:
        raise ValueError(f"Tree: ranks must be integers, got {r!r} ({type(r).__name__}) in {path!r}; a float "
                         "rank is not rounded") from None


@dataclass(frozen=True)
class Tree:
    paths: tuple          # tuple of rank tuples, node order; paths[0] == () is the root
    parents: torch.Tensor  # [T] int64, parents[0] = -1
    depth: torch.Tensor    # [T] int64, root 0
    rank: torch.Tensor     # [T] int64, top-k rank of the node's draft token (root 0)
    mask: torch.Tensor     # [T, T] bool, mask[i, j] = j is i or an ancestor of i

    @property
    def size(self):
        """T: number of nodes, root included."""
        return len(self.paths)

    @property
    def max_depth(self):
        return int(self.depth.max())

    @property
    def top_k(self):
        """How many candidates per head the tree needs (max rank + 1)."""
        return int(self.rank.max()) + 1

    @classmethod
    def from_choices(cls, choices, top_k=None, num_heads=None):
        """Build from Medusa-style choices: an iterable of rank paths, e.g. [(0,), (1,), (0, 0)].

        Ranks must be integers (int, numpy or torch integers): a float, bool, string or None is refused, never
        truncated (0.7 is not rank 0)."""
        if isinstance(choices, (str, bytes, dict)) or not hasattr(choices, "__iter__"):
            raise ValueError(f"Tree: choices must be a list of paths (tuples of top-k ranks, e.g. [[0], [1], [0, 0]]), "
                             f"got {choices!r}")
        paths = []
        for c in choices:
            if isinstance(c, (str, bytes, dict)) or not hasattr(c, "__iter__"):
                raise ValueError(f"Tree: each choice must be a tuple of ranks, got {c!r}")
            path = tuple(_rank(r, c) for r in c)
            if len(path) == 0:
                raise ValueError("Tree: the empty path is the root; leave it out of the choices")
            if any(r < 0 for r in path):
                raise ValueError(f"Tree: ranks must be >= 0, got {path}")
            if top_k is not None and any(r >= top_k for r in path):
                raise ValueError(f"Tree: rank in {path} is >= top_k={top_k}")
            if num_heads is not None and len(path) > num_heads:
                raise ValueError(f"Tree: path {path} is deeper than the {num_heads} heads")
            paths.append(path)
        if len(set(paths)) != len(paths):
            dup = sorted({p for p in paths if paths.count(p) > 1})
            raise ValueError(f"Tree: duplicate paths {dup}")
        known = set(paths)
        for p in paths:
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"Tree: path {p} has no parent path {p[:-1]} in the choices")
        ordered = [()] + sorted(paths, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(ordered)}
        T = len(ordered)
        parents = torch.tensor([-1] + [index[p[:-1]] for p in ordered[1:]], dtype=torch.int64)
        depth = torch.tensor([len(p) for p in ordered], dtype=torch.int64)
        rank = torch.tensor([0] + [p[-1] for p in ordered[1:]], dtype=torch.int64)
        rows = [[False] * T for _ in range(T)]             # node i sees its ancestors p[:d] and itself
        for i, p in enumerate(ordered):
            for d in range(len(p) + 1):
                rows[i][index[p[:d]]] = True
        return cls(tuple(ordered), parents, depth, rank, torch.tensor(rows))

    @classmethod
    def root_only(cls):
        """T = 1: the serial step."""
        return cls.from_choices([])

    @classmethod
    def chain(cls, n):
        """A depth-n chain of top-1 drafts: MTP-n in the MTP-on-NPU report's table (n tokens predicted per step)."""
        return cls.from_choices([(0,) * d for d in range(1, n + 1)])

    @classmethod
    def from_accuracies(cls, acc, budget):
        """The tree of `budget` non-root nodes maximising the expected accepted length.

        acc [H, K]: acc[h, r] = measured probability that rank r of head h is the target's token
        (per-head top-k accuracy, Medusa §3.3 / Sequoia). Assuming independence, the path (r1..rd)
        is accepted with probability prod_d acc[d-1, r_d], and E[accepted drafts] is the sum of
        that over the tree's nodes. A child never beats its parent, so taking the `budget` most
        probable paths (best-first search) gives a prefix-closed, optimal tree.
        """
        acc = torch.as_tensor(acc, dtype=torch.float64)
        if acc.dim() != 2 or acc.numel() == 0:
            raise ValueError(f"Tree.from_accuracies: acc must be [H, K], got {tuple(acc.shape)}")
        if budget < 0:
            raise ValueError("Tree.from_accuracies: budget must be >= 0")
        H, K = acc.shape
        order = torch.argsort(acc, dim=1, descending=True, stable=True)  # ranks by accuracy per head
        heap = [(-float(acc[0, order[0, 0]]), (int(order[0, 0]),), 0)]  # (-prob, path, index of rank in order)
        chosen = []
        while heap and len(chosen) < budget:
            negp, path, j = heapq.heappop(heap)
            chosen.append(path)
            d = len(path)
            if j + 1 < K:   # next sibling (next best rank at the same head)
                r = int(order[d - 1, j + 1])
                sib = path[:-1] + (r,)
                parent_p = -negp / float(acc[d - 1, path[-1]]) if acc[d - 1, path[-1]] > 0 else 0.0
                heapq.heappush(heap, (-parent_p * float(acc[d - 1, r]), sib, j + 1))
            if d < H:       # first child
                r = int(order[d, 0])
                heapq.heappush(heap, (negp * float(acc[d, r]), path + (r,), 0))
        return cls.from_choices(chosen)

    def expected_accept_len(self, acc):
        """E[accepted drafts] for this tree under independent per-head accuracies acc [H, K]."""
        acc = torch.as_tensor(acc, dtype=torch.float64)
        total = 0.0
        for p in self.paths[1:]:
            prob = 1.0
            for d, r in enumerate(p):
                prob *= float(acc[d, r]) if d < acc.shape[0] and r < acc.shape[1] else 0.0
            total += prob
        return total

    def to(self, device):
        return Tree(self.paths, self.parents.to(device), self.depth.to(device), self.rank.to(device),
                    self.mask.to(device))


# A smooth illustrative accuracy profile for 4 heads x 10 ranks: head h's rank-r candidate is right with
# probability 0.6 * 0.75**h * 0.5**r (top-1 60/45/34/25 %, roughly the shape Medusa reports). The medusa-N
# presets are the best N-node trees for it; `Tree.from_accuracies` builds one from *measured* accuracies.
TYPICAL_ACC = [[0.6 * 0.75 ** h * 0.5 ** r for r in range(10)] for h in range(4)]

# Named presets (lists of choices). chain-n is a depth-n chain of top-1 drafts, "MTP-n" (needs n heads).
PRESETS = {f"chain-{n}": [(0,) * d for d in range(1, n + 1)] for n in (1, 2, 3, 4, 5, 8)}
for _n in (8, 16, 32, 64):
    PRESETS[f"medusa-{_n}"] = list(Tree.from_accuracies(TYPICAL_ACC, _n).paths[1:])
DEFAULT_TREE, DEFAULT_BUDGET = "medusa-16", 16


def default_tree(num_heads=None):
    """The package default: medusa-16, the best 16-node tree for TYPICAL_ACC (3 deep). For fewer heads than it
    needs, the best 16-node tree for the first num_heads heads of that profile (at most 10 ranks a head), so the
    default fits any heads; for 3 or more heads it is medusa-16 itself."""
    preset = Tree.from_choices(PRESETS[DEFAULT_TREE])
    if num_heads is None or preset.max_depth <= num_heads:
        return preset
    if num_heads < 1:
        raise ValueError(f"the default tree needs at least one head, got num_heads={num_heads}")
    return Tree.from_accuracies(TYPICAL_ACC[:num_heads], DEFAULT_BUDGET)


def _named_size(name, prefix):
    """N of a name 'prefix-N' (a positive int), else None."""
    if not name.startswith(prefix + "-"):
        return None
    n = name[len(prefix) + 1:]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"tree {name!r}: {prefix}-N needs a positive integer N")
    return int(n)


def is_tree_name(name):
    """True for every name `get_tree` knows (checked before a model loads, so a typo fails in a second)."""
    try:
        return name in PRESETS or name == "tuned" or any(
            _named_size(name, p) for p in ("chain", "width", "tuned"))
    except ValueError:
        return False


def get_tree(tree, num_heads=None, *, accuracy=None, budget=None):
    """A Tree from a Tree, a list of choices, or a name; checked against num_heads. The names:

        None        the package default, `default_tree(num_heads)`, which always fits the heads
        a preset    'medusa-16', 'chain-4', ... (`PRESETS`)
        'chain-N'   N top-1 drafts in a line (any N)
        'width-K'   K candidates (top-K ranks) of every head, hanging off the top-1 chain: num_heads * K nodes
                    besides the root (the candidate-count sweep); needs num_heads
        'tuned'     the best `budget`-node tree (default DEFAULT_BUDGET) for the measured accuracies `accuracy`
                    [H, K]; without accuracies, the package default
        'tuned-N'   the best N-node tree for `accuracy` (required)

    A tree deeper than the heads is refused (never cut silently)."""
    if tree is None:
        return default_tree(num_heads)
    if isinstance(tree, str):
        name = tree
        if name in PRESETS:
            tree = Tree.from_choices(PRESETS[name])
        elif _named_size(name, "chain"):
            tree = Tree.chain(_named_size(name, "chain"))
        elif _named_size(name, "width"):
            if num_heads is None:
                raise ValueError(f"tree {name!r} needs num_heads")
            k = _named_size(name, "width")
            tree = Tree.from_choices([(0,) * d + (r,) for d in range(num_heads) for r in range(k)])
        elif name == "tuned" or _named_size(name, "tuned"):
            if accuracy is None and name == "tuned":
                return default_tree(num_heads)
            if accuracy is None:
                raise ValueError(f"tree {name!r} needs the heads' accuracies (an accuracy.json beside the heads)")
            tree = Tree.from_accuracies(accuracy, _named_size(name, "tuned") or budget or DEFAULT_BUDGET)
        else:
            raise ValueError(f"unknown tree preset {name!r}; presets: {sorted(PRESETS)}, or 'chain-N', 'width-K', "
                             "'tuned', 'tuned-N'")
    elif not isinstance(tree, Tree):
        tree = Tree.from_choices(tree)
    if num_heads is not None and tree.max_depth > num_heads:
        raise ValueError(f"tree depth {tree.max_depth} exceeds the {num_heads} heads available")
    return tree


class SubTrees:
    """A fixed candidate tree cut to each step's depth limits (cut trees cached), with the parents that switch a
    row's nodes off.

    A step of A rows with depth limits d_a verifies the tree cut to depth max_a d_a; row a's nodes deeper than d_a
    get parent -1, so they are computed and never accepted. budget: the most nodes a step verifies (the whole
    tree), and room(B) the cache positions a step may append past a row's length: the same, whatever the batch."""
    fixed = True                        # the same candidate tree every step (CUDA graphs can capture its sizes)

    def __init__(self, tree):
        self.full = tree
        self.budget, self.max_depth = tree.size, tree.max_depth
        self.by_depth = {tree.max_depth: tree}

    def room(self, batch):
        return self.budget

    def for_depths(self, depths):
        """depths [A] -> (the tree for the deepest row, parents [T] if every row uses it whole, else [A, T] with -1
        past a row's depth)"""
        d = max(depths)
        if d not in self.by_depth:
            keep = [p for p in self.full.paths[1:] if len(p) <= d]
            self.by_depth[d] = Tree.from_choices(keep).to(self.full.parents.device)
        tree = self.by_depth[d]
        if min(depths) == d:
            return tree, tree.parents
        limit = torch.tensor(depths, device=tree.parents.device)
        return tree, torch.where(tree.depth[None, :] > limit[:, None], -1, tree.parents[None, :])


class DrawnTrees:
    """The trees of a drafter that draws its own every step (a dynamic tree: at most `nodes` nodes per row, `depth`
    deep, top_k ranks per node): there is no candidate tree to cut (for_depths gives None), and a step verifies the
    union of the rows' own trees. Each row keeps up to nodes - 1 drafts, and a rank path of depth d is one of top_k^d,
    so a step verifies at most

        room(B) = min(B (nodes - 1), top_k + top_k^2 + .. + top_k^depth) + 1  nodes."""
    fixed = False

    def __init__(self, nodes, depth, top_k):
        self.budget, self.max_depth = nodes, depth
        self.paths = sum(top_k ** d for d in range(1, depth + 1))                 # rank paths below the root

    def room(self, batch):
        return min(batch * (self.budget - 1), self.paths) + 1

    def for_depths(self, depths):
        return None, None
