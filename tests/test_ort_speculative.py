"""Speculative decoding on the onnxruntime backend, against torch, on a trained tiny target and
drafter exported to one fp32 bundle: drafting graphs, and LANTERN++ decoding, greedy and sampled."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch
import torch.nn.functional as F

from lantern_rt.bundle import MANIFEST, Bundle, BundleError, write_manifest
from lantern_rt.engines.conditionals import has_conditionals, without_conditionals
from lantern_rt.families.loading import load_drafter, load_target, open_model_dir
from lantern_rt.graph_rules import check_graph
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.acceptance import Relaxation
from lantern_rt.runtime.backends.base import Draft, Pending
from lantern_rt.runtime.backends.bundle_graphs import (
    BundleDrafter,
    BundleTarget,
    bundle_trees,
)
from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Speculation, decode_image
from lantern_rt.runtime.drafting import noise_rows
from lantern_rt.runtime.sampling import SamplingConfig, draw_noise, filter_inputs
from lantern_rt.runtime.tree import load_tree
from tests.conftest import tiny_vq
from tests.test_export import graph_names, make_bundle
from tests.test_speculative import GREEDY

TREES = ["naive_extend_57", "chain-5"]
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
# top-k and top-p on: the drafting graphs' filtering branch (an If), which SAMPLED skips
FILTERED = SamplingConfig(cfg_scale=2.0, temperature=0.8, top_k=20, top_p=0.9)
RELAX = Relaxation("lantern++", k=5, lam=5.0)
# every test reads the bundle, an export of about a minute
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(trained_pair, tmp_path_factory) -> Bundle:
    """The trained pair's bundle of TREES, one cache window (tests/test_cache_windows.py has more)."""
    target, drafter = trained_pair
    path = tmp_path_factory.mktemp("speculative") / "bundle"
    return Bundle.open(make_bundle(path, target, tiny_vq(), drafter, TREES, "fp32", windows=1))


@pytest.fixture(scope="module")
def model_dir(bundle) -> ModelDir:
    return open_model_dir(bundle.path.with_name("bundle-model"))


def torch_drafter(bundle: Bundle, md: ModelDir) -> TorchDrafter:
    """The reference drafter with the bundle's drafter capacity."""
    return TorchDrafter(load_drafter(md), load_target(md).output, bundle.constants.drafter_capacity)


def test_drafter_graphs_pass_the_checks(bundle):
    assert set(bundle.graphs) == graph_names(TREES, with_drafter=True, windows=1)
    assert bundle.has_drafter and bundle.constants.drafter_capacity == 16
    raw = bundle.manifest()["graphs"]
    for name, entry in bundle.graphs.items():
        assert check_graph(bundle.file(entry)) == [], name
        assert all(err < 1e-4 for err in raw[name]["max_abs_err"].values()), name
    for name, tree in bundle.trees.items():  # the top-k/top-p sort runs only when asked for
        nodes = onnx.load(str(bundle.file(bundle.graph(tree.graph)))).graph.node
        assert sum(node.op_type == "If" for node in nodes) == load_tree(name).max_depth, name
    assert bundle_trees(bundle) == {name: load_tree(name) for name in TREES}


def test_drafting_graphs_run_on_one_thread(bundle):
    """Their ops are too small to split; the target's graphs get the threads asked for."""
    make = ort_runner(threads=2)
    graphs = bundle.graphs
    threads = {
        name: make(bundle, entry).session.get_session_options().intra_op_num_threads
        for name, entry in graphs.items()
    }
    assert threads == {name: 1 if name.startswith("draft_tree_") else 2 for name in graphs}
    assert {name for name, entry in graphs.items() if entry.drafting} == {
        name for name in graphs if name.startswith("draft_tree_")
    }
    assert sum(n == 1 for n in threads.values()) == len(TREES)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, FILTERED], ids=["greedy", "sampled", "filtered"])
