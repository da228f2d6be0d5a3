"""Batched generation: B images per decode step, each with its own random stream, lengths and
positions, finished images replaced by the next job; the same tokens as one image at a time."""

from __future__ import annotations

import json
from types import SimpleNamespace

import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import external_data_helper

from lantern_rt.bundle import WEIGHTS, Bundle, BundleError
from lantern_rt.cli import main
from lantern_rt.export.exporter import export_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.runtime.acceptance import Relaxation
from lantern_rt.runtime.backends.bundle_graphs import BundleDrafter, BundleTarget, bundle_trees
from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Speculation, _step_noise, decode_images
from lantern_rt.runtime.kv_cache import KVCache, cache_mask
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from tests.conftest import tiny_vq, write_model_dir
from tests.test_export import add_drafter
from tests.test_speculative import GREEDY

SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
RELAX = Relaxation("lantern++", k=5, lam=5.0)
LABELS = [0, 3, 1, 4, 2, 0, 3]  # 7 images: B = 3 refills slots and ends on a partial batch


def jobs(target, labels, seed=0):
    null = target.config.num_classes
    return [(torch.tensor([c, null]), torch.Generator().manual_seed(seed + i)) for i, c in enumerate(labels)]


def decode_all(target_backend, model, labels, sampling, spec=None):
    """{job index: tokens} and {job index: accepted lengths}."""
    out = dict(decode_images(target_backend, jobs(model, labels), model.config.block_size, sampling, spec))
    assert sorted(out) == list(range(len(labels)))  # every image exactly once
    return {i: r.tokens for i, r in out.items()}, {i: r.accepted for i, r in out.items()}


def torch_spec(target, drafter, batch: int) -> Speculation:
    tree, vocab = load_tree("chain-5"), target.config.vocab_size
    neighbors = (torch.arange(vocab)[:, None] + torch.arange(1, 6)) % vocab  # any table will do
    drafting = TorchDrafter(drafter, target.output, target.config.block_size, RunShape(batch))
    return Speculation(drafting, tree, RELAX, neighbors)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_torch_tokens_do_not_depend_on_the_batch(trained_pair, method, sampling):
    """Per image, the same tokens and accepted lengths at B = 1, 3 and 8 (7 jobs: refills, a
    partial last batch, and a batch larger than the job count)."""
    target, drafter = trained_pair
    runs = []
    for batch in (1, 3, 8):
        spec = torch_spec(target, drafter, batch) if method != "ar" else None
        runs.append(
            decode_all(TorchTarget(target, RunShape(batch, cache_windows=1)), target, LABELS, sampling, spec)
        )
    (tokens, accepted), *others = runs
    for got_tokens, got_accepted in others:
        assert all(torch.equal(tokens[i], got_tokens[i]) for i in tokens)
        assert got_accepted == accepted
    if method != "ar":
        assert max(a for run in accepted.values() for a in run) >= 3  # multi-token steps


def test_an_image_does_not_depend_on_its_slot_or_neighbours(trained_pair):
    """The same job, its seed fixed, among other images in another order: the same tokens."""
    target, drafter = trained_pair
    null = target.config.num_classes
    first = [(torch.tensor([c, null]), torch.Generator().manual_seed(100 + c)) for c in (1, 2, 3)]
    second = [(torch.tensor([c, null]), torch.Generator().manual_seed(100 + c)) for c in (3, 1, 2)]
    results = []
    for order in (first, second):
        spec = torch_spec(target, drafter, 3)
        out = dict(
            decode_images(
                TorchTarget(target, RunShape(3, cache_windows=1)),
                order,
                target.config.block_size,
                SAMPLED,
                spec,
            )
        )
        results.append({int(order[i][0][0]): out[i].tokens for i in out})
    assert all(torch.equal(results[0][c], results[1][c]) for c in (1, 2, 3))


