"""Record the demo's tokens for tests/test_token_fixtures.py (run once, with the code the fixtures
pin): ``python tests/record_token_fixtures.py``.

Greedy tokens of AR, exact and LANTERN++ on torch and on onnxruntime, for fixed classes and a
fixed seed, over the demo bundle exported with tree chain-3 (first recorded at 51b97dc with the
sampled cases too; those were dropped when acceptance moved onto the device and drew its noise
differently; re-recorded in issue 15 when a drafted level was let see its depth-1 ancestor, which
changed only the LANTERN++ tokens: AR and exact came out as recorded).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from token_fixture_cases import CASES, FIXTURE, LABELS, SEED, TREE, method_config, sampling  # noqa: E402

from lantern_rt.assembly import onnxruntime_pipeline, torch_pipeline  # noqa: E402
from lantern_rt.bundle import Bundle
from lantern_rt.export.exporter import export_bundle  # noqa: E402
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate  # noqa: E402
from lantern_rt.models.model_dir import DEMO_DIR  # noqa: E402
from lantern_rt.runtime.tree import load_tree  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    md = open_model_dir(DEMO_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = export_bundle(md, Path(tmp) / "bundle", trees=[load_tree(TREE)], threads=1)
        arrays = {}
        for backend, method, mode in CASES:
            mc = method_config(method)
            pipe = (
                torch_pipeline(md, mc)
                if backend == "torch"
                else onnxruntime_pipeline(Bundle.open(bundle), mc, threads=1)
            )
            result = generate(pipe, LABELS, sampling(mode), seed=SEED, progress=False)
            arrays[f"{backend}/{method}/{mode}"] = result.tokens.numpy()
            print(backend, method, mode, result.stats.mean_accepted_length)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