def test_drafting_graph_matches_torch(bundle, model_dir, sampling):
    """Two drafted naive_extend_57 trees from the same noise: catch-up rows right-aligned over a
    committed cache, then every level in one graph; the same tokens, q and committed caches as
    the drafter's own step in torch."""
    tree = load_tree("naive_extend_57")
    ours = BundleDrafter(bundle.batch(1), ort_runner(threads=1), "onnxruntime")
    reference = torch_drafter(bundle, model_dir)
    g = torch.Generator().manual_seed(0)
    tokens, hidden = torch.randint(0, 64, (6,), generator=g), torch.randn(2, 6, 32, generator=g)
    drafts = []
    for drafter in (ours, reference):
        drafter.cache.reset()
        generator = torch.Generator().manual_seed(1)
        for pending, root in ((slice(0, 3), 3), (slice(3, 6), 6)):
            pad = 6 - (pending.stop - pending.start)  # left-aligned pending pairs, 6 catch-up rows
            rows = Pending(
                F.pad(tokens[pending], (0, pad))[None],  # one image
                F.pad(hidden[:, pending], (0, 0, 0, pad)),
                torch.tensor([3]),
                torch.tensor([root]),
                torch.tensor([True]),
            )
            got = drafter.propose(
                tree,
                rows,
                draw_noise(noise_rows(tree), 64, sampling.greedy, generator, torch.device("cpu"))[None],
                filter_inputs(sampling, torch.device("cpu")),
                torch.tensor([sampling.greedy]),
            )
            drafts.append(
                Draft(got.tokens[0].clone(), got.valid[0].clone(), got.q[0].clone())
            )  # buffers are reused
    assert int(ours.cache.length) == int(reference.cache.length) == 6
    torch.testing.assert_close(ours.cache.k, reference.cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.cache.v, reference.cache.v, atol=1e-5, rtol=1e-5)
    for got, want in zip(drafts[:2], drafts[2:], strict=True):
        # a draw where q is 0 (top-k/top-p on) is invalid, its token arbitrary: compare the
        # nodes verification can reach
        seen = reachable(tree, want.valid)
        assert torch.equal(got.valid[seen], want.valid[seen]) and torch.equal(
            got.tokens[seen], want.tokens[seen]
        )
        torch.testing.assert_close(got.q[seen], want.q[seen], atol=1e-5, rtol=1e-4)
        siblings = [c for c in tree.children[0] if want.valid[c]]
        assert len(set(got.tokens[siblings].tolist())) == len(siblings) > 0  # distinct siblings
    assert not torch.equal(drafts[0].tokens, drafts[1].tokens)


def reachable(tree, valid: torch.Tensor) -> torch.Tensor:
    """Nodes whose ancestors and themselves are all valid."""
    ok = valid.tolist()
    for node in range(1, len(ok)):
        ok[node] = ok[node] and ok[tree.parents[node]]
    return torch.tensor(ok)


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, FILTERED], ids=["greedy", "sampled", "filtered"])
def test_lantern_pp_matches_torch(bundle, model_dir, tree, sampling):
    """Same tokens, same accepted lengths per verify call, on both backends: greedy, and sampled
    from the same random stream (drafts, acceptance and bonus tokens all use it)."""
    neighbors = bundle.neighbors()
    reference = TorchTarget(load_target(model_dir))
    results = []
    for target, drafter in (
        (
            BundleTarget(bundle.batch(1), ort_runner(threads=1), "onnxruntime"),
            BundleDrafter(bundle.batch(1), ort_runner(threads=1), "onnxruntime"),
        ),
        (reference, torch_drafter(bundle, model_dir)),
    ):
        spec = Speculation(drafter, bundle_trees(bundle)[tree], RELAX, neighbors)
        results.append(
            [
                decode_image(
                    target, torch.tensor([c, 5]), 16, sampling, torch.Generator().manual_seed(c), spec
                )
                for c in (0, 1, 2, 3)
            ]
        )
    for got, want in zip(*results, strict=True):
        assert torch.equal(got.tokens, want.tokens) and got.accepted == want.accepted
    assert max(a for r in results[0] for a in r.accepted) >= 3  # multi-token steps were exercised


