"""The interface of a model family: everything lantern-rt knows about one family of models is
a :class:`Family`, and the rest of the package asks it (docs/architecture.md).

A family reads its model directories and checkpoints, builds each image's condition (class
ids, captions, prompt rows), writes its files into a bundle and turns training files into
conditions. The decoding loop, the graphs and the backends see only the target
(:class:`~lantern_rt.models.target.Transformer`), its :class:`~lantern_rt.models.config.GPTConfig`
and :class:`~lantern_rt.runtime.decode.Condition` rows, whatever the family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from lantern_rt.models.config import ConfigError, GPTConfig
from lantern_rt.models.drafter import DrafterConfig
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.decode import Condition

if TYPE_CHECKING:
    from lantern_rt.bundle import Bundle
    from lantern_rt.runtime.backends.bundle_graphs import RunnerFactory

# what a run makes (a class id, or a prompt) -> that image's condition
Conditioner = Callable[[int | str], Condition]
# a warning for the user (printed on stderr by the command line)
Warn = Callable[[str], None]


class TrainingRows(Protocol):
    """N images' conditions as a drafter trains on them (what :meth:`Family.training_conditions`
    returns); indexing with image indices selects images."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Tensor) -> TrainingRows: ...

    def teacher_forced_hidden(self, target: Transformer, codes: Tensor, uncond: Tensor) -> Tensor:
        """The target's final-norm hidden states [B, P + T, D] over the P condition slots (each
        image's unconditional row where ``uncond`` [B]) and its T image tokens ``codes`` [B, T],
        teacher-forced, as the runtime's prefill and steps see them."""
        ...

    def prefix_pairs(self, uncond: Tensor) -> tuple[Tensor, Tensor] | None:
        """The drafter's prefix pairs: the condition tokens of slots 1..P-1 [B, P - 1] and which
        of the pairs the others see [B, P - 1]; None for a prefix without pairs (P = 1)."""
        ...


@dataclass(frozen=True)
class ClassRows:
    """N images' class ids ``labels`` int64 [N] as :class:`TrainingRows`: one prefix slot, the
    null class (``num_classes``) on the unconditional rows, one full causal forward."""

    labels: Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Tensor) -> ClassRows:
        return ClassRows(self.labels[index])

    def teacher_forced_hidden(self, target: Transformer, codes: Tensor, uncond: Tensor) -> Tensor:
        cfg = target.config
        if cfg.takes_prompts:
            raise ConfigError(
                f"class labels train a class-conditional target's drafter, not a {cfg.model_type} one"
            )
        cond = torch.where(uncond, torch.full_like(self.labels, cfg.num_classes), self.labels)
        return target.hidden_states(codes, cond)

    def prefix_pairs(self, uncond: Tensor) -> None:
        return None


class Family(ABC):
    """One model family: its name (``"family"`` in a model directory's ``config.json`` and in a
    bundle's manifest) and what only it knows."""

    name: ClassVar[str]

    # -- model directories and checkpoints --------------------------------------------------

    @abstractmethod
    def open_dir(self, root: Path, file: Path, raw: dict[str, Any]) -> ModelDir:
        """The model directory ``root`` from its parsed ``config.json`` (``file``, ``raw``;
        its format version already checked): every field checked, :class:`ConfigError` naming
        the file and the field; nothing loaded."""

    @abstractmethod
    def load_target(self, md: ModelDir, device: str | torch.device, dtype: torch.dtype) -> Transformer:
        """The target with its weights, in eval mode, in the runtime's layout."""

    @abstractmethod
    def load_vq(self, md: ModelDir, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
        """The VQ tokenizer with its weights, in eval mode (``quantize.codebook()`` and
        ``decode_code(codes, grid)``)."""

    def drafter_state(
        self, md: ModelDir, config: DrafterConfig, state: dict[str, Tensor]
    ) -> tuple[DrafterConfig, dict[str, Tensor], Tensor | None]:
        """A drafter checkpoint in this family's layout -> (config, state, prompt table) in the
        runtime's: the table is the embedding of a drafter that reads prompt tokens (None: the
        drafter embeds its condition itself). The default takes the checkpoint as it is."""
        return config, state, None

    @abstractmethod
    def vq_config(self, raw: dict[str, Any]) -> Any:
        """The tokenizer's config from a bundle manifest's ``vq`` section."""

    @abstractmethod
    def default_cfg_scale(self, gpt: GPTConfig) -> float:
        """The guidance scale a model of this kind samples at unless its directory says."""

    # -- conditioning -----------------------------------------------------------------------

    @abstractmethod
    def torch_conditioner(self, md: ModelDir, target: Transformer, device: str, warn: Warn) -> Conditioner:
        """Class id or prompt -> condition, for the torch target ``target`` of ``md``."""

    @abstractmethod
    def bundle_conditioner(
        self, bundle: Bundle, runner: RunnerFactory, device: torch.device, warn: Warn
    ) -> Conditioner:
        """Class id or prompt -> condition, from what the bundle holds (its graphs run by
        ``runner``)."""

    def check_runnable(self, md: ModelDir) -> None:
        """:class:`ConfigError` when ``md`` lacks what generating needs (before any export);
        nothing by default."""
        return None

    # -- bundles ------------------------------------------------------------------------------

    def extra_graphs(self, md: ModelDir, target: Transformer) -> list[nn.Module]:
        """Graphs the bundle holds beside the target's, drafter's and VQ decoder's (export
        modules with a ``spec``); none by default."""
        return []

    @abstractmethod
    def write_bundle_files(self, md: ModelDir, target: Transformer, folder: Path) -> dict[str, Any]:
        """Write this family's files into the bundle being staged in ``folder``; return the
        manifest's additions: ``null_condition`` (what a run's unconditional row is, a
        non-empty object the family reads back) and any family section."""

    def describe_bundle(self, bundle: Bundle) -> list[str]:
        """Lines ``lantern inspect`` prints about what this family's bundle holds for its
        conditions (none by default)."""
        return []

    # -- training -----------------------------------------------------------------------------

    @abstractmethod
    def codes_key(self, gpt: GPTConfig) -> str:
        """What a codes file (.npz) holds for each image beside its ``codes``: ``labels`` (class
        ids) or ``prompts`` (strings); :class:`ConfigError` when this kind of model trains no
        drafter here (the message says what to use instead)."""

    def training_conditions(
        self, md: ModelDir, files: list[tuple[Path, np.ndarray]], warn: Warn
    ) -> TrainingRows:
        """Each codes file's path and ``codes_key`` array [N_i] (its shape and range checked) ->
        the conditions a drafter of ``md`` trains on, in file order (class ids: the arrays
        joined); ``warn`` is told what the user should know."""
        return ClassRows(torch.from_numpy(np.concatenate([values for _, values in files]).astype(np.int64)))
