"""The KV cache read through windows of its first slots (docs/method.md §12): the window rule, the
storage's moves between windows, and the same tokens as reading the whole cache, on torch and
onnxruntime, AR and speculative, one image and a batch with refills."""

from __future__ import annotations

import json

import pytest
import torch

from lantern_rt.bundle import Bundle, BundleError, step_windows, window_needed
from lantern_rt.export.exporter import export_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime import kv_cache
from lantern_rt.runtime.backends.bundle_graphs import BundleTarget
from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner
from lantern_rt.runtime.backends.torch_backend import TorchTarget
from lantern_rt.runtime.decode import decode_images
from lantern_rt.runtime.kv_cache import KVCache, cache_windows
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.speculation import jacobi_speculation
from lantern_rt.runtime.tree import ROOT_ONLY, load_tree
from lantern_rt.settings import MethodConfig
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir
from tests.test_speculative import GREEDY

SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
LABELS = [0, 3, 1, 4, 2]  # B = 2 refills slots and ends on a partial batch
WINDOWS = (32, 48, 64, 65)  # a 64-token image's cache (65 slots) read through 4 windows
# the exported bundle's: three windows (the first, one between, the whole cache), 15 graphs, not 19
BUNDLE_WINDOWS = (32, 48, 65)


def test_the_window_rule():
    assert cache_windows(257, 4) == (80, 144, 208, 257)  # the demo: quarters, multiples of 16
    assert cache_windows(65, 4) == WINDOWS
    assert cache_windows(17, 4) == (16, 17)  # a window per multiple of 16 at most
    assert cache_windows(257, 1) == (257,)
    with pytest.raises(ValueError):
        cache_windows(257, 0)
    # prefix 1, 10 tokens committed (the last one pending), a depth-5 tree, the spare slot
    assert window_needed(1, 10, 5) == 17
    assert window_needed(1, 0, 0) == window_needed(1, 1, 0) == 3  # before the first token
    # a step's graphs: the windows its first step fits in, and the whole cache
    assert step_windows(WINDOWS, 1, 5) == WINDOWS
    assert step_windows(WINDOWS, 30, 5) == (48, 64, 65)  # a 30-slot prompt: 32 slots never fit
    assert step_windows((16, 17), 12, 5) == (17,)


def test_fit_moves_the_entries_and_every_window_is_read_in_place():
    torch.manual_seed(0)
    cache = KVCache(2, 3, 65, 4, torch.float32, "cpu", RunShape(2), prefix=1, windows=WINDOWS)
    assert cache.window == 65 and cache.windows == WINDOWS
    base = cache.layers_k[0].data_ptr()
    seen = []
    for needed in (10, 40, 33, 64, 70, 49, 5):
        before = cache.k[..., :20, :].clone(), cache.v[..., :20, :].clone()
        cache.fit(needed)
        seen.append(cache.window)
        assert cache.k.shape == (2, 4, 3, cache.window, 4)
        assert all(t.is_contiguous() for t in (*cache.layers_k, *cache.layers_v))
        assert cache.layers_k[0].data_ptr() == base  # one storage: CUDA graphs see fixed pointers
        assert torch.equal(cache.k[..., :20, :], before[0]) and torch.equal(cache.v[..., :20, :], before[1])
        cache.k.normal_()  # new entries for the next move
        cache.v.normal_()
    assert seen == [32, 48, 48, 64, 65, 64, 32]
    # the mask and the writes follow the window: 2 new tokens, images at lengths 30 and 3
    cache.length.copy_(torch.tensor([30, 3]))
    assert cache.mask(torch.ones(2, 2, dtype=torch.bool)).shape == (4, 1, 2, 32 + 2)
    new = torch.arange(1.0, 1 + 2 * 4 * 3 * 3 * 4).view(2, 4, 3, 3, 4)
    cache.write(new, new, torch.tensor([1, 3]))
    assert cache.length.tolist() == [31, 6]
    assert torch.equal(cache.k[:, 0, :, 30], new[:, 0, :, 0]) and torch.equal(
        cache.k[:, 0, :, 31], new[:, 0, :, 2]
    )
    assert torch.equal(cache.k[:, 1, :, 3:6], new[:, 1, :, 0:3])  # the clamped copies stay inside