def test_inactive_slots_commit_nothing(trained_pair):
    """Two jobs on four slots: the empty slots never advance their caches."""
    target, drafter = trained_pair
    backend, spec = TorchTarget(target, RunShape(4, cache_windows=1)), torch_spec(target, drafter, 4)
    list(decode_images(backend, jobs(target, [1, 2]), target.config.block_size, GREEDY, spec))
    assert backend.cache.length[2:].tolist() == [0, 0] and spec.drafter.cache.length[2:].tolist() == [0, 0]
    assert (backend.cache.length[:2] > target.config.block_size // 2).all()


@pytest.mark.parametrize("drafting", [True, False])
def test_each_image_draws_its_step_noise_in_the_documented_order(drafting):
    """docs/method.md §5.1 and §9: per step, each image draws from its own generator the
    drafter's uniforms (noise_rows x V, drafting methods), then N + 1 test uniforms and V bonus
    uniforms; an empty slot draws nothing and gets zeros; greedy draws nothing at all. Written
    out here with plain torch.rand calls, not the runtime's helpers."""
    tree, vocab, rows = load_tree("chain-3", 4), 16, 3  # chain-3: 4 nodes, 3 of them draw children
    state = SimpleNamespace(vocab=vocab, device=torch.device("cpu"))
    slots = [SimpleNamespace(generator=torch.Generator().manual_seed(s), sampling=SAMPLED) for s in (7, 8)]
    draft, noise, bonus = _step_noise([slots[0], None, slots[1]], tree, rows * drafting, state)
    for got_slot, seed in ((0, 7), (2, 8)):
        g = torch.Generator().manual_seed(seed)
        if drafting:
            assert torch.equal(draft[got_slot], torch.rand(rows, vocab, generator=g))
        expected = torch.rand(tree.num_nodes + 1 + vocab, generator=g)
        assert torch.equal(noise[got_slot], expected[: tree.num_nodes + 1])
        assert torch.equal(bonus[got_slot], expected[tree.num_nodes + 1 :])
    for slot, seed in zip(slots, (7, 8), strict=True):  # nothing else was drawn
        g = torch.Generator().manual_seed(seed)
        torch.rand(rows * vocab * drafting + tree.num_nodes + 1 + vocab, generator=g)
        assert torch.equal(torch.rand(4, generator=slot.generator), torch.rand(4, generator=g))
    assert not draft[1].any() and not noise[1].any() and not bonus[1].any()
    assert draft.shape == (3, rows if drafting else 1, vocab)
    before = slots[0].generator.get_state()
    _step_noise(
        [SimpleNamespace(generator=slots[0].generator, sampling=GREEDY)], tree, rows * drafting, state
    )
    assert torch.equal(slots[0].generator.get_state(), before)


def test_per_image_cache_masks_and_writes():
    """cache_mask and KVCache.write per image, against the one-image functions row by row."""
    length = torch.tensor([3, 0, 5])
    new = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    mask = cache_mask(length, 6, new, 2 * len(length))
    assert mask.shape == (6, 1, 2, 8)
    for b, n in enumerate(length.tolist()):
        one = cache_mask(torch.tensor([n]), 6, new, 2)[0]
        assert torch.equal(mask[b], one) and torch.equal(mask[3 + b], one)  # both CFG rows
    cache = KVCache(1, 1, 6, 1, torch.float32, "cpu", RunShape(3))
    cache.length.copy_(length)
    k = torch.arange(12, dtype=torch.float32).view(1, 6, 1, 2, 1) + 1
    cache.write(k, k, torch.tensor([2, 1, 0]))
    assert cache.length.tolist() == [5, 1, 5]
    assert cache.k[0, 0, 0, 3:5, 0].tolist() == [1, 2] and cache.k[0, 3, 0, 3:5, 0].tolist() == [7, 8]
    assert cache.k[0, 1, 0, 0:2, 0].tolist() == [3, 4]  # image 1 at its own length 0


# The tree of batched_bundle: tests/test_calibrate.py's (and test_openvino.py's, test_weight_only.py's)
# fp32 bundle of the pair holds it too, so that the run exports its B = 1 verify and drafting
# graphs (the whole cache, standard) once.
BATCHED_TREE = "chain-3"


@pytest.fixture(scope="module")
def batched_bundle(trained_pair, tmp_path_factory) -> Bundle:
    """The trained pair's bundle of BATCHED_TREE for 3 and 1 images per call, one cache window (a
    batch's windows: tests/test_cache_windows.py)."""
    target, drafter = trained_pair
    root = tmp_path_factory.mktemp("batched")
    model = write_model_dir(root / "model", target, tiny_vq())
    add_drafter(model, drafter)
    trees = [load_tree(BATCHED_TREE)]
    path = export_bundle(
        open_model_dir(model), root / "bundle", trees, threads=1, batch_sizes=[3, 1], windows=1
    )
    return Bundle.open(path)


def external_tensors(path) -> set[tuple[int, int]]:
    """(offset, length) of every tensor a graph reads from the bundle's weights file."""
    model = onnx.load(str(path), load_external_data=False)
    tensors = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    infos = [external_data_helper.ExternalDataInfo(t) for t in tensors]
    assert all(info.location == WEIGHTS for info in infos)
    return {(info.offset, info.length) for info in infos}


@pytest.mark.slow
def test_the_manifest_records_the_batch_sizes_and_one_weights_file(batched_bundle):
    bundle = batched_bundle
    assert bundle.constants.batch_sizes == (1, 3)
    assert {"target_prefill_b3", "target_ar_step_b3", "target_verify_0_b3", "draft_tree_0_b3"} <= set(
        bundle.graphs
    )
    assert bundle.graph("target_verify_0_b3").input("node_tokens").shape == (3, 4)  # chain-3 and its root
    for name in ("target_prefill", "target_ar_step", "target_verify_0", "draft_tree_0"):
        # a second batch size adds no weights: its graph reads the same tensors of the one file
        # (it adds batch-shaped constants only)
        one, three = (
            {t for t in external_tensors(bundle.file(bundle.graph(g))) if t[1] >= 4096}
            for g in (name, f"{name}_b3")
        )
        assert one and one <= three, name
    stored = sum(length for g in bundle.graphs.values() for _, length in external_tensors(bundle.file(g)))
    weights = (bundle.path / WEIGHTS).stat().st_size
    assert 1.5 * weights < stored  # the graphs read more than the file holds: each tensor is in it once
    for entry in bundle.graphs.values():  # and none inline
        inline = onnx.load(str(bundle.file(entry)), load_external_data=False).graph.initializer
        assert all(len(t.raw_data) < 1024 for t in inline if t.data_location != onnx.TensorProto.EXTERNAL)
    assert not any(p.name.endswith(".data") for p in bundle.path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_onnxruntime_batched_equals_one_at_a_time_and_torch(batched_bundle, trained_pair, sampling):
    """LANTERN++ on onnxruntime at B = 3 gives each image the tokens it gets at B = 1, and torch's."""
    bundle, (target, _) = batched_bundle, trained_pair
    tree = bundle_trees(bundle)[BATCHED_TREE]
    runs = []
    for batch in (1, 3):
        runner = ort_runner(threads=1)
        ort_target = BundleTarget(bundle.batch(batch), runner, "onnxruntime")
        spec = Speculation(
            BundleDrafter(bundle.batch(batch), runner, "onnxruntime"), tree, RELAX, bundle.neighbors()
        )
        runs.append(decode_all(ort_target, target, LABELS, sampling, spec)[0])
    spec = Speculation(
        TorchDrafter(trained_pair[1], target.output, bundle.constants.drafter_capacity, RunShape(3)),
        tree,
        RELAX,
        bundle.neighbors(),
    )
    runs.append(
        decode_all(TorchTarget(target, RunShape(3, cache_windows=1)), target, LABELS, sampling, spec)[0]
    )
    one, batched, reference = runs
    assert all(torch.equal(one[i], batched[i]) and torch.equal(one[i], reference[i]) for i in one)


@pytest.mark.slow
def test_a_batch_size_the_bundle_lacks_is_refused(batched_bundle, tmp_path):
    with pytest.raises(BundleError, match=r"lantern export --batch-size 1,2,3"):
        batched_bundle.batch(2)
    with pytest.raises(BundleError, match=r"not 0$"):  # no export can make a batch of 0
        batched_bundle.batch(0)
    out = tmp_path / "g.png"
    args = ["generate", "--bundle", str(batched_bundle.path), "--batch-size", "2", "-q", "-o", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--batch-size 1,2,3" in r.output
    assert not out.exists()
    bench = tmp_path / "bench"
    refused = {
        "--batch-size 1,2": "--batch-size 1,2,3",
        "--baseline torch-batched": "not the model",  # its default --model, the demo
        "--model x --batch-size 1": "drop --model",  # no baseline: --model has no use
    }
    for extra, reason in refused.items():  # refused before any work
        args = ["bench", "--bundle", str(batched_bundle.path), "--no-quality", "--out", str(bench)]
        r = CliRunner().invoke(main, [*args, *extra.split()])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and not bench.exists(), r.output
        assert reason in r.output, r.output


def test_a_bundle_is_benched_against_the_loop_over_its_model(batched_bundle, tmp_path):
    """``--baseline`` beside ``--bundle`` runs LlamaGen's loop over ``--model`` in the same run
    (how an int8 bundle meets the loop)."""
    model, out = batched_bundle.path.parent / "model", tmp_path / "bench"
    args = f"bench --bundle {batched_bundle.path} --model {model} --baseline torch-batched --config ar"
    r = CliRunner().invoke(main, [*args.split(), "-n", "1", "--no-quality", "--out", str(out)])
    assert r.exit_code == 0, r.output
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["baseline_model"] == str(model)
    assert [(row["backend"], row["num_images"]) for row in results["rows"]] == [
        ("onnxruntime", 5),  # one image per class
        ("torch-batched", 5),
    ]


@pytest.mark.slow
def test_calibration_quantizes_the_graphs_of_every_batch_size(batched_bundle, tmp_path):
    from lantern_rt.calibration.calibrate import calibrate_bundle

    report = calibrate_bundle(batched_bundle, tmp_path / "int8", samples=3, validate=1, threads=1)
    int8 = Bundle.open(tmp_path / "int8")
    precision = {name: entry["precision"] for name, entry in int8.manifest()["graphs"].items()}
    assert precision["target_verify_0_b3"] == precision["target_verify_0"] == "int8"
    assert precision["vq_decode"] == "fp32" and int8.constants.batch_sizes == (1, 3)
    assert report["graphs"]["target_verify_0_b3"]["calls"] > 0
    assert precision["draft_tree_0_b3"] == precision["draft_tree_0"] == "fp32"  # the drafter stays fp32
    assert (int8.path / WEIGHTS).is_file() and not any(p.suffix == ".data" for p in int8.path.iterdir())


# The tree of the B = 2 exports below (on first use: in place, the default cache windows; `lantern
# export`: standard graphs, one cache window): tests/test_cache_in_place.py's first tree, at its
# batch size, windows and scratch slots, so that the run exports each of these graphs once.
FRESH_TREE = "mc_sim_7b_63"


@pytest.mark.slow
def test_a_batch_size_alone_works_on_a_fresh_cache_and_from_export(trained_pair, tmp_path, monkeypatch):
    """`--batch-size 2` on a model directory exports what B = 2 needs (generate, bench and
    generate-set on an empty cache), and `lantern export --batch-size 2` without 1 gives a
    bundle that runs and calibrates; every image keeps the tokens torch gives it at B = 1."""
    import numpy as np

    target, drafter = trained_pair
    model = write_model_dir(tmp_path / "model", target, tiny_vq())
    add_drafter(model, drafter)
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    # one cache window: the first-use export shared by generate, bench and generate-set, the
    # quickest (windows: tests/test_cache_windows.py)
    images = ["--classes", "0,3", "-n", "2", "-q", "--tree", FRESH_TREE, "--cache-windows", "1"]

    def generate(source: list[str], name: str, *extra: str) -> np.ndarray:
        out = tmp_path / f"{name}.npy"
        args = [
            "generate",
            *source,
            *images,
            *extra,
            "-o",
            str(out.with_suffix(".png")),
            "--save-tokens",
            str(out),
        ]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        return np.load(out)

    want = generate(["--model", str(model)], "torch", "--backend", "torch")
    assert np.array_equal(generate(["--model", str(model)], "cached", "--batch-size", "2"), want)
    cached = [Bundle.open(m.parent) for m in (tmp_path / "cache").glob("bundles/*/manifest.json")]
    assert [len(b.constants.cache_windows) for b in cached] == [1]  # --cache-windows reached the export
    bench = [*("bench", "--model", str(model), "--tree", FRESH_TREE, "--cache-windows", "1")]
    bench += ["--config", "ar", "--config", "lantern++"]
    r = CliRunner().invoke(
        main, [*bench, "--batch-size", "2", "-n", "1", "--no-quality", "--out", str(tmp_path / "bench")]
    )
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "bench" / "results.json").read_text())["rows"]
    assert {row["batch_size"] for row in rows} == {2}
    set_args = [
        "generate-set",
        "--model",
        str(model),
        *images,
        "--batch-size",
        "2",
        "--out",
        str(tmp_path / "set"),
    ]
    r = CliRunner().invoke(main, set_args)
    assert r.exit_code == 0, r.output
    shards = sorted((tmp_path / "set").glob("shard-*.npz"))
    assert np.array_equal(np.concatenate([np.load(s)["codes"] for s in shards]), want)
    r = CliRunner().invoke(
        main,
        [
            "export",
            "--model",
            str(model),
            "--tree",
            FRESH_TREE,
            "--batch-size",
            "2",
            "--cache-windows",
            "1",
            "--out",
            str(tmp_path / "b2"),
            "-q",
        ],
    )
    assert r.exit_code == 0, r.output
    assert Bundle.open(tmp_path / "b2").constants.batch_sizes == (2,)
    assert np.array_equal(generate(["--bundle", str(tmp_path / "b2")], "b2", "--batch-size", "2"), want)
    calibrate = ["calibrate", str(tmp_path / "b2"), "--samples", "2", "--validate", "1", "--threads", "1"]
    r = CliRunner().invoke(main, [*calibrate, "--out", str(tmp_path / "b2-int8"), "-q"])
    assert r.exit_code == 0, r.output  # validated at B = 2, the bundle's one batch size
    assert Bundle.open(tmp_path / "b2-int8").constants.batch_sizes == (2,)


@pytest.mark.slow
def test_streams_share_the_sessions_and_keep_every_image_s_tokens(batched_bundle, tmp_path):
    """``--streams 2`` on onnxruntime: the tokens of one stream (B = 3 and 1), each stream with
    its own caches over the same onnxruntime sessions; refused where it cannot run."""
    import numpy as np

    from lantern_rt.assembly import onnxruntime_pipeline
    from lantern_rt.settings import MethodConfig

    pipe = onnxruntime_pipeline(
        batched_bundle, MethodConfig("lantern++", tree=BATCHED_TREE), RunShape(3, streams=2), threads=2
    )
    first, second = pipe.streams
    assert first.target.cache is not second.target.cache
    assert first.speculation.drafter.cache is not second.speculation.drafter.cache
    graphs = [first.target._verify, second.target._verify]
    assert all(graphs[0][key].session is graphs[1][key].session for key in graphs[0])

    def tokens(*extra: str) -> np.ndarray:
        out = tmp_path / f"t{len(list(tmp_path.iterdir()))}.npy"
        args = [
            "generate",
            "--bundle",
            str(batched_bundle.path),
            "--method",
            "lantern++",
            "--tree",
            BATCHED_TREE,
        ]
        args += [
            "--classes",
            "0,3,1,4",
            "-n",
            "2",
            "-q",
            "-o",
            str(out.with_suffix(".png")),
            "--save-tokens",
            str(out),
        ]
        r = CliRunner().invoke(main, [*args, *extra])
        assert r.exit_code == 0, r.output
        return np.load(out)

    one = tokens("--streams", "1")
    assert np.array_equal(tokens("--streams", "2", "--threads", "2"), one)
    assert np.array_equal(tokens("--streams", "3", "--batch-size", "3"), one)
    stats = tmp_path / "auto.json"  # the default, auto: one stream per thread here
    assert np.array_equal(tokens("--threads", "2", "--stats-json", str(stats)), one)
    assert json.loads(stats.read_text())["streams"] == 2
    model = batched_bundle.path.parent / "model"
    for source in (
        f"--model {model} --backend torch --threads 2",
        f"--bundle {batched_bundle.path} --threads 1",
    ):
        args = f"generate {source} --method ar -n 2"
        out = ["-q", "-o", str(tmp_path / "one.png"), "--stats-json", str(stats)]
        r = CliRunner().invoke(main, [*args.split(), *out])
        assert r.exit_code == 0, r.output  # auto is one stream on torch, and on one thread
        assert json.loads(stats.read_text())["streams"] == 1
    refused = {
        f"generate --model {model} --backend torch --streams 2": "--backend onnxruntime",
        f"bench --model {model} --backend torch --streams 1,2": "runs on onnxruntime or openvino",
        f"bench --bundle {batched_bundle.path} --streams 0,1": "1..64",
        f"bench --bundle {batched_bundle.path} --streams two": "comma-separated integers",
        f"generate --bundle {batched_bundle.path} --streams 2 --threads 1": "use --streams 1 or fewer",
        f"bench --bundle {batched_bundle.path} --streams 1,3 --threads 2": "use --streams 2 or fewer",
    }
    for args, reason in refused.items():
        r = CliRunner().invoke(
            main,
            [
                *args.split(),
                "-q" if args.startswith("generate") else "--no-quality",
                *(["--out", str(tmp_path / "b")] if args.startswith("bench") else []),
            ],
        )
        assert r.exit_code == 2 and r.output.count("\n") == 1 and reason in r.output, (args, r.output)
    assert not (tmp_path / "b").exists()


def test_one_stream_s_pools_spin_only_within_a_call(batched_bundle):
    """A session one stream calls alone may spin its pool within a call and stops as the call
    returns; sessions shared by several streams never spin; the tokens are one stream's."""
    from lantern_rt.assembly import onnxruntime_pipeline
    from lantern_rt.generate import generate
    from lantern_rt.settings import MethodConfig

    def entry(options, key: str) -> str:
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # not set
            return ""

    def spinning(pipe) -> set[tuple[str, str]]:
        verify = pipe.streams[0].target._verify.values()
        options = [graph.session.get_session_options() for graph in verify]
        keys = ("session.intra_op.allow_spinning", "session.force_spinning_stop")
        return {tuple(entry(o, k) for k in keys) for o in options}

    method = MethodConfig("lantern++", tree=BATCHED_TREE)
    one = onnxruntime_pipeline(batched_bundle, method, RunShape(1, streams=1), threads=2)
    two = onnxruntime_pipeline(batched_bundle, method, RunShape(1, streams=2), threads=2)
    assert spinning(one) == {("1", "1")} and spinning(two) == {("0", "")}
    sampling = SamplingConfig(cfg_scale=3.0)
    tokens = [generate(p, [0, 3, 1], sampling, progress=False).tokens for p in (one, two)]
    assert torch.equal(tokens[0], tokens[1])


def test_bench_rows_at_each_stream_count(batched_bundle, tmp_path):
    """``lantern bench --streams 1,2``: one row per configuration and stream count, each row's
    speedup against the AR row of its own stream count."""
    out = tmp_path / "bench"
    args = f"bench --bundle {batched_bundle.path} --config ar --config lantern++ --tree {BATCHED_TREE} --streams 1,2"
    r = CliRunner().invoke(main, [*args.split(), "-n", "1", "--no-quality", "--out", str(out)])
    assert r.exit_code == 0, r.output
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert results["settings"]["streams"] == [1, 2]
    assert [(row["method"], row["streams"]) for row in rows] == [
        ("ar", 1),
        ("lantern++", 1),
        ("ar", 2),
        ("lantern++", 2),
    ]
    for ar, spec in (rows[:2], rows[2:]):
        assert ar["speedup_vs_ar"] == pytest.approx(1.0)
        assert spec["speedup_vs_ar"] == pytest.approx(ar["seconds_per_image"] / spec["seconds_per_image"])
    assert "| 2 |" in (out / "results.md").read_text()
