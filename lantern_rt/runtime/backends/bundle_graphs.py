"""Backends over a bundle's graphs, whatever engine runs them (onnxruntime, TensorRT).

An engine supplies a :data:`RunnerFactory`: given the bundle folder and one graph's manifest
entry it returns a :class:`GraphRunner`. Everything else—which graph serves which call, the KV
caches, masks and the VQ decoder's fixed batch—lives here once, for every engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lantern_rt.export.bundle import BundleError, load_manifest
from lantern_rt.models.neighbors import load_neighbors_file
from lantern_rt.runtime.drafting import CatchUp, DraftOutputs, FilterInputs
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.tree import StaticTree, build_tree


class GraphRunner(Protocol):
    """One bundle graph on an engine.

    Called with torch tensors in the manifest's input order (a ``past_k_{i}``/``past_v_{i}``
    input per layer); returns its outputs in the manifest's order. The returned tensors are the
    runner's own buffers: valid until its next call.
    """

    device: torch.device

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]: ...


RunnerFactory = Callable[[Path, dict[str, Any]], GraphRunner]


def torch_dtype(name: str) -> torch.dtype:
    """The manifest's dtype name (numpy's) as a torch dtype."""
    return getattr(torch, name)


CACHE_INPUTS = ("past_k_", "past_v_")
SAMPLING_INPUTS = ("cfg_scale", "temperature", "top_k", "top_p")  # sampling.filter_inputs, cached


def bound_by_pointer(spec: dict[str, Any]) -> bool:
    """Whether an input is bound where the caller keeps it rather than copied: the caches (too
    large to copy) and the sampling settings (the same tensors every call)."""
    return spec["name"].startswith(CACHE_INPUTS) or spec["name"] in SAMPLING_INPUTS


def check_inputs(inputs: list[dict[str, Any]], args: tuple[Tensor, ...]) -> None:
    """``ValueError`` unless ``args`` are one tensor per declared input, each of its shape."""
    if len(args) != len(inputs):
        raise ValueError(f"the graph takes {len(inputs)} inputs, got {len(args)}")
    for spec, arg in zip(inputs, args, strict=True):
        if list(arg.shape) != spec["shape"]:
            raise ValueError(
                f"input {spec['name']} has shape {list(arg.shape)}, the graph wants {spec['shape']}"
            )


def kv_layers(entry: dict[str, Any]) -> int:
    """Layers of a step graph: how many ``past_k_{i}`` inputs it declares."""
    return sum(spec["name"].startswith("past_k_") for spec in entry["inputs"])


def cache_for(entry: dict[str, Any], device: torch.device) -> KVCache:
    """An empty cache shaped like a graph's per-layer ``past_k_{i}`` inputs, on ``device``."""
    past = next(spec for spec in entry["inputs"] if spec["name"] == "past_k_0")
    rows, heads, capacity, head_dim = past["shape"]
    return KVCache(kv_layers(entry), rows, heads, capacity, head_dim, torch_dtype(past["dtype"]), device)


class StepGraphs:
    """A bundle's ``{prefix}_{S}`` graphs, one per exported S, and the cache their inputs declare."""

    def __init__(
        self, bundle: Path, graphs: dict[str, Any], prefix: str, sizes: list[int], runner: RunnerFactory
    ):
        self.prefix = prefix
        self.entries = {s: graphs[f"{prefix}_{s}"] for s in sizes}
        self.graphs = {s: runner(bundle, entry) for s, entry in self.entries.items()}

    def __getitem__(self, s: int) -> GraphRunner:
        """The graph for ``s`` tokens; :class:`BundleError` when it was not exported."""
        graph = self.graphs.get(s)
        if graph is None:
            raise BundleError(
                f"the bundle has no {self.prefix}_{s} graph (it has steps of {sorted(self.graphs)} "
                "tokens); export it with that tree"
            )
        return graph

    def new_cache(self) -> KVCache:
        """An empty cache for these graphs (see :func:`cache_for`)."""
        s, entry = next(iter(self.entries.items()))
        return cache_for(entry, self.graphs[s].device)