def _tokens(target, labels, sampling, spec=None, block=64, null=5):
    """{job: (tokens, accepted lengths)} of the tiny class-conditional model (5 classes)."""
    jobs = [(torch.tensor([c, null]), torch.Generator().manual_seed(7 + i)) for i, c in enumerate(labels)]
    out = dict(decode_images(target, jobs, block, sampling, spec))
    return {i: (r.tokens, r.accepted) for i, r in out.items()}


def _sjd(target, model, method="sjd++", neighbors=None):
    vocab = model.config.vocab_size
    if neighbors is None:
        neighbors = (torch.arange(vocab)[:, None] + torch.arange(1, 11)) % vocab
    return jacobi_speculation(target, model.config, load_tree("chain-5"), MethodConfig(method), neighbors)


def _spy_windows(monkeypatch) -> list[int]:
    """Every window a step read (KVCache.fit's choices)."""
    used: list[int] = []
    fit = KVCache.fit

    def spy(self, needed):
        fit(self, needed)
        used.append(self.window)

    monkeypatch.setattr(KVCache, "fit", spy)
    return used


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["ar", "sjd++"])
def test_torch_windows_give_the_whole_cache_tokens(monkeypatch, method, sampling):
    """Four windows against the whole cache: the same tokens and accepted lengths per image, at
    B = 1 and at B = 2 with refills; every window was read."""
    model = tiny_gpt(3, block_size=64)
    for batch in (1, 2):
        runs = []
        for windows in (1, 4):
            target = TorchTarget(model, RunShape(batch, cache_windows=windows))
            spec = _sjd(target, model) if method != "ar" else None
            used = _spy_windows(monkeypatch)
            runs.append(_tokens(target, LABELS, sampling, spec))
            monkeypatch.undo()
        whole, windowed = runs
        assert set(used) == set(WINDOWS)
        assert all(torch.equal(whole[i][0], windowed[i][0]) and whole[i][1] == windowed[i][1] for i in whole)
        if method != "ar":
            assert max(a for _, acc in whole.values() for a in acc) >= 2  # multi-token steps


def test_a_window_too_small_is_caught(monkeypatch):
    """The check above can fail: a window rule one slot short loses the last committed entry."""
    model = tiny_gpt(3, block_size=64)
    whole = _tokens(TorchTarget(model, RunShape(1, cache_windows=1)), LABELS[:2], GREEDY)
    monkeypatch.setattr("lantern_rt.runtime.decode.window_needed", lambda p, t, d: p + t + d - 1)
    short = _tokens(TorchTarget(model, RunShape(1, cache_windows=4)), LABELS[:2], GREEDY)
    assert not all(torch.equal(whole[i][0], short[i][0]) for i in whole)


@pytest.fixture(scope="module")
def windowed_bundle(tmp_path_factory) -> Bundle:
    """A tiny random target of 64-token images (no drafter), chain-5 verify graphs, B 1 and 2."""
    path = tmp_path_factory.mktemp("windows") / "bundle"
    model = write_model_dir(path.with_name("model"), tiny_gpt(3, block_size=64), tiny_vq())
    md = open_model_dir(model)
    bundle = export_bundle(md, path, [load_tree("chain-5")], threads=1, batch_sizes=(1, 2), windows=3)
    return Bundle.open(bundle)


