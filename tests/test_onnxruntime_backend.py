"""The onnxruntime backend against the torch reference on a tiny fp32 bundle."""

from __future__ import annotations

import dataclasses

import onnxruntime as ort
import pytest
import torch

from lantern_rt.bundle import Bundle, BundleError
from lantern_rt.families.loading import load_target, load_vq, open_model_dir
from lantern_rt.runtime.backends.bundle_graphs import (
    BundleDrafter,
    BundleTarget,
    BundleVQDecoder,
    RunnerFactory,
)
from lantern_rt.runtime.backends.onnxruntime_backend import CUDA, ort_runner
from lantern_rt.runtime.backends.torch_backend import TorchTarget
from lantern_rt.runtime.decode import decode_image
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from tests.conftest import verify_step
from tests.test_export import shared_bundle

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
COND = torch.tensor([2, 5])  # class 2, null class


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Bundle:
    return Bundle.open(shared_bundle(tmp_path_factory, "c2i-fp32"))


@pytest.fixture(scope="module")
def model_dir(bundle):
    return open_model_dir(bundle.path.parent / "c2i-fp32-model")


def backends(bundle: Bundle, model_dir) -> tuple[BundleTarget, TorchTarget]:
    return BundleTarget(bundle.batch(1), ort_runner(threads=1), "onnxruntime"), TorchTarget(
        load_target(model_dir)
    )


def outputs_reversed(runner: RunnerFactory) -> RunnerFactory:
    """``runner`` over each graph with its outputs declared in reverse order: real sessions whose
    outputs come back in another order than the export wrote them."""
    return lambda bundle, entry: runner(bundle, dataclasses.replace(entry, outputs=entry.outputs[::-1]))


def test_graph_outputs_are_read_by_name(bundle, model_dir):
    """Graphs whose outputs come in reverse order decode the same greedy tokens: every caller
    reads a graph's outputs by name, not by position."""
    reordered = outputs_reversed(ort_runner(threads=1))
    prefill = reordered(bundle, bundle.graph("target_prefill"))
    named = prefill(cond=COND, prefix=torch.ones(prefill.inputs[1].shape, dtype=torch.bool))
    assert list(named) == ["new_v", "new_k", "hidden", "logits"]
    n = model_dir.gpt.block_size
    got, want = (
        decode_image(BundleTarget(bundle.batch(1), make, "onnxruntime"), COND, n, GREEDY, None).tokens
        for make in (reordered, ort_runner(threads=1))
    )
    assert torch.equal(got, want)


def test_greedy_decoding_matches_torch(bundle, model_dir):
    ours, reference = backends(bundle, model_dir)
    n = model_dir.gpt.block_size
    got = decode_image(ours, COND, n, GREEDY, None)
    want = decode_image(reference, COND, n, GREEDY, None)
    assert torch.equal(got.tokens, want.tokens)
    length = int(reference.cache.length)
    assert int(ours.cache.length) == length > n // 2
    torch.testing.assert_close(ours.cache.v[:, :, :, :length], reference.cache.v[:, :, :, :length])


def test_a_bundle_without_drafter_refuses_a_drafter(bundle):
    """c2i-fp32 has trees but no drafter: AR and tree verification work, drafting does not."""
    assert not bundle.constants.drafter and not bundle.has_drafter and bundle.trees
    with pytest.raises(
        BundleError, match="has no drafter graphs; export it from a model directory with a drafter"
    ):
        BundleDrafter(bundle.batch(1), ort_runner(threads=1), "onnxruntime")


def test_ar_steps_match_torch(bundle, model_dir):
    """Prefill, then three AR steps (verify graphs over the root-only tree): every output and
    the committed caches."""
    ours, reference = backends(bundle, model_dir)
    for target in (ours, reference):
        target.prefill(COND)
    for t in (7, 11, 13):
        got, want = (verify_step(target, torch.tensor([t]), 64) for target in (ours, reference))
        for name, g, w in zip(got._fields, got, want, strict=True):
            if name in ("new_k", "new_v"):  # the torch target wrote them into its cache: see below
                assert w is None
                continue
            assert g.shape == w.shape, name
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)
    assert int(ours.cache.length) == int(reference.cache.length) == 4
    torch.testing.assert_close(ours.cache.k, reference.cache.k, atol=1e-5, rtol=1e-5)


def test_a_tree_without_a_verify_graph_is_refused(bundle):
    """c2i-fp32 lists a tree but has no drafter: no verify graph was exported for it."""
    target = BundleTarget(bundle.batch(1), ort_runner(threads=1), "onnxruntime")
    target.prefill(COND)
    tree = load_tree("mc_sim_7b_63")
    with pytest.raises(BundleError, match="the bundle has no verify graph for tree mc_sim_7b_63; export it"):
        verify_step(target, torch.zeros(tree.num_nodes + 1, dtype=torch.long), 64, tree)


def test_vq_decoder_matches_torch(bundle, model_dir):
    codes = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    images = BundleVQDecoder(bundle, ort_runner(threads=1)).decode(codes)
    torch.testing.assert_close(
        images, load_vq(model_dir).decode_code(codes, 4).detach(), atol=1e-4, rtol=1e-4
    )


@pytest.mark.skipif(
    CUDA not in ort.get_available_providers(), reason="onnxruntime has no CUDAExecutionProvider here"
)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device here")
def test_cuda_provider_keeps_the_cache_on_the_gpu(bundle, model_dir):
    ours = BundleTarget(bundle.batch(1), ort_runner(providers=[CUDA]), "onnxruntime")
    reference = TorchTarget(load_target(model_dir).cuda())
    assert ours.cache.k.is_cuda
    n = model_dir.gpt.block_size
    got = decode_image(ours, COND.cuda(), n, GREEDY, None)
    want = decode_image(reference, COND.cuda(), n, GREEDY, None)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.slow
def test_fp16_text_bundle_follows_torch(tmp_path_factory):
    """t2i with GQA in fp16: fp16 caches bound in place, logits close to the fp32 model."""
    bundle = Bundle.open(shared_bundle(tmp_path_factory, "t2i-gqa-fp16"))
    ours = BundleTarget(bundle.batch(1), ort_runner(threads=1), "onnxruntime")
    reference = TorchTarget(load_target(open_model_dir(bundle.path.parent / "t2i-gqa-fp16-model")))
    caption = torch.randn(3, 12, generator=torch.Generator().manual_seed(2))
    cond = torch.stack([caption, reference.model.null_condition])
    assert ours.cache.k.dtype == torch.float16
    for got, want in zip(ours.prefill(cond), reference.prefill(cond), strict=True):
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    for t in (7, 11, 13):
        got, want = (verify_step(target, torch.tensor([t]), 64) for target in (ours, reference))
        for name, g, w in zip(got._fields, got, want, strict=True):
            if name not in ("new_k", "new_v"):  # the torch target wrote them into its cache
                torch.testing.assert_close(g.to(w.dtype), w, atol=2e-2, rtol=1e-2)
