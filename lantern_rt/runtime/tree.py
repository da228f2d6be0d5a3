"""Static draft trees: presets, validation and the bookkeeping derived from a list of paths.

A tree is a list of paths; each path is a tuple of sibling ranks (0 = first child drawn at that
node), so ``(0, 2)`` is the third child of the first child of the root. The root (node 0) is the
last committed token. Nodes are numbered 0 = root, then 1..N sorted by (depth, path).
"""

from __future__ import annotations

import itertools
import json
import re
import reprlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern_rt.errors import LanternError

MAX_DEPTH = 32
MAX_NODES = 1024  # the presets have under 60 nodes; a verify call scores N + 1 tokens
MAX_TREE_FILE_BYTES = 1 << 20

TreePath = tuple[int, ...]


class TreeError(LanternError, ValueError):
    """A tree specification is invalid; the message says what to fix."""


def _parse_paths(text: str) -> tuple[TreePath, ...]:
    """Paths written as ``[0],[1],[0,0]`` (the notation of docs/method.md §3)."""
    return tuple(tuple(int(v) for v in group.split(",")) for group in re.findall(r"\[([\d,\s]+)\]", text))


PRESETS: dict[str, tuple[TreePath, ...]] = {
    "naive_extend_57": _parse_paths(
        "[0],[1],[2],[3],[4],"
        "[0,0],[0,1],[0,2],[0,3],[1,0],[1,1],[1,2],[2,0],[2,1],[2,2],[3,0],[3,1],[4,0],"
        "[0,0,0],[0,0,1],[0,0,2],[0,0,3],[0,1,0],[0,1,1],[0,1,2],[0,2,0],[0,2,1],[0,2,2],[0,3,0],[0,3,1],"
        "[1,0,0],[1,0,1],[1,1,0],[2,0,0],"
        "[0,0,0,0],[0,0,0,1],[0,0,0,2],[0,0,0,3],[0,0,1,0],[0,0,1,1],[0,0,1,2],[0,0,2,0],[0,0,2,1],"
        "[0,0,3,0],[0,1,0,0],[0,1,0,1],[0,1,1,0],[0,2,0,0],"
        "[0,0,0,0,0],[0,0,0,0,1],[0,0,0,0,2],[0,0,0,1,0],[0,0,0,1,1],[0,0,1,0,0],[0,0,1,0,1],[0,0,1,1,0],"
        "[0,0,2,0,0]"
    ),
    "mc_sim_7b_63": _parse_paths(
        "[0],[1],[2],[3],[0,0],[0,1],[0,2],[1,0],[1,1],[2,0],[2,1],[3,0],[0,0,0],[0,0,1],[0,0,2],"
        "[0,1,0],[0,1,1],[0,2,0],[0,2,1],[1,0,0],[0,0,0,0],[0,0,0,1],[0,0,0,2],[0,0,0,0,0],[0,0,0,0,1]"
    ),
}

_CHAIN = re.compile(r"chain-(\d{1,9})")  # more digits: an unknown tree, not a huge int()
_PAC = re.compile(r"pac-(\d{1,9})-(\d{1,9})-(\d{1,9})")
MAX_PAC_WIDTH = 10  # candidates per position of a pac tree (drawn without replacement)


def _node_key(path: TreePath) -> tuple[int, TreePath]:
    return len(path), path


class derived:
    """A property of a :class:`StaticTree` computed when the tree is made (``__post_init__``)
    and stored on it: reading it is a plain attribute read, with no lock (functools'
    ``cached_property`` takes an ``RLock`` on Python 3.11, which ``torch.compile`` cannot trace
    inside a decode step)."""

    def __init__(self, compute):
        self.compute, self.name, self.__doc__ = compute, compute.__name__, compute.__doc__

    def __get__(self, tree, owner=None):
        return self if tree is None else tree.__dict__[self.name]