class BundleTarget:
    """``TargetBackend`` over a bundle's ``target_prefill`` and ``target_step_{S}`` graphs."""

    def __init__(self, bundle: str | Path, runner: RunnerFactory, name: str):
        bundle = Path(bundle)
        manifest = load_manifest(bundle)
        self.name = name
        self.cls_token_num = manifest["constants"]["cls_token_num"]
        self._prefill = runner(bundle, manifest["graphs"]["target_prefill"])
        sizes = manifest["constants"]["step_sizes"]
        self._steps = StepGraphs(bundle, manifest["graphs"], "target_step", sizes, runner)
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
        logits, hidden, k, v = graph(tokens, positions, mask, *self.cache.layers_k, *self.cache.layers_v)
        self.cache.stage(k, v)
        return logits, hidden


class BundleDrafter:
    """``DrafterBackend`` over a bundle's drafting graphs, one per exported tree (the drafter's
    layers and the LM head are inside them); its cache has the manifest's ``drafter_capacity``."""

    def __init__(self, bundle: str | Path, runner: RunnerFactory, name: str):
        bundle = Path(bundle)
        manifest = load_manifest(bundle)
        constants, graphs = manifest["constants"], manifest["graphs"]
        trees = {name: tree for name, tree in manifest["trees"].items() if tree.get("graph")}
        if not constants["drafter"] or not trees:
            raise BundleError(
                f"{bundle} has no drafter graphs; export it from a model directory with a drafter "
                "and at least one tree"
            )
        self.name = name
        self.vocab_size = constants["vocab_size"]
        self._graphs = {
            tuple(map(tuple, tree["paths"])): runner(bundle, graphs[tree["graph"]]) for tree in trees.values()
        }
        entry = graphs[next(iter(trees.values()))["graph"]]
        self.cache = cache_for(entry, next(iter(self._graphs.values())).device)

    def draft(self, tree: StaticTree, rows: CatchUp, noise: Tensor, sampling: FilterInputs) -> DraftOutputs:
        graph = self._graphs.get(tree.paths)
        if graph is None:
            raise BundleError(
                f"the bundle has no drafting graph for tree {tree.name}; export it with that tree"
            )
        return graph(*rows, noise, *sampling, *self.cache.layers_k, *self.cache.layers_v)


class BundleVQDecoder:
    """The bundle's ``vq_decode`` graph: codes [N, grid^2] -> images [N, C, H, W] in about [-1, 1]."""

    def __init__(self, bundle: str | Path, runner: RunnerFactory):
        bundle = Path(bundle)
        entry = load_manifest(bundle)["graphs"]["vq_decode"]
        self._graph = runner(bundle, entry)
        self.batch = entry["inputs"][0]["shape"][0]

    def decode(self, codes: Tensor) -> Tensor:
        """Decode in chunks of the graph's fixed batch, zero-padding the last one."""
        images = []
        for start in range(0, len(codes), self.batch):
            chunk = codes[start : start + self.batch]
            padded = torch.zeros(self.batch, *codes.shape[1:], dtype=codes.dtype, device=codes.device)
            padded[: len(chunk)] = chunk
            images.append(self._graph(padded)[0][: len(chunk)].clone())
        return torch.cat(images)


def bundle_neighbors(bundle: str | Path, k: int | None = None) -> Tensor:
    """The bundle's latent-neighbour table [V, k] as int64 (on the CPU): all its columns, or the
    first ``k`` (:class:`BundleError` when it stores fewer)."""
    bundle = Path(bundle)
    table = load_neighbors_file(bundle / load_manifest(bundle)["constants"]["neighbors"]["file"])
    if k is None:
        return table
    if table.shape[1] < k:
        raise BundleError(f"bundle {bundle} stores {table.shape[1]} neighbours per code, fewer than k={k}")
    return table[:, :k]


def bundle_trees(bundle: str | Path) -> dict[str, StaticTree]:
    """The trees the bundle was exported for, by name, validated against its drafting width."""
    manifest = load_manifest(Path(bundle))
    width = manifest["constants"]["max_draft_width"]
    return {
        name: build_tree(tree["paths"], name=tree["name"], max_width=width)
        for name, tree in manifest["trees"].items()
    }
