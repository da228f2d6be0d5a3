"""What a graph declares: its name, its inputs and outputs in call order with their fixed
shapes and dtypes, and the dtype it computes in. Every module that becomes a bundle graph has a
``spec`` (:class:`GraphSpec`); the exporter writes it into the manifest, a bundle reads its
graphs' inputs and outputs back as the same :class:`TensorSpec`, and the runners call graphs by
these names."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, its fixed shape and its dtype, by numpy's name as the
    manifest writes it (``"float16"``, ``"int64"``, ``"bool"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as torch's."""
        return getattr(torch, self.dtype)

    def to_json(self) -> dict[str, object]:
        """The manifest's form: ``{"name", "shape", "dtype"}``."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


PRESENT_PREFIX = "present_"  # a cache output: present_k_{i} is written into past_k_{i}'s memory
IN_PLACE_OPSET = 24  # TensorScatter, which onnxruntime runs in place on a bound cache


@dataclass(frozen=True)
class GraphSpec:
    """A graph's name, inputs and outputs (in order) and the dtype it computes in."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    compute_dtype: torch.dtype

    @property
    def writes_cache(self) -> bool:
        """See :func:`writes_cache`."""
        return writes_cache(self.outputs)

    def to_dict(self) -> dict[str, object]:
        return {
            "compute_dtype": dtype_name(self.compute_dtype),
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }


def writes_cache(outputs: tuple[TensorSpec, ...]) -> bool:
    """Whether a graph of these ``outputs`` returns caches it writes in place (``present_*``,
    bound to the memory of its ``past_*`` inputs; onnxruntime only, opset :data:`IN_PLACE_OPSET`)."""
    return any(t.name.startswith(PRESENT_PREFIX) for t in outputs)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (numpy's names, which the manifest uses)."""
    return str(dtype).removeprefix("torch.")