@dataclass(frozen=True)
class StaticTree:
    """A validated tree (build it with :func:`build_tree`); every derived table is computed once,
    when the tree is made."""

    name: str
    paths: tuple[TreePath, ...]  # sorted by (depth, path): paths[i - 1] is node i

    def __post_init__(self) -> None:
        for name, value in vars(StaticTree).items():  # in definition order: each reads the ones above
            if isinstance(value, derived):
                self.__dict__[name] = value.compute(self)

    @property
    def num_nodes(self) -> int:
        """N, the number of drafted nodes (the root excluded)."""
        return len(self.paths)

    @derived
    def parents(self) -> tuple[int, ...]:
        """Parent node id of every node (root -1)."""
        index = {path: i + 1 for i, path in enumerate(self.paths)}
        index[()] = 0
        return (-1, *(index[path[:-1]] for path in self.paths))

    @derived
    def depths(self) -> tuple[int, ...]:
        return (0, *(len(path) for path in self.paths))

    @derived
    def ranks(self) -> tuple[int, ...]:
        return (0, *(path[-1] for path in self.paths))

    @derived
    def parent(self) -> Tensor:
        """LongTensor [N+1], root -1."""
        return torch.tensor(self.parents, dtype=torch.long)

    @derived
    def depth(self) -> Tensor:
        """LongTensor [N+1], root 0: the position offset of each node."""
        return torch.tensor(self.depths, dtype=torch.long)

    @derived
    def rank(self) -> Tensor:
        """LongTensor [N+1], root 0: which drawn sibling each node is."""
        return torch.tensor(self.ranks, dtype=torch.long)

    @derived
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Child node ids of every node, in rank order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return tuple(tuple(k) for k in kids)

    @derived
    def ancestors(self) -> tuple[tuple[int, ...], ...]:
        """Node ids from depth 1 down to each node (the node included; empty for the root)."""
        chains: list[tuple[int, ...]] = [()]
        for node, parent in enumerate(self.parents[1:], start=1):
            chains.append((*chains[parent], node))
        return tuple(chains)

    @derived
    def mask(self) -> Tensor:
        """BoolTensor [N+1, N+1]: row i is True at i, its ancestors and the root."""
        mask = torch.zeros(self.num_nodes + 1, self.num_nodes + 1, dtype=torch.bool)
        for node, chain in enumerate(self.ancestors):
            mask[node, [0, *chain]] = True
        return mask

    @derived
    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf node ids (root excluded), one per leaf in node order."""
        return tuple(
            chain for chain, kids in zip(self.ancestors[1:], self.children[1:], strict=True) if not kids
        )

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    @property
    def is_chain(self) -> bool:
        """Whether each node is the one child of the node before (the root alone included): an
        accepted path then keeps nodes 0..length, in order."""
        return self.max_depth == self.num_nodes

    @derived
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Node ids at each depth 0..max_depth; ``levels[0] == (0,)``."""
        return tuple(
            tuple(i for i, d in enumerate(self.depths) if d == depth) for depth in range(self.max_depth + 1)
        )

    @derived
    def width(self) -> int:
        """Most children of any node: how many distinct tokens the drafter draws per node."""
        return max(len(kids) for kids in self.children)


ROOT_ONLY = StaticTree(name="none", paths=())
"""No drafted nodes: each target call scores the root alone (plain autoregressive decoding)."""


def _show(path: TreePath) -> str:
    return str(list(path))


