"""One copy of the weights on disk for all the graphs of a bundle (docs/method.md §7).

:func:`share_weights` moves every large initializer of a bundle's graphs (prefill, AR step,
verify and drafting graphs of every batch size: the same transformer's weights) into one
weights file, once per distinct content, renamed to its content name ``w_<sha256 prefix>`` (the
exporter names a weight differently in each graph). A run loads the graphs of one batch size.
:class:`GraphByGraph` does the same one graph at a time, as the exporter checks each, so that an
export never holds (in memory or on disk) more than one graph's weights besides the shared file.

What onnxruntime CPU (1.32) does with it in memory, measured with 4 one-thread sessions over
graphs sharing 48 MiB of fp32 MatMul weights: with prepacking on (its default, which the
runtime keeps) every session makes its own prepacked copy of each MatMul/Gemm weight (4 x 48
MiB, shared file or not). With ``session.disable_prepacking`` = "1" it memory-maps the shared
file and the sessions hold one physical copy (PSS 59 MiB against 203), but an 8-row fp32 MatMul
chain then ran 2.4x slower; sharing ``OrtValue``s through ``SessionOptions.add_initializer``
saves nothing more. An fp16 graph gains nothing on the CPU: onnxruntime folds the Casts it
inserts into a private fp32 copy per session.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import external_data_helper, numpy_helper

from lantern_rt.errors import LanternError
from lantern_rt.fileio import atomic_write
from lantern_rt.graph_rules import node_subgraphs, with_subgraphs

ALIGN = 64  # byte alignment of every tensor in the weights file
_TYPED_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


class ShareError(LanternError, ValueError):
    """The graphs cannot share one weights file (already shared, another folder, ...)."""


@dataclass(frozen=True)
class SharedWeights:
    """What :func:`share_weights` wrote: ``tensors`` distinct tensors in ``bytes`` bytes of
    ``file``, read by ``references`` initializers across the graphs."""

    file: Path
    tensors: int
    bytes: int
    references: int


def share_weights(graphs: Sequence[Path], weights_file: Path, min_bytes: int = 1024) -> SharedWeights:
    """Move every initializer of ``graphs`` (subgraphs included) of at least ``min_bytes`` into
    ``weights_file``, once per distinct content, renamed to its content name ``w_<hash>``; the
    graphs are rewritten in place and the external data files they read before are deleted
    unless another graph of the folder reads them. Refuses a ``weights_file`` that exists:
    sharing runs once, on freshly exported graphs. The weights pass through memory one tensor
    at a time; no graph is rewritten unless every one is shared."""
    graphs, weights_file = [Path(p) for p in graphs], Path(weights_file)
    _check_share_args(graphs, weights_file)
    listed = {p.resolve() for p in graphs}
    old: set[str] = set()  # external data files the graphs read before
    serialized: list[bytes] = []
    result: list[SharedWeights] = []

    def write(tmp: Path) -> None:
        with tmp.open("wb") as out:
            writer = WeightsWriter(out, weights_file.name, min_bytes)
            for path in graphs:
                model, read = writer.join(path)
                old.update(read)
                serialized.append(model.SerializeToString())  # here, to fail before any rename
            result.append(writer.result(weights_file))

    atomic_write(weights_file, write)
    for path, data in zip(graphs, serialized, strict=True):
        atomic_write(path, lambda tmp, data=data: tmp.write_bytes(data))
    _delete_unread(weights_file.parent, old, listed)
    return result[0]


class WeightsWriter:
    """A weights file open for writing that graphs join one at a time: :meth:`join` moves a
    graph's initializers of at least ``min_bytes`` into it, once per distinct content, reading
    one tensor at a time (from its external data file or its proto)."""

    def __init__(self, out: BinaryIO, location: str, min_bytes: int = 1024):
        self.out, self.location, self.min_bytes = out, location, min_bytes
        self.offsets: dict[str, tuple[int, int]] = {}  # content key -> (offset, length)
        self.references = 0
        self.size = out.tell()

    def join(self, path: Path) -> tuple[onnx.ModelProto, set[str]]:
        """The graph at ``path`` (left as it is) reading this file for its big initializers,
        renamed to their content names, and everything else inline; the external data files
        (relative to its folder) it read before."""
        model = _load_bare(Path(path))
        read = _external_locations(model)
        self.references += _share_model(model, Path(path).parent, self, self.min_bytes)
        return model, read

    def place(self, key: str, raw: bytes) -> tuple[int, int]:
        """Where the content ``raw`` (content key ``key``) lies in the file: written now, aligned
        to :data:`ALIGN`, unless it is there already."""
        if key not in self.offsets:
            self.out.write(b"\0" * (-self.out.tell() % ALIGN))
            self.offsets[key] = (self.out.tell(), len(raw))
            self.out.write(raw)
            self.size = self.out.tell()
        return self.offsets[key]

    def result(self, file: Path) -> SharedWeights:
        """What the file holds so far (``file``: its final path)."""
        return SharedWeights(file, len(self.offsets), self.size, self.references)


class GraphByGraph:
    """:func:`share_weights` for graphs exported one at a time into a fresh folder: :meth:`add`
    moves a graph's big initializers into ``weights_file`` at once, rewrites the graph and
    deletes the external data files it read unless another graph of the folder reads them, so
    that the folder holds the shared file and the graph being exported, never every graph's
    own copy of the weights. A failure leaves the folder half shared (an exporter's staging
    folder, removed on failure)."""

    def __init__(self, weights_file: Path, min_bytes: int = 1024):
        self.file = Path(weights_file)
        _check_weights_file(self.file)
        self._out = self.file.open("xb")
        self._writer = WeightsWriter(self._out, self.file.name, min_bytes)
        self._added: set[Path] = set()

    def add(self, graph: Path) -> None:
        """Share ``graph``'s weights (a graph of the weights file's folder, added once)."""
        graph = Path(graph)
        _check_graph_folder(graph, self.file)
        if graph.resolve() in self._added:
            raise ShareError(f"{graph} is added twice")
        model, read = self._writer.join(graph)
        self._out.flush()
        atomic_write(graph, lambda tmp: tmp.write_bytes(model.SerializeToString()))
        self._added.add(graph.resolve())
        _delete_unread(self.file.parent, read - {self.file.name}, self._added)

    def close(self) -> SharedWeights:
        """Close the weights file (again: nothing); what it holds."""
        self._out.close()
        return self._writer.result(self.file)

    def __enter__(self) -> GraphByGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _delete_unread(folder: Path, locations: set[str], shared: set[Path]) -> None:
    """Delete the external data files ``locations`` of ``folder`` that no graph there reads,
    the graphs ``shared`` (resolved paths, which read the weights file alone) aside."""
    others = [p for p in folder.glob("*.onnx") if not p.name.startswith(".") and p.resolve() not in shared]
    still_read = set().union(*(_external_locations(_load_bare(p)) for p in others))
    for location in locations - still_read:
        (folder / location).unlink(missing_ok=True)


def _check_share_args(graphs: list[Path], weights_file: Path) -> None:
    if not graphs:
        raise ShareError("no graphs to share weights between")
    if len({p.resolve() for p in graphs}) != len(graphs):
        raise ShareError("a graph is listed twice")
    for path in graphs:
        _check_graph_folder(path, weights_file)
    _check_weights_file(weights_file)


def _check_graph_folder(graph: Path, weights_file: Path) -> None:
    if graph.resolve().parent != weights_file.resolve().parent:
        raise ShareError(f"{graph} is not in the folder of {weights_file}")


def _check_weights_file(weights_file: Path) -> None:
    if weights_file.exists():
        raise ShareError(
            f"{weights_file} already exists: the graphs share their weights already "
            "(share_weights runs once, on freshly exported graphs)"
        )


def _share_model(model: onnx.ModelProto, folder: Path, writer: WeightsWriter, min_bytes: int) -> int:
    """Move ``model``'s big initializers into ``writer``'s file (new contents only) and rename
    them, and bring every other tensor it reads from a file of ``folder`` inline; the number of
    initializers now reading the weights file."""
    taken = set(_value_names(model.graph))
    names: dict[str, str] = {}  # content key -> name, within this model

    def name_of(key: str) -> str:
        if key not in names:
            name, n = f"w_{key[:20]}", 0
            while name in taken:
                n += 1
                name = f"w_{key[:20]}_{n}"
            names[key] = name
            taken.add(name)
        return names[key]

    count = 0

    def share(graph: onnx.GraphProto, outer: dict[str, str], visible: dict[str, str], top: bool) -> None:
        nonlocal count
        renames = dict(outer)  # ONNX forbids a subgraph to redefine (shadow) an outer name
        visible = dict(visible)  # content key -> shared name visible in this scope
        keep = []
        interface = {v.name for v in graph.output} if top else set()
        for tensor in graph.initializer:
            raw = _raw_bytes(tensor, folder)
            if tensor.name in interface or raw is None or len(raw) < max(min_bytes, 1):
                _inline(tensor, raw)
                keep.append(tensor)
                continue
            key = _content_key(tensor, raw)
            count += 1
            if key in visible:  # a duplicate of a tensor in this or an outer scope: drop it
                renames[tensor.name] = visible[key]
                continue
            renames[tensor.name] = visible[key] = name_of(key)
            tensor.name = visible[key]
            _set_external(tensor, writer.location, *writer.place(key, raw))
            keep.append(tensor)
        del graph.initializer[:]
        graph.initializer.extend(keep)
        _rename_values(graph.input, renames)
        _rename_values(graph.value_info, renames)
        if not top:  # If/Loop/Scan match a subgraph's outputs by position
            _rename_values(graph.output, renames, dedupe=False)
        for node in graph.node:
            node.input[:] = [renames.get(name, name) for name in node.input]
            for sub in node_subgraphs(node):
                share(sub, renames, visible, top=False)

    share(model.graph, {}, {}, top=True)
    for tensor in _attribute_tensors(model.graph):
        _inline(tensor, _raw_bytes(tensor, folder))
    return count


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Point ``tensor`` at ``length`` bytes from ``offset`` of ``location`` (its data dropped),
    as ``external_data_helper.set_external_data`` writes it."""
    for field in (*_TYPED_FIELDS, "raw_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def _inline(tensor: onnx.TensorProto, raw: bytes | None) -> None:
    """Hold an external ``tensor``'s bytes ``raw`` in the proto itself; others stay as they are."""
    if raw is not None and external_data_helper.uses_external_data(tensor):
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = raw


def _raw_bytes(tensor: onnx.TensorProto, folder: Path) -> bytes | None:
    """The tensor's little-endian bytes as ``raw_data`` holds them, read from its external data
    file (in ``folder``) when it has one; None for strings."""
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    if external_data_helper.uses_external_data(tensor):
        info = external_data_helper.ExternalDataInfo(tensor)
        with (folder / info.location).open("rb") as f:
            f.seek(info.offset or 0)
            return f.read() if info.length is None else f.read(info.length)
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data


def _content_key(tensor: onnx.TensorProto, raw: bytes) -> str:
    digest = hashlib.sha256(f"{tensor.data_type}:{list(tensor.dims)}:".encode())
    digest.update(raw)
    return digest.hexdigest()


def _rename_values(
    values: MutableSequence[onnx.ValueInfoProto], renames: dict[str, str], dedupe: bool = True
) -> None:
    """Rename, in place, the ValueInfos of a repeated field; drop repeats of a name."""
    seen: set[str] = set()
    kept = []
    for value in values:
        value.name = renames.get(value.name, value.name)
        if not (dedupe and value.name in seen):
            kept.append(value)
        seen.add(value.name)
    del values[:]
    values.extend(kept)


def _value_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every value name in ``graph`` and its subgraphs."""
    for g in with_subgraphs(graph):
        for values in (g.input, g.output, g.value_info):
            yield from (v.name for v in values)
        yield from (t.name for t in g.initializer)
        yield from (t.values.name for t in g.sparse_initializer)
        for node in g.node:
            yield from node.input
            yield from node.output


def _external_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The initializers of ``graph`` and its subgraphs whose data lies in a file."""
    for g in with_subgraphs(graph):
        yield from (t for t in g.initializer if external_data_helper.uses_external_data(t))


def _load_bare(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=False)


def _attribute_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The tensors held in the attributes of the nodes of ``graph`` and its subgraphs."""
    for g in with_subgraphs(graph):
        for attr in (a for node in g.node for a in node.attribute):
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors


def _external_locations(model: onnx.ModelProto) -> set[str]:
    """The external data files ``model`` reads (relative to its folder), from its initializers
    and its nodes' tensor attributes."""
    tensors = [t for g in with_subgraphs(model.graph) for t in g.initializer]
    tensors += _attribute_tensors(model.graph)
    return {
        external_data_helper.ExternalDataInfo(t).location
        for t in tensors
        if external_data_helper.uses_external_data(t)
    }


def initializer_names(path: Path) -> list[str]:
    """Names of the initializers of the graph at ``path`` (subgraphs included) whose data lies
    in an external file: after :func:`share_weights`, those it reads from the weights file."""
    graph = _load_bare(path).graph
    return list(dict.fromkeys(t.name for t in _external_tensors(graph)))
