"""An export's memory and disk: the graph modules hold no copies of the weights, weights are
shared graph by graph (the bundle ``share_weights`` would write), and a whole export holds about
one copy of the weights beyond the loaded model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lantern_rt.export.exporter import ExportModels, ScratchSlots, graph_pairs
from lantern_rt.models.config import GPTConfig
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.tree import load_tree
from lantern_rt.shared_weights import GraphByGraph, ShareError, share_weights
from tests.conftest import TINY_GPT, tiny_gpt, tiny_vq, write_model_dir

WEIGHTS = "weights.bin"


def storages(modules: list[torch.nn.Module]) -> dict[int, int]:
    """Data pointer -> bytes of every distinct storage the tensors of ``modules`` read."""
    found = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


@pytest.mark.parametrize("dtype, copies", [("fp32", 0.0), ("fp16", 0.5)])
def test_graph_modules_read_the_models_weights(dtype, copies):
    """Every graph of an export is built before the first is exported: none may hold a copy of
    the models' weights (each held one of its fused projections: 18 copies at GPT-B), and an
    fp16 export casts the models once for all its batch sizes."""
    target = tiny_gpt(dim=512, n_head=8)  # weights that dwarf the RoPE tables each graph holds
    drafter = Drafter(DrafterConfig.for_target(target.config), target.config).eval()
    models = ExportModels(target, tiny_vq(), drafter, torch.zeros(0), [])
    trees = [load_tree("chain-3")]
    pairs = graph_pairs(models, trees, dtype, 4, [1, 2], (8, 16, 17), True, ScratchSlots(0, 0))
    assert len(pairs) > 10
    own = storages([target, drafter, models.vq])
    extra = {
        ptr: size for ptr, size in storages([m for pair in pairs for m in pair]).items() if ptr not in own
    }
    weights = sum(own.values())
    assert sum(extra.values()) < (copies + 0.1) * weights, f"{len(extra)} tensors: {sorted(extra.values())}"


def graph_with_data(folder: Path, name: str, tensors: dict[str, np.ndarray]) -> None:
    """``name``.onnx adding ``tensors`` to x in turn, every initializer in ``name``.onnx.data."""
    nodes, value = [], "x"
    for i, key in enumerate(tensors):
        nodes.append(helper.make_node("Add", [value, key], [f"y{i}"]))
        value = f"y{i}"
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        name,
        [info("x", TensorProto.FLOAT, [256])],
        [info(value, TensorProto.FLOAT, [256])],
        [numpy_helper.from_array(array, key) for key, array in tensors.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path, data = str(folder / f"{name}.onnx"), f"{name}.onnx.data"
    onnx.save(model, path, save_as_external_data=True, location=data, size_threshold=0)


def test_graph_by_graph_writes_what_share_weights_writes(tmp_path):
    """Shared one graph at a time, each graph's own data file goes as it is shared, and the
    folder ends as :func:`share_weights` leaves it, byte for byte."""
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(256).astype(np.float32) for _ in range(3))
    small = np.array([0.5], dtype=np.float32)  # under min_bytes: back inline
    specs = {"g0": {"a": a, "b": b}, "g1": {"b2": b, "c": c}, "g2": {"a1": a, "s": small}}
    folders = [tmp_path / "whole", tmp_path / "by_graph"]
    for folder in folders:
        folder.mkdir()
        for name, tensors in specs.items():
            graph_with_data(folder, name, tensors)
    paths = [[folder / f"{name}.onnx" for name in specs] for folder in folders]
    x = {"x": rng.standard_normal(256).astype(np.float32)}
    before = [ort.InferenceSession(str(path)).run(None, x) for path in paths[0]]
    whole = share_weights(paths[0], folders[0] / WEIGHTS, min_bytes=1024)

    with GraphByGraph(folders[1] / WEIGHTS, min_bytes=1024) as shared:
        for i, path in enumerate(paths[1]):
            shared.add(path)
            data = sorted(p.name for p in folders[1].glob("*.data"))
            assert data == [f"{name}.onnx.data" for name in list(specs)[i + 1 :]]
            with pytest.raises(ShareError, match="added twice"):
                shared.add(path)
    assert shared.close() == dataclasses.replace(whole, file=folders[1] / WEIGHTS)
    assert whole.tensors == 3 and whole.references == 5
    files = [{p.name: p.read_bytes() for p in folder.iterdir()} for folder in folders]
    assert files[0] == files[1] and sorted(files[0]) == ["g0.onnx", "g1.onnx", "g2.onnx", WEIGHTS]
    after = [ort.InferenceSession(str(path)).run(None, x) for path in paths[1]]
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got[0], want[0])


# One process loads and exports a tiny model twice (the first pays the exporter's one-time
# costs), then a model whose weights dwarf the process's own memory, the same three graphs of
# each (prefill, AR step, VQ decoder), and measures how far its resident memory rises above what
# it holds with the models loaded (VmHWM reset there; a child's ru_maxrss would start from its
# parent's memory at the fork). The tiny model's second rise is the exporter's own; the rest of
# the wide model's is one graph's onnxruntime session, which prepacks a copy of its weights:
# 1.06x the weight bytes here; 3.8x when each graph module held a copy of its fused weights,
# 2.4x when sharing read a whole graph's weights into its proto.
CHILD = """
import ctypes, json, re, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from lantern_rt.export.exporter import export_bundle, load_export_models
from lantern_rt.families.loading import open_model_dir

def kib(field):
    return int(re.search(field + r":\\s*(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

rises = []
for model_dir, out in zip(sys.argv[1::2], sys.argv[2::2]):
    md = open_model_dir(Path(model_dir))
    models = load_export_models(md)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what loading freed goes back to the system
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    loaded = kib("VmRSS")
    export_bundle(md, Path(out), windows=1, threads=1, models=models)
    rises.append((kib("VmHWM") - loaded) * 1024)
print(json.dumps(rises))
"""
RISE_PER_WEIGHT_BYTE = 1.5


def export_rises(*model_dirs: Path) -> list[int]:
    """How many bytes a fresh process's resident memory rises, at its peak, while it exports
    each of ``model_dirs`` in turn (prefill, AR step, VQ decoder) above what it holds with the
    models loaded."""
    args = [str(p) for i, d in enumerate(model_dirs) for p in (d, d.with_suffix(f".{i}.bundle"))]
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow  # three small exports in a fresh process (25-60 s): the one measure of an export's memory
def test_an_export_holds_one_copy_of_the_weights_beyond_the_model(tmp_path):
    shape = dict(n_layer=1, vocab_size=64, block_size=16)  # few nodes: a short export
    tiny = write_model_dir(tmp_path / "tiny", tiny_gpt(**shape), tiny_vq())
    torch.manual_seed(0)
    big = Transformer(GPTConfig(**{**TINY_GPT, **shape, "dim": 2048, "n_head": 16})).eval()  # 193 MiB
    with torch.no_grad():
        big.output.weight.normal_(0, 0.02)  # LlamaGen zero-initialises the head
    weights = sum(p.numel() * p.element_size() for p in big.parameters())
    wide = write_model_dir(tmp_path / "wide", big, tiny_vq())
    del big
    _, base, rise = export_rises(tiny, tiny, wide)
    assert rise - base <= RISE_PER_WEIGHT_BYTE * weights, (
        f"exporting {weights / 2**20:.0f} MiB of weights raised memory {(rise - base) / 2**20:.0f} MiB "
        f"more than a tiny model's export ({base / 2**20:.0f} MiB) above the loaded models: "
        f"{(rise - base) / weights:.2f}x the weight bytes"
    )