def test_a_tree_that_was_not_exported_is_refused(bundle):
    drafter = BundleDrafter(bundle.batch(1), ort_runner(threads=1), "onnxruntime")
    with pytest.raises(BundleError, match="no drafting graph for tree chain-3"):
        one, yes = torch.tensor([1]), torch.tensor([True])
        pending = Pending(torch.zeros(1, 4, dtype=torch.long), torch.zeros(2, 4, 32), one, one, yes)
        drafter.propose(load_tree("chain-3"), pending, torch.zeros(1, 4, 64), None, yes)


def test_generate_with_a_bundle_defaults_to_its_first_tree(bundle, model_dir, tmp_path):
    """No --tree: the bundle's first exported tree (not the CPU default, chain-5, its second);
    greedy tokens equal the torch backend's with that tree."""
    import json

    import numpy as np
    from click.testing import CliRunner

    from lantern_rt.cli import main

    common = ["generate", "-q", "--greedy", "--class", "1", "-n", "1", "--lantern-k", "5"]
    stats, tokens = tmp_path / "s.json", tmp_path / "t.npy"
    r = CliRunner().invoke(
        main,
        [
            *common,
            "--bundle",
            str(bundle.path),
            "-o",
            str(tmp_path / "a.png"),
            "--stats-json",
            str(stats),
            "--save-tokens",
            str(tokens),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(stats.read_text())["tree"]["name"] == TREES[0]
    r = CliRunner().invoke(
        main,
        [
            *common,
            "--model",
            str(model_dir.root),
            "--backend",
            "torch",
            "--tree",
            TREES[0],
            "-o",
            str(tmp_path / "b.png"),
            "--save-tokens",
            str(tmp_path / "u.npy"),
        ],
    )
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(np.load(tokens), np.load(tmp_path / "u.npy"))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (7, 0.8)], ids=["filter-off", "filter-on"])
def test_drafting_graph_without_its_ifs_computes_the_same(bundle, tmp_path, top_k, top_p):
    """What TensorRT parses (each If replaced by its then-branch, the filter) gives the same
    draft on onnxruntime as the graph with its Ifs, with top-k/top-p off and on."""
    entry = bundle.graph(bundle.trees["chain-5"].graph)
    copy = tmp_path / "inlined"  # the bundle with this graph's Ifs inlined
    shutil.copytree(bundle.path, copy)
    with without_conditionals(bundle.file(entry)) as path:
        inlined = onnx.load(str(path))
        shutil.copy(path, copy / entry.file)
    assert not has_conditionals(inlined.graph) and check_graph(copy / entry.file) == []
    write_manifest(copy, json.loads((copy / MANIFEST).read_text()))  # re-signed: the files' hashes and digest
    inlined_bundle = Bundle.open(copy)  # the inlined graph declares the same inputs and outputs
    assert inlined_bundle.graph(entry.name) == entry
    g = torch.Generator().manual_seed(0)
    inputs = {}
    for spec in entry.inputs:
        shape, name = spec.shape, spec.name
        settings = {"cfg_scale": 2.0, "temperature": 0.8, "top_k": top_k, "top_p": top_p}
        if name in settings:
            inputs[name] = torch.tensor([settings[name]], dtype=spec.torch_dtype)
        elif name == "mask":
            inputs[name] = torch.ones(shape, dtype=torch.bool)
        elif name in ("tokens", "positions"):
            inputs[name] = torch.randint(0, 8, shape, generator=g)
        else:
            draw = torch.rand(shape, generator=g) if name == "noise" else torch.randn(shape, generator=g)
            inputs[name] = draw.to(spec.torch_dtype)  # counts and lengths: small integers
    make = ort_runner(threads=1)
    got = {
        name: t.clone()
        for name, t in make(inlined_bundle, inlined_bundle.graph(entry.name))(**inputs).items()
    }
    want = make(bundle, entry)(**inputs)
    assert (want["q"][0, 0] == 0).any() == (top_k > 0)  # the root's q: the filter ran or not
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
