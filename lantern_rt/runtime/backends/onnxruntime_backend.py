"""The onnxruntime backend: a bundle's graphs run on torch tensors, bound in place (IOBinding).

Inputs and outputs are torch tensors whose memory onnxruntime reads and writes directly, on the
CPU or, with the CUDA execution provider, on the GPU, so the KV cache never leaves its device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor

from lantern_rt.export.bundle import BundleError, load_manifest
from lantern_rt.models.neighbors import load_neighbors_file
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.tree import StaticTree, build_tree

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def default_providers() -> list[str]:
    """The CUDA execution provider when both onnxruntime and torch can use a GPU, else the CPU."""
    if CUDA in ort.get_available_providers() and torch.cuda.is_available():
        return [CUDA, CPU]
    return [CPU]


class OrtGraph:
    """One bundle graph in an onnxruntime session, called with and returning torch tensors."""

    def __init__(self, bundle: Path, entry: dict[str, Any], threads: int, providers: list[str]):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(bundle / entry["file"]), options, providers=providers)
        on_gpu = self.session.get_providers()[0] == CUDA
        self.device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        self.inputs, self.outputs = entry["inputs"], entry["outputs"]

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        binding = self.session.io_binding()
        held = []  # keeps converted inputs alive until the run is over
        for spec, arg in zip(self.inputs, args, strict=True):
            if list(arg.shape) != spec["shape"]:
                raise ValueError(
                    f"input {spec['name']} has shape {list(arg.shape)}, the graph wants {spec['shape']}"
                )
            held.append(arg.to(self.device, getattr(torch, spec["dtype"])).contiguous())
            self._bind(binding.bind_input, spec, held[-1])
        outputs = tuple(
            torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=self.device)
            for spec in self.outputs
        )
        for spec, out in zip(self.outputs, outputs, strict=True):
            self._bind(binding.bind_output, spec, out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # torch's pending writes, e.g. a cache commit
        self.session.run_with_iobinding(binding)
        return outputs

    def _bind(self, bind: Any, spec: dict[str, Any], tensor: Tensor) -> None:
        index = self.device.index or 0
        bind(spec["name"], self.device.type, index, np.dtype(spec["dtype"]), spec["shape"], tensor.data_ptr())


class StepGraphs:
    """A bundle's ``{prefix}_{S}`` graphs, one per exported S, and the cache their inputs declare."""

    def __init__(
        self,
        bundle: Path,
        graphs: dict[str, Any],
        prefix: str,
        sizes: list[int],
        threads: int,
        providers: list[str],
    ):
        self.prefix = prefix
        self.graphs = {s: OrtGraph(bundle, graphs[f"{prefix}_{s}"], threads, providers) for s in sizes}

    def __getitem__(self, s: int) -> OrtGraph:
        """The graph for ``s`` tokens; :class:`BundleError` when it was not exported."""
        graph = self.graphs.get(s)
        if graph is None:
            raise BundleError(
                f"the bundle has no {self.prefix}_{s} graph (it has steps of {sorted(self.graphs)} "
                "tokens); export it with that tree"
            )
        return graph

    def new_cache(self) -> KVCache:
        """An empty cache shaped like the ``past_k`` input of the graphs, on their device."""
        graph = next(iter(self.graphs.values()))
        past = next(spec for spec in graph.inputs if spec["name"] == "past_k")
        n_layer, rows, heads, capacity, head_dim = past["shape"]
        return KVCache(n_layer, rows, heads, capacity, head_dim, getattr(torch, past["dtype"]), graph.device)


