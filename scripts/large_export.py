"""Export one graph whose weights pass ONNX's 2 GiB protobuf limit, through the bundle's own path.

A Chameleon-family target (random weights, 1D RoPE, q/k norms) of about 2.3 GB fp32 is exported
as the prefill graph by ``export_graph`` (torch.onnx with external data, the graph lint, the
onnxruntime comparison), then ``share_weights`` moves the weights into one file. Prints the
sizes and the error against torch. Heavy (about 8 GB of memory, minutes on two cores): a
benchmark-style check, not a test.

    .venv/bin/python scripts/large_export.py [--out /tmp/large-export]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from lantern_rt.eval.gpu_check import ANOLE_7B
from lantern_rt.export.exporter import export_graph
from lantern_rt.export.graphs import TargetPrefill
from lantern_rt.models.config import gpt_config
from lantern_rt.models.target import Transformer
from lantern_rt.shared_weights import share_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/large-export"))
    parser.add_argument("--layers", type=int, default=11)
    args = parser.parse_args()
    shape = dict(dim=2048, n_layer=args.layers, n_head=16, ffn_hidden_size=5632, cls_token_num=8)
    config = gpt_config(
        None, **(ANOLE_7B | shape), token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0
    )
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.output.weight.normal_(0, 0.02)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.0f}M parameters, {params * 4 / 2**30:.2f} GiB fp32")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    graph = TargetPrefill(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        entry = export_graph(graph, graph, args.out, threads=2)
    print(f"exported and checked in {time.perf_counter() - t0:.0f} s; max abs err {entry['max_abs_err']}")
    shared = share_weights([args.out / entry["file"]], args.out / "weights.bin")
    sizes = {p.name: p.stat().st_size for p in args.out.iterdir()}
    print(f"files: {sizes}")
    print(f"weights file: {shared.bytes / 2**30:.2f} GiB in {shared.tensors} tensors")


if __name__ == "__main__":
    main()
