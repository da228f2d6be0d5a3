"""Static trees: presets, derived tables, loading and validation."""

from __future__ import annotations

import json

import pytest
import torch

from lantern_rt.runtime.tree import (
    MAX_DEPTH,
    PRESETS,
    TreeError,
    build_tree,
    load_tree,
    pac_shape,
    tree_to_json,
)


@pytest.mark.parametrize(
    ("name", "nodes", "per_level", "width"),
    [("naive_extend_57", 57, [5, 13, 16, 14, 9], 5), ("mc_sim_7b_63", 25, [4, 8, 8, 3, 2], 4)],
)
def test_presets(name: str, nodes: int, per_level: list[int], width: int) -> None:
    tree = load_tree(name)
    assert tree.name == name and set(PRESETS) == {"naive_extend_57", "mc_sim_7b_63"}
    assert tree.num_nodes == nodes == len(PRESETS[name])
    assert tree.max_depth == 5
    assert [len(level) for level in tree.levels] == [1, *per_level]
    assert tree.width == width
    assert tree.depth.tolist() == [d for d, level in enumerate(tree.levels) for _ in level]
    assert len(tree.leaf_paths) == sum(1 for kids in tree.children[1:] if not kids)


def test_hand_tree_tables() -> None:
    # Given out of order on purpose: nodes are numbered by (depth, path).
    tree = build_tree([(1,), (0, 1), (0,), (0, 0), (0, 0, 0)], name="hand")
    #   node: 1=(0,) 2=(1,) 3=(0,0) 4=(0,1) 5=(0,0,0)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.num_nodes == 5
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 3]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert tree.children == ((1, 2), (3, 4), (), (5,), (), ())
    assert tree.levels == ((0,), (1, 2), (3, 4), (5,))
    assert tree.leaf_paths == ((2,), (1, 4), (1, 3, 5))
    assert tree.width == 2 and tree.max_depth == 3
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert tree.mask.dtype == torch.bool
    assert tree.mask.int().tolist() == expected


def test_mask_matches_parents_on_preset() -> None:
    tree = load_tree("naive_extend_57")
    for node in range(tree.num_nodes + 1):
        seen, walk = {node}, node
        while walk > 0:
            walk = int(tree.parent[walk])
            seen.add(walk)
        assert set(torch.nonzero(tree.mask[node]).flatten().tolist()) == seen


def test_chain() -> None:
    tree = load_tree("chain-4")
    assert tree.name == "chain-4"
    assert tree.paths == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert tree.leaf_paths == ((1, 2, 3, 4),)
    assert tree.width == 1 and tree.max_depth == 4
    assert tree.mask.int().tolist() == torch.tril(torch.ones(5, 5, dtype=torch.int)).tolist()
    assert load_tree("chain-1").num_nodes == 1
    for bad in ("chain-0", f"chain-{MAX_DEPTH + 1}"):
        with pytest.raises(TreeError, match="chain-N"):
            load_tree(bad)


def test_json_forms_round_trip(tmp_path) -> None:
    as_list = tmp_path / "small.json"
    as_list.write_text(json.dumps([[0], [1], [0, 0]]))
    tree = load_tree(str(as_list))
    assert tree.name == "small" and tree.paths == ((0,), (1,), (0, 0))
    as_object = tmp_path / "obj.json"
    as_object.write_text(json.dumps(tree_to_json(load_tree("mc_sim_7b_63"))))
    again = load_tree(str(as_object))
    assert again == load_tree("mc_sim_7b_63")
    assert tree_to_json(again) == {
        "name": "mc_sim_7b_63",
        "paths": [list(p) for p in PRESETS["mc_sim_7b_63"]],
    }


@pytest.mark.parametrize(
    ("paths", "max_width", "match"),
    [
        ([], None, "at least one path"),
        ([[0], []], None, "non-empty"),
        ([[0], [-1]], None, "integers >= 0"),
        ([[0], [1.0]], None, "integers >= 0"),
        ([[0], [0]], None, "appears twice"),
        ([[0], [0, 0, 0]], None, r"needs its parent \[0, 0\]"),
        ([[0], [2]], None, r"skips sibling \[1\]"),
        ([[0], [0, 1]], None, r"skips sibling \[0, 0\]"),
        ([[0], [1], [2]], 2, "drafter width 2"),
        ([[0] * d for d in range(1, MAX_DEPTH + 2)], None, "maximum is 32"),
    ],
)
def test_validation_errors(paths: list, max_width: int | None, match: str) -> None:
    with pytest.raises(TreeError, match=match) as err:
        build_tree(paths, max_width=max_width)
    assert "\n" not in str(err.value)


def test_load_errors(tmp_path) -> None:
    with pytest.raises(TreeError, match="unknown tree 'nope'"):
        load_tree("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1,")
    with pytest.raises(TreeError, match="not valid JSON"):
        load_tree(str(bad))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"name": "x"}))
    with pytest.raises(TreeError, match='needs "paths"'):
        load_tree(str(wrong))
    scalar = tmp_path / "scalar.json"
    scalar.write_text("3")
    with pytest.raises(TreeError, match="list of paths"):
        load_tree(str(scalar))
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps([[0], [1], [2]]))
    with pytest.raises(TreeError, match="width 2"):
        load_tree(str(wide), max_width=2)


def test_pac_trees() -> None:
    """pac-K-D-N: the full K-ary tree to depth D, then a rank-0 chain below its first leaf; N
    nodes; its JSON form names it and reads back as itself."""
    tree = load_tree("pac-3-2-15")
    assert tree.num_nodes == 15 and tree.width == 3 and tree.max_depth == 5
    assert [len(level) for level in tree.levels] == [1, 3, 9, 1, 1, 1]
    assert tree.paths[-3:] == ((0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))
    assert load_tree("pac-2-1-2").paths == ((0,), (1,))  # no chain: the full tree alone
    data = tree_to_json(tree)
    again = build_tree(data["paths"], name=data["name"])
    assert again == tree and pac_shape(again) == (3, 2)
    assert pac_shape(build_tree([(0,), (1,)], name="pac-2-1-3")) is None  # the name lies
    assert pac_shape(load_tree("chain-4")) is None


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("pac-1-2-8", "2 <= K <= 10"),
        ("pac-11-1-20", "2 <= K <= 10"),
        ("pac-2-0-8", "D must be >= 1"),
        ("pac-2-3-13", "has 14 nodes"),
        ("pac-2-1-40", "39 deep; the maximum is 32"),
        ("pac-2-99999-3", "D must be >= 1 and that count at most N=3"),
    ],
)
def test_bad_pac_trees(spec: str, match: str) -> None:
    with pytest.raises(TreeError, match=match):
        load_tree(spec)
