"""The shipped demo model: loads, and its target has learnt class-conditional Fashion-MNIST."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.families.loading import load_neighbors, load_target, load_vq, open_model_dir
from lantern_rt.models.neighbors import latent_neighbors
from lantern_rt.training.data import FASHION_MNIST_DIR, load_fashion_mnist, to_model_range


@pytest.fixture(scope="module")
def demo():
    md = open_model_dir()
    return md, load_target(md), load_vq(md)


def test_demo_geometry(demo):
    md, target, vq = demo
    assert md.gpt.block_size == 256 and md.gpt.grid_size == 16  # 256 tokens, as LlamaGen 256 px
    assert md.vq.codebook_size == 1024 and md.vq.codebook_embed_dim == 8
    assert 1e6 < sum(p.numel() for p in target.parameters()) < 1e7
    assert len(md.class_names) == 10 and md.image_size == 32


def test_shipped_neighbour_table_matches_codebook(demo):
    md, _, vq = demo
    table = load_neighbors(md, 10)
    assert table.shape == (1024, 1000)
    assert torch.equal(table[:, :10], latent_neighbors(vq.quantize.codebook(), 10))


@pytest.mark.slow
@pytest.mark.skipif(not FASHION_MNIST_DIR.exists(), reason="dataset-fashion-mnist is not installed")
def test_target_classifies_real_images_by_likelihood(demo):
    """Real test images are most likely under their own class: the target is class-conditional."""
    _, target, vq = demo
    x, y = load_fashion_mnist("test")
    idx = torch.arange(0, 10000, 500)  # 20 images (accuracy 0.9, as on 40; each class costs 0.5 s)
    with torch.inference_mode():
        codes = vq.encode(torch.from_numpy(to_model_range(x[idx])))[1].flatten(1)
        nll = torch.stack(
            [
                torch.nn.functional.cross_entropy(
                    target(codes[:, :-1], torch.full((len(idx),), c)).transpose(1, 2), codes, reduction="none"
                ).sum(1)
                for c in range(10)
            ],
            dim=1,
        )
    accuracy = (nll.argmin(1) == torch.from_numpy(y[idx.numpy()]).long()).float().mean().item()
    assert accuracy > 0.6, accuracy
