"""The export's check of the VQ decoder graph: it follows the decoder's numerics (errors in 8-bit
levels of the output's range, over several inputs) and still refuses a decoder that is wrong."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from lantern_rt.export.exporter import (
    IMAGE_CHECK_INPUTS,
    ExportError,
    check_inputs,
    compare_with_torch,
    disagreement,
    export_graph,
)
from lantern_rt.export.graphs import VQDecode
from lantern_rt.families.loading import load_target, load_vq, open_model_dir
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir

LAYOUTS = ("anole", "lumina", "llamagen")


@pytest.fixture(scope="module")
def decoders(request, tmp_path_factory) -> dict[str, VQDecode]:
    """The VQ decoder graph module of a tiny random model of each layout, as the export builds it."""
    out = {}
    for layout in LAYOUTS:
        if layout == "llamagen":
            root = write_model_dir(tmp_path_factory.mktemp("llamagen") / "tiny", tiny_gpt(), tiny_vq())
        else:
            root = request.getfixturevalue(f"{layout}_dir")  # tests/chameleon_fixtures.py
        md = open_model_dir(root)
        out[layout] = VQDecode(load_vq(md), load_target(md).config).eval()
    return out


@pytest.fixture(scope="module")
def graphs(decoders, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each layout's decoder exported (its check passed) once: the graph file and manifest entry."""
    out = {}
    for layout, decode in decoders.items():
        folder = tmp_path_factory.mktemp(f"vq-{layout}")
        entry = export_graph(decode, decode, folder, threads=1)
        out[layout] = (folder / entry["file"], entry)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_check_passes_over_many_draws_of_its_inputs(decoders, graphs, layout):
    """The exported decoder keeps to torch on 64 random code grids, in 16 draws of the check's
    inputs; the check's numbers are what the export recorded."""
    decode, (path, entry) = decoders[layout], graphs[layout]
    draws = [
        range(1 + i, 1 + i + IMAGE_CHECK_INPUTS)
        for i in range(0, 16 * IMAGE_CHECK_INPUTS, IMAGE_CHECK_INPUTS)
    ]
    for seeds in draws:
        differences = compare_with_torch(path, decode, decode, threads=1, seeds=seeds)
        assert disagreement(decode.spec, differences["images"]) is None, (seeds, differences)
        if seeds[0] == 1:
            assert entry["max_abs_err"] == {"images": differences["images"].max_abs}


def flip_conv_out_bias(vq: nn.Module) -> None:
    vq.decoder.conv_out.bias.neg_()


def flip_last_block_conv(vq: nn.Module) -> None:
    """A wrong sign inside the decoder: the convolution registered just before conv_out."""
    convs = [m for m in vq.decoder.modules() if isinstance(m, nn.Conv2d)]
    convs[-2].weight.neg_()  # convs[-1] is conv_out


def nudge_conv_out_weight(vq: nn.Module) -> None:
    vq.decoder.conv_out.weight[0, 0, 1, 1] += 0.05


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bug", [flip_conv_out_bias, flip_last_block_conv, nudge_conv_out_weight])
def test_a_wrong_decoder_is_refused(decoders, layout, bug: Callable[[nn.Module], None], tmp_path):
    decode = decoders[layout]
    buggy = copy.deepcopy(decode.vq)
    with torch.no_grad():
        bug(buggy)
    with pytest.raises(ExportError, match=r"^vq_decode: output images differs from torch by "):
        export_graph(VQDecode(buggy, decode.layout), decode, tmp_path, threads=1)


class Perturbed(nn.Module):
    """A reference whose images are ``decode``'s plus, in units of their largest absolute value,
    Gaussian noise of standard deviation ``sigma`` and a constant ``shift`` (the same on every
    call for the same codes)."""

    def __init__(self, decode: VQDecode, sigma: float, shift: float = 0.0):
        super().__init__()
        self.decode, self.sigma, self.shift, self.spec = decode, sigma, shift, decode.spec

    def reference_forward(self, codes: Tensor) -> Tensor:
        images = self.decode(codes)
        g = torch.Generator().manual_seed(int(codes.sum()))
        noise = self.sigma * torch.randn(images.shape, generator=g, dtype=torch.float64) + self.shift
        return images + (noise * images.abs().max()).float()


LEVEL = 1 / 127.5  # an 8-bit level of an image in [-1, 1]


@pytest.mark.parametrize(
    "sigma, shift, refused",
    [
        # rounding-sized noise: its largest error about 0.3 of a level (2.5e-3 of the peak, as the
        # issue's Lumina-mGPT's 0.0042 at 3.1), most pixels keep their 8-bit value
        (6e-4, 0.0, None),
        (2.5 * LEVEL, 0.0, "differs from torch by"),  # a level and more: visible
        (0.0, 0.2 * LEVEL, "on average"),  # every pixel a fifth of a level off: a wrong decoder
        (float("nan"), 0.0, "differs from torch by nan"),
    ],
)
def test_the_image_rule(decoders, graphs, sigma, shift, refused):
    """The export's check (export_graph's comparison on its inputs, then its rule) of the Lumina
    decoder's graph against a perturbed reference (a wrong graph: test_a_wrong_decoder_is_refused)."""
    decode, (path, _) = decoders["lumina"], graphs["lumina"]
    seeds = range(1, 1 + check_inputs(decode.spec))
    differences = compare_with_torch(path, decode, Perturbed(decode, sigma, shift), threads=1, seeds=seeds)
    why = disagreement(decode.spec, differences["images"])
    if refused is None:
        assert why is None and differences["images"].max_abs > 0
    else:
        assert why is not None and refused in why, why
