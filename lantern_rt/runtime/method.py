"""A decoding method and its parameters (:class:`MethodConfig`): what a pipeline's speculation
runs, and the methods there are (torch-free: the command line lists them in its --help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lantern_rt.errors import option
from lantern_rt.models.config import ConfigError

if TYPE_CHECKING:
    from lantern_rt.runtime.acceptance import Relaxation

METHODS = ("ar", "exact", "lantern", "lantern++", "sjd", "sjd++")
# Drafter-free methods: a Jacobi window of a chain or a pac tree (docs/method.md §11), exact or
# with LANTERN++'s neighbour credit.
JACOBI_METHODS = ("sjd", "sjd++")
# How a Jacobi window's carried drafts are coupled across calls (runtime/jacobi.py); the default
# measured the higher tau on the demo (BENCHMARKS.md, issue 50)
COUPLINGS = ("maximal", "gumbel", "none")
DEFAULT_COUPLING = "maximal"
# Measured on the demo (BENCHMARKS.md, onnxruntime, one thread): since the drafter was fine-tuned
# on the target's samples, chain-5 is the fastest tree on a CPU or within 1% of it; a tree's
# verify and drafting cost grow with its size there. On a GPU the wide tree: in one H200 run
# (BENCHMARKS.md, "GPU") LANTERN++ on it made 1.35x AR on the demo (torch CUDA graphs, tau 5.24)
# and its verify cost 1.4-1.6 AR steps at LlamaGen-B and XL sizes at B = 1; no other tree has
# been measured on a GPU.
CPU_DEFAULT_TREE = "chain-5"
GPU_DEFAULT_TREE = "naive_extend_57"


@dataclass(frozen=True)
class MethodConfig:
    """A decoding method and its parameters (ignored by ``ar``)."""

    method: str = "ar"
    tree: str = CPU_DEFAULT_TREE
    k: int = 10
    delta: float = 0.1
    lam: float = 5.0
    drafter: str | None = None  # an EAGLE-layout folder overriding the model's drafter
    coupling: str | None = None  # a Jacobi method's (COUPLINGS; None: DEFAULT_COUPLING)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if self.jacobi and self.drafter is not None:
            raise ConfigError(
                f"{option('method', self.method)} drafts without a drafter: drop {option('drafter')}"
            )
        if self.coupling is not None and not self.jacobi:
            raise ConfigError(
                f"{option('coupling')} sets how {option('method')} {' or '.join(JACOBI_METHODS)} draft, "
                f"not {option('method', self.method)}: drop it"
            )
        if self.coupling is not None and self.coupling not in COUPLINGS:
            raise ConfigError(f"unknown coupling {self.coupling!r}; choose from {', '.join(COUPLINGS)}")

    @property
    def drafts_coupling(self) -> str:
        """The coupling a Jacobi method's window runs (``coupling``, else :data:`DEFAULT_COUPLING`)."""
        return self.coupling or DEFAULT_COUPLING

    @property
    def jacobi(self) -> bool:
        """Whether the method drafts from a Jacobi window instead of a drafter."""
        return self.method in JACOBI_METHODS

    def relaxation(self) -> Relaxation:
        """The acceptance rule of this method (validates k, delta and lambda)."""
        from lantern_rt.runtime.acceptance import Relaxation

        if self.method == "lantern":
            return Relaxation("lantern", k=self.k, delta=self.delta)
        if self.method in ("lantern++", "sjd++"):
            return Relaxation("lantern++", k=self.k, lam=self.lam)
        return Relaxation("exact")

    def params(self) -> dict[str, Any]:
        """The parameters that matter for this method, for reports."""
        if self.method == "ar":
            return {}
        if self.jacobi:
            chain = self.tree.startswith("chain-")
            window = {"window": int(self.tree.removeprefix("chain-"))} if chain else {"tree": self.tree}
            window["coupling"] = self.drafts_coupling
            return window | ({"k": self.k, "lambda": self.lam} if self.method == "sjd++" else {})
        extra = {
            "lantern": {"k": self.k, "delta": self.delta},
            "lantern++": {"k": self.k, "lambda": self.lam},
        }
        return {"tree": self.tree, **extra.get(self.method, {})}
