"""Generation statistics: what a run measured, as a typed object and as the JSON users read.

The meaning of the acceptance figures is in docs/method.md §8.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lantern_rt.runtime.sampling import SamplingConfig


def tau(accepted_tokens: int, verify_calls: int) -> float:
    """Tokens committed per target verify call, bonus included (1.0 for AR; 0 with no calls)."""
    return accepted_tokens / verify_calls if verify_calls else 0.0


@dataclass
class GenerationStats:
    """Timings and acceptance of one :func:`lantern_rt.generate.generate` call.

    ``accepted`` holds the tokens each verify step committed to an image, bonus included (1 for
    every AR step), over all images in order; ``seconds_per_image`` the decode time of each
    image: with a batch of several, the time from the previous image's end to its own (the
    images of a batch share each call), so that the sum is the decode time.
    """

    model: str
    method: str
    params: dict[str, Any]
    tree: dict[str, Any] | None
    backend: str
    device: str
    tokens_per_image: int
    accepted: list[int]
    seconds_per_image: list[float]
    vq_decode_seconds: float
    total_seconds: float
    seed: int
    sampling: SamplingConfig
    labels: list[int | str]  # class ids, or prompts
    batch_size: int = 1  # images per decode call
    streams: int = 1  # batches decoded at once (docs/method.md §15)
    extra: dict[str, Any] = field(default_factory=dict)  # added by the caller (e.g. the output path)

    @property
    def num_images(self) -> int:
        return len(self.labels)

    @property
    def verify_calls(self) -> int:
        return len(self.accepted)

    @property
    def target_calls(self) -> int:
        """Verify calls plus one prefill per image."""
        return self.verify_calls + self.num_images

    @property
    def histogram(self) -> Counter[int]:
        """Accepted length -> number of verify calls that committed that many tokens."""
        return Counter(self.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verify call, bonus included (:func:`tau`)."""
        return tau(sum(self.accepted), len(self.accepted))

    @property
    def decode_seconds(self) -> float:
        return sum(self.seconds_per_image)

    def to_json(self) -> dict[str, Any]:
        """The statistics JSON of ``lantern generate --stats-json`` (histogram keys as strings)."""
        histogram = self.histogram
        return {
            "model": self.model,
            "method": self.method,
            "params": self.params,
            "tree": self.tree,
            "backend": self.backend,
            "device": self.device,
            "num_images": self.num_images,
            "batch_size": self.batch_size,
            "streams": self.streams,
            "tokens_per_image": self.tokens_per_image,
            "target_calls": self.target_calls,
            "verify_calls": self.verify_calls,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": {str(n): histogram[n] for n in sorted(histogram)},
            "decode_seconds": self.decode_seconds,
            "seconds_per_image": list(self.seconds_per_image),
            "vq_decode_seconds": self.vq_decode_seconds,
            "total_seconds": self.total_seconds,
            "seed": self.seed,
            "sampling": dataclasses.asdict(self.sampling),
            **(
                {"prompts": list(self.labels)}
                if any(isinstance(x, str) for x in self.labels)
                else {"labels": list(self.labels)}
            ),
            **self.extra,
        }
