"""Backends over a bundle's graphs, whatever engine runs them (onnxruntime, TensorRT).

An engine supplies a :data:`RunnerFactory`: given the opened :class:`~lantern_rt.bundle.Bundle`
and one of its graphs it returns a :class:`GraphRunner`. Everything else—which graph serves which call, the KV
caches, masks and the VQ decoder's fixed batch—lives here once, for every engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch
from torch import Tensor

from lantern_rt.bundle import (
    AR_STEP_GRAPH,
    DRAFTER_PREFILL_GRAPH,
    PREFILL_GRAPH,
    VQ_DECODE_GRAPH,
    BatchGraphs,
    Bundle,
    BundleError,
    GraphEntry,
    paths_depth,
    step_windows,
    windowed_name,
)
from lantern_rt.errors import option
from lantern_rt.graph_spec import TensorSpec, dtype_name
from lantern_rt.runtime.acceptance import RelaxInputs, Verified
from lantern_rt.runtime.backends.base import CatchUp, Draft, DraftOutputs
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH, TreeDrafter
from lantern_rt.runtime.jacobi import is_window
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.method import MethodConfig
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import FilterInputs
from lantern_rt.runtime.speculation import method_speculation
from lantern_rt.runtime.streams import Stream
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree, build_tree, load_tree


class GraphRunner(Protocol):
    """One bundle graph on an engine.

    Called with torch tensors by the names the manifest declares (a ``past_k_{i}``/``past_v_{i}``
    input per layer; :func:`ordered` checks and orders them); returns its outputs by the names
    the manifest declares (:data:`Outputs`, as Polygraphy's runners do), so that a caller reads
    each by name, whatever the graph's order. The returned mapping and its tensors are the
    runner's own (read-only; the same mapping every call): valid until its next call; a
    ``present_*`` output (a graph that writes its cache in place) is the ``past_*`` input's own
    memory, written by the call.
    """

    device: torch.device

    def __call__(self, **inputs: Tensor) -> Outputs: ...


# A graph call's outputs: output name (as the manifest declares it) -> tensor.
Outputs = Mapping[str, Tensor]
RunnerFactory = Callable[[Bundle, GraphEntry], GraphRunner]


CACHE_INPUTS = ("past_k_", "past_v_")
SAMPLING_INPUTS = FilterInputs._fields  # each image's: sampling.SamplingRows
RELAX_INPUTS = ("neighbors", "k", "cap_a", "cap_b", "greedy")  # acceptance.RelaxInputs, per image
LENGTH_INPUTS = ("cache_length", "root_position")  # the caches' own length tensors, updated in place


def bound_by_pointer(spec: TensorSpec) -> bool:
    """Whether an input is bound where the caller keeps it rather than copied: the caches and
    the neighbour table (too large to copy), the sampling settings, the relaxation and the
    caches' lengths (the same tensors every call; a captured CUDA graph reads their values)."""
    return spec.name.startswith(CACHE_INPUTS) or spec.name in SAMPLING_INPUTS + RELAX_INPUTS + LENGTH_INPUTS


def ordered(inputs: tuple[TensorSpec, ...], named: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """The tensors ``named`` by a graph's declared ``inputs``, in their order; ``ValueError``
    unless there is exactly one per input, each of its shape and dtype (a runner copies or binds
    them as they are: a wrong dtype would be cast, or its bytes misread)."""
    args = tuple(named.get(spec.name) for spec in inputs)
    if len(named) != len(inputs) or any(arg is None for arg in args):
        missing = [s.name for s in inputs if s.name not in named]
        unknown = set(named) - {s.name for s in inputs}
        raise ValueError(
            f"the graph's inputs are {[s.name for s in inputs]}: missing {missing}, unknown {sorted(unknown)}"
        )
    for spec, arg in zip(inputs, args, strict=True):
        check_input(spec, arg)
    return args


def changed_inputs(
    inputs: tuple[TensorSpec, ...], named: dict[str, Tensor], bound: list[Tensor | None]
) -> Iterator[tuple[int, TensorSpec, Tensor]]:
    """The ``named`` tensors of a graph's declared ``inputs`` that are not already its buffers
    (``bound[i]``, set where they lie and checked then): ``(i, spec, tensor)``, each checked by
    :func:`check_input`; ``ValueError`` as :func:`ordered` says unless there is one per input."""
    if len(named) != len(inputs):
        ordered(inputs, named)  # raises: which inputs are missing or unknown
    for i, spec in enumerate(inputs):
        arg = named.get(spec.name)
        if arg is None:
            ordered(inputs, named)  # raises
        if arg is not bound[i]:
            check_input(spec, arg)
            yield i, spec, arg


def check_input(spec: TensorSpec, arg: Tensor) -> None:
    """``ValueError`` unless ``arg`` has the shape and dtype the graph declares for ``spec``."""
    if arg.shape != spec.shape:  # a torch.Size equals the tuple of its sizes
        raise ValueError(f"input {spec.name} has shape {list(arg.shape)}, the graph wants {list(spec.shape)}")
    if arg.dtype != spec.torch_dtype:
        raise ValueError(f"input {spec.name} has dtype {dtype_name(arg.dtype)}, the graph wants {spec.dtype}")


def cache_inputs(cache: KVCache) -> dict[str, Tensor]:
    """A cache's per-layer tensors by a step graph's input names (``past_k_{i}``, ``past_v_{i}``):
    each layer's window, or, for graphs that write the cache in place (scratch slots), the
    window with every scratch slot after it."""
    layers_k, layers_v = cache.in_place(cache.scratch) if cache.scratch else (cache.layers_k, cache.layers_v)
    return {
        **{f"{CACHE_INPUTS[0]}{i}": k for i, k in enumerate(layers_k)},
        **{f"{CACHE_INPUTS[1]}{i}": v for i, v in enumerate(layers_v)},
    }


def cache_for(
    entry: GraphEntry,
    graphs: BatchGraphs,
    device: torch.device,
    prefix: int = 0,
    windows: tuple[int, ...] = (),
    scratch: int = 0,
    at_length: bool = False,
) -> KVCache:
    """An empty cache for the batch of ``graphs`` (2B rows, or B for a bundle exported without
    guidance: the run shape it was exported for) whose heads, slots and dtype are those of
    ``entry``'s per-layer ``past_k_{i}`` inputs (``scratch`` of their slots the scratch slots
    after the window, for graphs that write their rows into the cache; ``at_length``: at each
    image's length, else at the window's end, see :class:`KVCache`), on ``device``, keeping
    the visibility of ``prefix`` condition slots, read through ``windows``."""
    pasts = [spec for spec in entry.inputs if spec.name.startswith(CACHE_INPUTS[0])]  # a layer each
    _, heads, slots, head_dim = pasts[0].shape
    shape = RunShape(graphs.size, graphs.bundle.constants.guided)
    return KVCache(
        len(pasts),
        heads,
        slots - scratch,
        head_dim,
        pasts[0].torch_dtype,
        device,
        shape,
        prefix=prefix,
        windows=windows,
        scratch=scratch,
        at_length=at_length,
    )


class BundleTarget:
    """``TargetBackend`` over a bundle's prefill graph and its verify graphs for the batch of
    ``graphs`` (from :meth:`Bundle.batch`): one per tree with a drafter (``target_verify_{i}``) and AR's
    ``target_ar_step``, each once per cache window (names with ``_w{window}`` below the whole
    cache, ``_b{batch}`` for batches above 1); a call runs the one of the cache's window."""

    def __init__(self, graphs: BatchGraphs, runner: RunnerFactory, name: str):
        bundle = graphs.bundle
        self.name = name
        self.cls_token_num = bundle.constants.cls_token_num
        self._prefill = runner(bundle, graphs.graph(PREFILL_GRAPH))
        names = {ROOT_ONLY.paths: AR_STEP_GRAPH}
        names |= {tree.paths: tree.verify for tree in bundle.trees.values() if tree.verify is not None}
        capacity, windows = bundle.constants.cache_capacity, bundle.constants.cache_windows
        self._verify = {
            (paths, w): runner(bundle, graphs.graph(windowed_name(name, w, capacity)))
            for paths, name in names.items()
            for w in step_windows(windows, self.cls_token_num, paths_depth(paths))
        }
        device = self._verify[ROOT_ONLY.paths, capacity].device
        scratch = bundle.constants.cache_scratch
        if scratch and device.type != "cpu":
            raise BundleError(
                f"{bundle.path} writes its cache in place, which onnxruntime does on the CPU only: "
                f"run it with {option('device', 'cpu')}, or export the model without --cache-in-place"
            )
        step = graphs.graph(AR_STEP_GRAPH)
        self.cache = cache_for(step, graphs, device, self.cls_token_num, windows, scratch, at_length=True)

    def prefill(
        self, cond: Tensor, prefix: Tensor | None = None, fresh: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        prefix = self.cache.visible(prefix)
        out = self._prefill(cond=cond, prefix=prefix)
        self.cache.restart(out["new_k"], out["new_v"], fresh, prefix)
        return out["logits"], out["hidden"]

    def verify(
        self,
        tree: StaticTree,
        draft: Draft,
        noise: Tensor,
        bonus_noise: Tensor,
        sampling: FilterInputs,
        relax: RelaxInputs,
    ) -> Verified:
        cache = self.cache
        graph = self._verify.get((tree.paths, cache.window))
        if graph is None:
            raise BundleError(
                f"the bundle has no verify graph for tree {tree.name}; export it with that tree"
            )
        out = graph(
            node_tokens=draft.tokens,
            cache_length=cache.length,
            prefix=cache.prefix,
            valid=draft.valid,
            q=draft.q,
            noise=noise,
            bonus_noise=bonus_noise,
            **sampling._asdict(),
            **relax._asdict(),
            **cache_inputs(cache),
        )
        # a graph that wrote every node's K/V into the cache (scratch slots) has no new_k/new_v
        return Verified(
            out["length"],
            out["kept"],
            out["tokens"],
            out["hidden"],
            out.get("new_k"),
            out.get("new_v"),
            out["logits"],
            out["probs"],
        )


class BundleDrafter(TreeDrafter):
    """A :class:`TreeDrafter` over a bundle's drafting graphs for the batch of ``graphs``, one
    per exported tree (the drafter's layers and the LM head are inside them);
    its cache has the manifest's ``drafter_capacity``, then ``drafter_scratch`` slots the graphs
    write their rows into when exported with the cache written in place (``drafting.Scratch``)."""

    def __init__(self, graphs: BatchGraphs, runner: RunnerFactory, name: str):
        bundle = graphs.bundle
        trees = [tree for tree in bundle.trees.values() if tree.graph is not None]
        if not bundle.has_drafter or not trees:
            raise BundleError(
                f"{bundle.path} has no drafter graphs; export it from a model directory with a "
                "drafter and at least one tree"
            )
        self.name = name
        self.vocab_size = bundle.constants.vocab_size
        entries = {tree.paths: graphs.graph(tree.graph) for tree in trees}
        self._graphs = {paths: runner(bundle, entry) for paths, entry in entries.items()}
        pairs = bundle.constants.cls_token_num - 1  # the condition prefix's pairs
        device = next(iter(self._graphs.values())).device
        scratch = bundle.constants.drafter_scratch
        self.cache = cache_for(next(iter(entries.values())), graphs, device, pairs, scratch=scratch)
        entry = graphs.graph(DRAFTER_PREFILL_GRAPH) if pairs else None
        self._prefill = runner(bundle, entry) if entry is not None else None
        self._prompt = entry is not None and len(entry.inputs) > 1  # a prompt-token drafter

    def prefill(self, hidden: Tensor, fresh: Tensor, cond: Tensor, prefix: Tensor) -> None:
        if self._prefill is None:
            self.cache.length.masked_fill_(fresh, 0)
        elif self._prompt:
            visible = prefix[:, :-1]  # the graph's prompt_pairs: slot j's pair is seen where slot j is
            out = self._prefill(hidden=hidden, cond=cond, prefix=prefix)
            self.cache.restart(out["new_k"], out["new_v"], fresh, visible)
        else:
            out = self._prefill(hidden=hidden)
            self.cache.restart(out["new_k"], out["new_v"], fresh)

    def draft(self, tree: StaticTree, rows: CatchUp, noise: Tensor, sampling: FilterInputs) -> DraftOutputs:
        graph = self._graphs.get(tree.paths)
        if graph is None:
            raise BundleError(
                f"the bundle has no drafting graph for tree {tree.name}; export it with that tree"
            )
        catch_up = {
            name: t for name, t in rows._asdict().items() if t is not None
        }  # prefix: a prompt drafter's
        out = graph(
            **catch_up,
            noise=noise,
            **sampling._asdict(),
            **cache_inputs(self.cache),
        )
        # written in place (scratch slots): no new_k/new_v
        return out["node_tokens"], out["valid"], out["q"], out.get("new_k"), out.get("new_v")


class BundleVQDecoder:
    """The bundle's ``vq_decode`` graph: codes [N, grid^2] -> images [N, C, H, W] in about [-1, 1].
    Safe to call from several threads at once (a server's requests decode their images while the
    decode loop runs): one call runs the graph at a time, as its runner's buffers are its own."""

    def __init__(self, bundle: Bundle, runner: RunnerFactory):
        entry = bundle.graph(VQ_DECODE_GRAPH)
        self._graph = runner(bundle, entry)
        self._lock = threading.Lock()
        self.batch = entry.inputs[0].shape[0]

    def decode(self, codes: Tensor) -> Tensor:
        """Decode in chunks of the graph's fixed batch, zero-padding the last one."""
        images = []
        for start in range(0, len(codes), self.batch):
            chunk = codes[start : start + self.batch]
            padded = torch.zeros(self.batch, *codes.shape[1:], dtype=codes.dtype, device=codes.device)
            padded[: len(chunk)] = chunk
            with self._lock:  # the runner's input and output buffers hold one call's
                images.append(self._graph(codes=padded)["images"][: len(chunk)].clone())
        return torch.cat(images)


def bundle_trees(bundle: Bundle) -> dict[str, StaticTree]:
    """The trees the bundle was exported for, by name, validated against its drafting width."""
    width = bundle.constants.max_draft_width
    return {
        name: build_tree([list(p) for p in tree.paths], name=tree.name, max_width=width)
        for name, tree in bundle.trees.items()
    }


def bundle_windows(bundle: Bundle) -> dict[str, StaticTree]:
    """The bundle's trees that can serve a Jacobi window (docs/method.md §11), by name: its chains
    and pac trees with a verify graph."""
    return {n: t for n, t in bundle_trees(bundle).items() if is_window(t) and bundle.trees[n].verify}


def bundle_stream(
    bundle: Bundle, batch: int, method: MethodConfig, runner: RunnerFactory, name: str
) -> Stream:
    """The target (its own cache) and the speculation ``method`` runs over a bundle's graphs for
    ``batch`` images, on ``runner``'s engine (``name``): what a decode stream holds."""
    graphs = bundle.batch(batch)
    target = BundleTarget(graphs, runner, name)
    if method.method == "ar":
        return Stream(target)
    if method.jacobi:  # the window drafts from the target's own distributions
        tree, drafter = load_tree(method.tree, MAX_DRAFT_WIDTH), None
    else:
        tree = bundle_trees(bundle).get(method.tree) or load_tree(method.tree, MAX_DRAFT_WIDTH)
        drafter = BundleDrafter(graphs, runner, name)
    return Stream(target, method_speculation(target, bundle.gpt, tree, method, drafter, bundle.neighbors()))