@pytest.mark.slow
def test_the_bundle_holds_a_step_graph_per_window(windowed_bundle):
    c = windowed_bundle.constants
    assert c.cache_windows == BUNDLE_WINDOWS and c.cache_capacity == 65
    for b in ("", "_b2"):
        for name in ("target_ar_step", "target_verify_0"):
            assert name + b in windowed_bundle.graphs  # the whole cache keeps the name
            for w in BUNDLE_WINDOWS[:-1]:
                past = windowed_bundle.graph(f"{name}_w{w}{b}").input("past_k_0")
                assert past.shape[2] == w


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "sjd++"])
def test_onnxruntime_windows_give_torch_whole_cache_tokens(windowed_bundle, monkeypatch, method):
    model, table = tiny_gpt(3, block_size=64), windowed_bundle.neighbors()

    def spec(target):
        return _sjd(target, model, method, table) if method != "ar" else None

    for batch in (1, 2):
        reference = TorchTarget(model, RunShape(batch, cache_windows=1))
        want = _tokens(reference, LABELS, SAMPLED, spec(reference))
        target = BundleTarget(windowed_bundle.batch(batch), ort_runner(threads=1), "onnxruntime")
        used = _spy_windows(monkeypatch)
        got = _tokens(target, LABELS, SAMPLED, spec(target))
        monkeypatch.undo()
        assert set(used) == set(BUNDLE_WINDOWS)
        assert all(torch.equal(want[i][0], got[i][0]) and want[i][1] == got[i][1] for i in want), batch


@pytest.mark.slow
@pytest.mark.parametrize(
    "windows",
    [[32, 65, 48], [32, 64], [], [0, 65], [30, 65]],
    ids=["order", "end", "none", "zero", "missing"],
)
def test_a_manifest_with_bad_windows_is_refused(windowed_bundle, tmp_path, windows):
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(windowed_bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["constants"]["cache_windows"] = windows
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="cache_windows|lacks its target_ar_step_w30"):
        Bundle.open(copy)


@pytest.mark.slow
def test_one_window_exports_the_whole_cache_alone(tmp_path):
    model = write_model_dir(tmp_path / "model", tiny_gpt(3, block_size=64), tiny_vq())
    with pytest.raises(ConfigError, match="1..16"):
        export_bundle(open_model_dir(model), tmp_path / "b0", windows=0)
    bundle = Bundle.open(export_bundle(open_model_dir(model), tmp_path / "b1", threads=1, windows=1))
    assert bundle.constants.cache_windows == (65,)
    assert sorted(bundle.graphs) == ["target_ar_step", "target_prefill", "vq_decode"]
    assert kv_cache.cache_windows(65, 1) == (65,)


@pytest.mark.parametrize("name", ["root", "chain-5", "mc_sim_7b_63"])
def test_written_mask_shows_each_node_its_committed_slots_and_written_ancestors(name):
    """The mask of a step that wrote its nodes at each image's length, against one built slot by
    slot: committed slots (but the hidden prefix ones) and the node's ancestors at length + j,
    for two images in two CFG rows each, one of them idle past its window; a chain's one
    comparison gives the same mask as the general form."""
    tree = ROOT_ONLY if name == "root" else load_tree(name)
    s, slots, rows = tree.num_nodes + 1, 40, 4
    length = torch.tensor([7, 45])  # the second image's nodes would land past the slots
    prefix = torch.tensor([[True, False], [True, True], [True, False], [False, True]])
    got = kv_cache.written_mask(length, slots, tree.mask, rows, prefix, tree.is_chain)
    want = torch.zeros(rows, 1, s, slots, dtype=torch.bool)
    for row in range(rows):
        n = int(length[row % 2])
        for i in range(s):
            for slot in range(slots):
                seen = slot < n or (slot - n < s and bool(tree.mask[i, slot - n]))
                want[row, 0, i, slot] = seen and (slot >= 2 or bool(prefix[row, slot]))
    assert torch.equal(got, want)
    if tree.is_chain:
        general = kv_cache.written_mask(length, slots, tree.mask, rows, prefix, chain=False)
        assert torch.equal(got, general)
