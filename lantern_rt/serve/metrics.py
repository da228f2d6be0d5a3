"""The service's Prometheus metrics, named in vLLM's style (``lantern:...``), in a registry of
their own (so that two apps in one process, as in the tests, do not collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a fraction of a demo image to minutes of a large model's batch
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    """Counters, gauges and histograms of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lantern:requests", "Image-generation requests by HTTP status.", ["status"], registry=r
        )
        self.images = Counter("lantern:images", "Images finished and sent.", registry=r)
        self.images_cancelled = Counter(
            "lantern:images_cancelled",
            "Images dropped unfinished (client gone, deadline passed, server stopping).",
            registry=r,
        )
        self.images_waiting = Gauge(
            "lantern:num_images_waiting", "Images queued, not yet in a decode slot.", registry=r
        )
        self.slots_busy = Gauge("lantern:num_slots_busy", "Decode slots holding an image.", registry=r)
        self.slots = Gauge("lantern:num_slots", "Decode slots (batch size x streams).", registry=r)
        self.request_seconds = Histogram(
            "lantern:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its response.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "lantern:request_queue_time_seconds",
            "Seconds from a request's arrival to its first image entering a decode slot.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.image_seconds = Histogram(
            "lantern:image_seconds",
            "Seconds an image held its decode slot, prefill to last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.target_calls = Counter(
            "lantern:target_calls", "Target calls: one prefill per image and its verify calls.", registry=r
        )
        self.accepted_tokens = Counter(
            "lantern:accepted_tokens", "Tokens committed by verify calls (bonus included).", registry=r
        )

    def exposition(self) -> bytes:
        """The text format of ``GET /metrics``."""
        return generate_latest(self.registry)
