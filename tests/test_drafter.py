"""The drafter: EAGLE key layout and loading, compatibility checks, CLI errors of speculative methods."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.families.loading import load_drafter, open_model_dir
from lantern_rt.models.config import ConfigError
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.neighbors import latent_neighbors
from tests.conftest import randomize, tiny_gpt, tiny_vq, write_model_dir

EAGLE_KEYS = {
    "embed_tokens.weight",
    "fc.weight",
    "fc.bias",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}


def eagle_folder(tmp_path, target, hidden=None, vocab=None, seed=0):
    """A drafter saved as the authors ship it: HF-style config.json + pytorch_model.bin."""
    cfg = target.config
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden or cfg.dim,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head,
        "intermediate_size": 40,
        "vocab_size": vocab or cfg.vocab_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "input_type": "c2i",
    }
    folder = tmp_path / "eagle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    if hidden is None and vocab is None:
        drafter = randomize(Drafter(DrafterConfig.from_dict(hf), cfg), seed)
        state = dict(drafter.state_dict())
    else:
        state = {"fc.weight": torch.zeros(1)}
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # saved by older transformers
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def test_drafter_has_eagle_keys():
    target = tiny_gpt()
    drafter = Drafter(DrafterConfig.for_target(target.config), target.config)
    assert set(drafter.state_dict()) == EAGLE_KEYS
    two = Drafter(DrafterConfig.for_target(target.config, num_hidden_layers=2), target.config)
    assert "layers.1.input_layernorm.weight" in two.state_dict()
    assert "layers.0.input_layernorm.weight" not in two.state_dict()


def test_eagle_folder_loads_and_reproduces_outputs(tmp_path):
    target = tiny_gpt()
    folder = eagle_folder(tmp_path, target, seed=3)
    md = open_model_dir(write_model_dir(tmp_path / "m", target, tiny_vq()))
    loaded = load_drafter(md, folder)
    reference = randomize(
        Drafter(DrafterConfig.from_dict(json.loads((folder / "config.json").read_text())), target.config), 3
    )
    tokens = torch.randint(0, 64, (2, 5))
    hidden = torch.randn(2, 5, 32)
    positions = torch.arange(1, 6)
    torch.testing.assert_close(loaded(tokens, hidden, positions), reference(tokens, hidden, positions))
    assert loaded.config.rms_norm_eps == 1e-6 and loaded.config.intermediate_size == 40


@pytest.mark.parametrize(
    "field,value,message", [("hidden", 48, "hidden size 48"), ("vocab", 99, "vocabulary 99")]
)
def test_mismatched_drafter_is_refused(tmp_path, field, value, message):
    target = tiny_gpt()
    folder = eagle_folder(tmp_path, target, **{field: value})
    md = open_model_dir(write_model_dir(tmp_path / "m", target, tiny_vq()))
    with pytest.raises(ConfigError, match=message):
        load_drafter(md, folder)
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "-q",
            "--backend",
            "torch",
            "--model",
            str(md.root),
            "--drafter",
            str(folder),
            "-o",
            str(tmp_path / "x.png"),
        ],
    )
    assert r.exit_code == 2 and message in r.stderr and not (tmp_path / "x.png").exists()


def test_latent_neighbors_nearest_first_and_exclude_self():
    book = torch.tensor([[0.0], [1.0], [3.0], [7.0]])
    table = latent_neighbors(book, 3)
    assert table.tolist() == [[1, 2, 3], [0, 2, 3], [1, 0, 3], [2, 1, 0]]
    vq = tiny_vq()
    table = latent_neighbors(vq.quantize.codebook(), 5)
    d = torch.cdist(vq.quantize.codebook(), vq.quantize.codebook())
    d.fill_diagonal_(float("inf"))
    assert torch.equal(table[:, 0], d.argmin(1))


def bad_tree(tmp_path, paths):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(paths))
    return str(path)


CASES = {
    "lambda below one": (["--method", "lantern++", "--lantern-lambda", "0.5"], "lambda"),
    "delta above one": (["--method", "lantern", "--lantern-delta", "1.5"], "delta"),
    "negative k": (["--method", "lantern++", "--lantern-k", "-1"], "k must"),
    "k beyond codebook": (["--method", "lantern++", "--lantern-k", "64"], "lantern k must be in 0..63"),
    "tree missing prefix": (["--method", "exact", "--tree", "PREFIX"], "needs its parent"),
    "tree rank beyond width": (["--method", "exact", "--tree", "WIDE"], "drafter width 10"),
    "unknown tree": (["--method", "exact", "--tree", "oak"], "unknown tree"),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_bad_input(tmp_path, case):
    args, message = CASES[case]
    target = tiny_gpt()
    md = write_model_dir(tmp_path / "m", target, tiny_vq())
    folder = eagle_folder(tmp_path, target)
    args = [
        bad_tree(tmp_path, [[0], [0, 0, 1]])
        if a == "PREFIX"
        else bad_tree(tmp_path, [[i] for i in range(11)])
        if a == "WIDE"
        else a
        for a in args
    ]
    out = tmp_path / "x.png"
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "-q",
            "--backend",
            "torch",
            "--model",
            str(md),
            "--drafter",
            str(folder),
            "-o",
            str(out),
            *args,
        ],
    )
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["chain-3", "chain-5", "mc_sim_7b_63", "naive_extend_57"])
def test_each_drafted_level_sees_exactly_its_drafted_ancestors(name):
    """A level's mask over the nodes drafted above it: each node's strict ancestors below the
    root (walked up from its parent here), as training's unroll_mask lets it see them."""
    from lantern_rt.runtime.drafting import draft_plan
    from lantern_rt.runtime.tree import load_tree

    tree = load_tree(name)
    plan = draft_plan(tree, torch.device("cpu"))
    for depth, level in enumerate(plan.levels, start=1):
        nodes = tree.levels[depth]
        for i, node in enumerate(nodes):
            want, parent = set(), tree.parents[node]
            while parent > 0:
                want.add(parent)
                parent = tree.parents[parent]
            seen = level.visible[0, 0, i, : nodes[0] - 1].nonzero().flatten() + 1
            assert set(seen.tolist()) == want, (name, node)
            assert (
                level.visible[0, 0, i, nodes[0] - 1 + i] and level.visible[0, 0, i, nodes[0] - 1 :].sum() == 1
            )
