"""Every Prometheus metric of the service, in one place.

Names carry their unit (``_seconds``, ``_sentences``, ``_tokens``); counters end in ``_total``.
Each ``Metrics`` owns its registry, so several apps (tests) never collide in the global one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nmt_requests_total",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "nmt_request_duration_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "nmt_queue_wait_seconds",
            "Time a sentence waits in the queue before it joins the running batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "nmt_batch_size_sequences",
            "Sequences (rows, beams included) in the running batch at each decoding step",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.decode_steps = Counter("nmt_decode_steps_total", "Decoding steps run by the engine", registry=r)
        self.input_tokens = Counter("nmt_input_tokens_total", "Source tokens encoded", registry=r)
        self.generated_tokens = Counter(
            "nmt_generated_tokens_total",
            "Target tokens generated (best hypothesis, eos included)",
            registry=r,
        )
        self.sentences = Counter(
            "nmt_sentences_total", "Sentences finished by the engine, by outcome", ["outcome"], registry=r
        )
        self.queue_depth = Gauge("nmt_queue_depth_sentences", "Sentences waiting in the queue", registry=r)
        self.active_sequences = Gauge(
            "nmt_active_sequences", "Sentences being decoded in the running batch", registry=r
        )
        self.model_load = Gauge("nmt_model_load_seconds", "Time to load and warm up the model", registry=r)
        self.model_info = Info("nmt_model", "The loaded model and the service version", registry=r)