class OrtTarget:
    """``TargetBackend`` over a bundle's ``target_prefill`` and ``target_step_{S}`` graphs."""

    name = "onnxruntime"

    def __init__(self, bundle: str | Path, threads: int = 0, providers: list[str] | None = None):
        bundle = Path(bundle)
        manifest = load_manifest(bundle)
        providers = providers or default_providers()
        sizes = manifest["constants"]["step_sizes"]
        self.cls_token_num = manifest["constants"]["cls_token_num"]
        self._prefill = OrtGraph(bundle, manifest["graphs"]["target_prefill"], threads, providers)
        self._steps = StepGraphs(bundle, manifest["graphs"], "target_step", sizes, threads, providers)
        self.cache = self._steps.new_cache()

    def prefill(self, cond: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.reset()
        logits, hidden, k, v = self._prefill(cond)
        self.cache.stage(k, v)
        self.cache.commit(list(range(self.cls_token_num)))
        return logits, hidden

    def step(self, tokens: Tensor, positions: Tensor, tree_mask: Tensor) -> tuple[Tensor, Tensor]:
        graph = self._steps[len(tokens)]
        mask = self.cache.mask(tree_mask.to(self.cache.k.device))
        logits, hidden, k, v = graph(tokens, positions, mask, self.cache.k, self.cache.v)
        self.cache.stage(k, v)
        return logits, hidden


class OrtDrafter:
    """``DrafterBackend`` over a bundle's ``drafter_step_{S}`` graphs (the LM head is inside them);
    its cache has the manifest's ``drafter_capacity``."""

    name = "onnxruntime"

    def __init__(self, bundle: str | Path, threads: int = 0, providers: list[str] | None = None):
        bundle = Path(bundle)
        manifest = load_manifest(bundle)
        constants = manifest["constants"]
        if not constants["drafter"] or not constants["drafter_step_sizes"]:
            raise BundleError(
                f"{bundle} has no drafter graphs; export it from a model directory with a drafter "
                "and at least one tree"
            )
        providers = providers or default_providers()
        sizes = constants["drafter_step_sizes"]
        self._steps = StepGraphs(bundle, manifest["graphs"], "drafter_step", sizes, threads, providers)
        self.cache = self._steps.new_cache()

    def step(
        self, tokens: Tensor, hidden: Tensor, positions: Tensor, new_mask: Tensor, scratch: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        graph = self._steps[len(tokens)]
        device = self.cache.k.device
        mask = self.cache.mask(new_mask.to(device), None if scratch is None else scratch.to(device))
        logits, out, k, v = graph(tokens, hidden, positions, mask, self.cache.k, self.cache.v)
        self.cache.stage(k, v)
        return logits, out


def bundle_neighbors(bundle: str | Path) -> Tensor:
    """The bundle's latent-neighbour table [V, k] as int64 (on the CPU)."""
    bundle = Path(bundle)
    return load_neighbors_file(bundle / load_manifest(bundle)["constants"]["neighbors"]["file"])


def bundle_trees(bundle: str | Path) -> dict[str, StaticTree]:
    """The trees the bundle was exported for, by name, validated against its drafting width."""
    manifest = load_manifest(Path(bundle))
    width = manifest["constants"]["max_draft_width"]
    return {
        name: build_tree(tree["paths"], name=tree["name"], max_width=width)
        for name, tree in manifest["trees"].items()
    }


class OrtVQDecoder:
    """The bundle's ``vq_decode`` graph: codes [N, grid^2] -> images [N, C, H, W] in about [-1, 1]."""

    def __init__(self, bundle: str | Path, threads: int = 0, providers: list[str] | None = None):
        bundle = Path(bundle)
        entry = load_manifest(bundle)["graphs"]["vq_decode"]
        self._graph = OrtGraph(bundle, entry, threads, providers or default_providers())
        self.batch = entry["inputs"][0]["shape"][0]

    def decode(self, codes: Tensor) -> Tensor:
        """Decode in chunks of the graph's fixed batch, zero-padding the last one."""
        images = []
        for start in range(0, len(codes), self.batch):
            chunk = codes[start : start + self.batch]
            padded = torch.zeros(self.batch, *codes.shape[1:], dtype=codes.dtype, device=codes.device)
            padded[: len(chunk)] = chunk
            images.append(self._graph(padded)[0][: len(chunk)])
        return torch.cat(images)