def _as_path(raw: Any) -> TreePath:
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or not raw:
        raise TreeError(f"each path must be a non-empty list of sibling ranks, got {reprlib.repr(raw)}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in raw):
        raise TreeError(f"ranks must be integers >= 0, got path {reprlib.repr(raw)}")
    return tuple(raw)


def _check_shape(paths: Sequence[TreePath], max_width: int | None) -> None:
    """Depth limit, width limit and duplicates."""
    seen: set[TreePath] = set()
    for path in paths:
        if len(path) > MAX_DEPTH:
            raise TreeError(f"path {_show(path)} has depth {len(path)}; the maximum is {MAX_DEPTH}")
        if max_width is not None and max(path) >= max_width:
            raise TreeError(
                f"path {_show(path)} uses rank {max(path)}; ranks must be < the drafter width {max_width}"
            )
        if path in seen:
            raise TreeError(f"path {_show(path)} appears twice; list each path once")
        seen.add(path)


def _check_closed(paths: set[TreePath]) -> None:
    """Every proper prefix present, and siblings contiguous from rank 0."""
    for path in sorted(paths, key=_node_key):
        if len(path) > 1 and path[:-1] not in paths:
            raise TreeError(f"path {_show(path)} needs its parent {_show(path[:-1])}; add it")
        if path[-1] > 0 and (*path[:-1], path[-1] - 1) not in paths:
            missing = _show((*path[:-1], path[-1] - 1))
            raise TreeError(
                f"path {_show(path)} skips sibling {missing}; siblings must be contiguous from rank 0"
            )


def build_tree(
    paths: Iterable[Sequence[int]], name: str = "custom", max_width: int | None = None
) -> StaticTree:
    """Validate ``paths`` and number the nodes; ``max_width`` bounds every rank when given."""
    if isinstance(paths, (str, bytes)):
        raise TreeError(f"a tree is a list of paths, got {paths!r}")
    if max_width is not None and max_width < 1:
        raise TreeError(f"max_width must be >= 1, got {max_width}")
    parsed = [_as_path(raw) for raw in paths]
    if not parsed:
        raise TreeError("a tree needs at least one path, e.g. [[0]]")
    if len(parsed) > MAX_NODES:
        raise TreeError(f"a tree has at most {MAX_NODES} paths (nodes), got {len(parsed)}")
    _check_shape(parsed, max_width)
    _check_closed(set(parsed))
    return StaticTree(name=name, paths=tuple(sorted(parsed, key=_node_key)))


def chain_tree(n: int) -> StaticTree:
    """``chain-n``: one path of depth ``n`` (classic speculative decoding)."""
    if not 1 <= n <= MAX_DEPTH:
        raise TreeError(f"chain-N needs 1 <= N <= {MAX_DEPTH}, got chain-{n}")
    return build_tree([(0,) * d for d in range(1, n + 1)], name=f"chain-{n}")


def pac_tree(k: int, d: int, n: int) -> StaticTree:
    """``pac-K-D-N``: the full K-ary tree down to depth D (K candidates per position, drawn without
    replacement), then a chain along rank 0 below its first leaf, N nodes in all: the static
    window of SJD-PAC (docs/method.md §11)."""
    if not 2 <= k <= MAX_PAC_WIDTH:
        raise TreeError(f"pac-K-D-N needs 2 <= K <= {MAX_PAC_WIDTH} candidates per position, got K={k}")
    full = sum(k**i for i in range(1, d + 1)) if 1 <= d <= MAX_DEPTH else MAX_NODES + 1
    if d < 1 or full > min(n, MAX_NODES):
        raise TreeError(
            f"pac-{k}-{d}-{n}: the full {k}-ary tree down to depth D={d} has {full} nodes; D must be "
            f">= 1 and that count at most N={n} (and {MAX_NODES})"
        )
    if d + n - full > MAX_DEPTH:
        raise TreeError(f"pac-{k}-{d}-{n} is {d + n - full} deep; the maximum is {MAX_DEPTH}: lower N")
    paths = [p for depth in range(1, d + 1) for p in itertools.product(range(k), repeat=depth)]
    paths += [(0,) * depth for depth in range(d + 1, d + n - full + 1)]
    return build_tree(paths, name=f"pac-{k}-{d}-{n}")


def pac_shape(tree: StaticTree) -> tuple[int, int] | None:
    """(K, D) when ``tree`` is the pac tree its name says (:func:`pac_tree`), else None."""
    match = _PAC.fullmatch(tree.name)
    if not match:
        return None
    k, d, n = map(int, match.groups())
    try:
        return (k, d) if pac_tree(k, d, n).paths == tree.paths else None
    except TreeError:
        return None


def _read_json(file: Path) -> Any:
    try:
        if file.stat().st_size > MAX_TREE_FILE_BYTES:
            raise TreeError(f"tree file {file} is over {MAX_TREE_FILE_BYTES >> 20} MiB: not a tree of paths")
        return json.loads(file.read_bytes().decode("utf-8"))
    except OSError as err:
        raise TreeError(f"cannot read tree file {file}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise TreeError(f"tree file {file} is not text (not UTF-8): is it a JSON file?") from None
    except json.JSONDecodeError as err:
        raise TreeError(f"tree file {file} is not valid JSON: {err}") from None
    except RecursionError:
        raise TreeError(f"tree file {file} nests lists too deeply: a path is a flat list of ranks") from None


def _tree_from_json(data: Any, default_name: str, max_width: int | None) -> StaticTree:
    name = default_name
    if isinstance(data, dict):
        name = data.get("name", default_name)
        if not isinstance(name, str) or "paths" not in data:
            raise TreeError(
                'a tree JSON object needs "paths" (a list of paths) and an optional string "name"'
            )
        data = data["paths"]
    if not isinstance(data, list):
        raise TreeError(
            f'a tree JSON file holds a list of paths or {{"name", "paths"}}, got {type(data).__name__}'
        )
    return build_tree(data, name=name, max_width=max_width)


def load_tree(spec: str, max_width: int | None = None) -> StaticTree:
    """A preset name, ``chain-N``, ``pac-K-D-N`` (:func:`pac_tree`), or a JSON file of paths (a list, or ``{"name", "paths"}``)."""
    if spec in PRESETS:
        return build_tree(PRESETS[spec], name=spec, max_width=max_width)
    if match := _CHAIN.fullmatch(spec):
        return chain_tree(int(match.group(1)))
    if match := _PAC.fullmatch(spec):
        return pac_tree(*map(int, match.groups()))
    file = Path(spec)
    if not file.is_file():
        known = ", ".join(PRESETS)
        raise TreeError(
            f"unknown tree {spec!r}: use {known}, chain-N, pac-K-D-N or the path of a JSON file of paths"
        )
    data = _read_json(file)
    try:
        return _tree_from_json(data, file.stem, max_width)
    except TreeError as err:
        raise TreeError(f"tree file {file}: {err}") from None


def tree_to_json(tree: StaticTree) -> dict[str, Any]:
    """``{"name", "paths"}`` for manifests; :func:`load_tree` reads it back."""
    return {"name": tree.name, "paths": [list(path) for path in tree.paths]}
