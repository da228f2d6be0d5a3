"""How many kernels a decode step launches: eager torch kernels per layer at a LlamaGen shape, and
the top-level nodes of a bundle's graphs after onnxruntime's CPU fusions.

    .venv/bin/python scripts/count_kernels.py [--bundle BUNDLE] [--preset GPT-B] [--ops]

Torch: one ``Transformer.step_in_place`` (the torch target's step: the new K/V written into each
layer's cache, attention over the cache where it lies) of random weights over a cache of 128
entries, 2 CFG rows, for an AR step (1 new token) and a chain-5 verify (6), profiled with
``torch.profiler`` on the CPU. A
kernel is an aten op with no kernel below it: views, allocations and casts that return their
input are left out (``lantern_rt.eval.kernel_count``). Per layer is the difference between the model with two layers
and with one, so the step's head and embedding are not in it; the whole step with the preset's
layers is printed beside it.

ONNX: each ``*.onnx`` of the bundle loaded in an onnxruntime CPU session (all optimizations, one
thread) with ``optimized_model_filepath`` set; the optimized model's top-level nodes are counted
(``--ops``: by operator type too).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import torch

from lantern_rt.eval.kernel_count import eager_kernels
from lantern_rt.models.config import GPT_PRESETS, gpt_config
from lantern_rt.models.target import Transformer

CACHE = 128  # committed entries before the step (half of LlamaGen's 256 image tokens)


def torch_kernels(model: Transformer, new: int) -> collections.Counter[str]:
    """Leaf aten kernels of one ``model.step_in_place`` over ``new`` tokens after :data:`CACHE`
    entries (each layer's cache: the window, then the slots the new entries are written into)."""
    c = model.config
    rows, capacity = 2, c.cls_token_num + c.block_size
    shape = (rows, c.kv_heads, capacity + new, c.head_dim)
    cache_k = tuple(torch.randn(shape) for _ in range(c.n_layer))
    cache_v = tuple(torch.randn(shape) for _ in range(c.n_layer))
    h = torch.randn(rows, new, c.dim)
    positions = torch.arange(CACHE, CACHE + new)
    past = (torch.arange(capacity) < CACHE).expand(new, -1)
    mask = torch.cat([past, torch.ones(new, new, dtype=torch.bool).tril()], dim=-1)[None, None]
    with torch.inference_mode():
        model.step_in_place(h, positions, mask, cache_k, cache_v)  # warm-up
        return eager_kernels(lambda: model.step_in_place(h, positions, mask, cache_k, cache_v))


def report_torch(preset: str) -> None:
    torch.manual_seed(0)
    sizes = {n: Transformer(gpt_config(preset, n_layer=n, vocab_size=16384)).eval() for n in (1, 2)}
    full = Transformer(gpt_config(preset, vocab_size=16384)).eval()
    for name, new in (("AR step", 1), ("chain-5 verify", 6)):
        one, two = torch_kernels(sizes[1], new), torch_kernels(sizes[2], new)
        per_layer = two - one
        total = sum(torch_kernels(full, new).values())
        top = ", ".join(f"{op.removeprefix('aten::')} {n}" for op, n in per_layer.most_common())
        print(
            f"torch {preset} {name}: {sum(per_layer.values())} kernels per layer ({top}); "
            f"whole step {total} over {full.config.n_layer} layers"
        )


def onnx_nodes(path: Path, ops: bool) -> None:
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3  # not the note that an optimized model is hardware-specific
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    counts = collections.Counter(node.op_type for node in graph.node)
    line = f"onnx {path.stem}: {len(graph.node)} nodes"
    if ops:
        line += " (" + ", ".join(f"{op} {n}" for op, n in counts.most_common()) + ")"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="an exported bundle whose graphs are counted")
    parser.add_argument(
        "--preset",
        default="GPT-B",
        choices=list(GPT_PRESETS),
        help="the LlamaGen shape whose torch step is counted",
    )
    parser.add_argument("--ops", action="store_true", help="ONNX nodes by operator type too")
    parser.add_argument("--no-torch", action="store_true", help="count the bundle's graphs alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.no_torch:
        report_torch(args.preset)
    if args.bundle is not None:
        for path in sorted(args.bundle.glob("*.onnx")):
            onnx_nodes(path, args.ops)


if __name__ == "__main__":
    main()
