"""Every Prometheus metric of the service, in one place, for all of its processes.

The service is several processes: the HTTP front end and its model workers
(``app.serving.worker.process``). Each records its own metrics into a ``Metrics`` of its own, and
``/metrics`` shows them as one view through prometheus_client's multiprocess mode: every process
writes its samples to memory-mapped files in one directory, and ``Metrics.collect`` merges them
(counters and histograms summed over processes, exited ones included, so counts never go back;
gauges as their ``multiprocess_mode`` says). The front end makes a fresh directory for each run
and hands it to its workers, so a restart never counts a previous run's samples, and two services
never share one; it is removed when the front end's process exits.

prometheus_client keys the files by process and binds a metric to its directory when the metric's
first value is created, so a process has one set of metrics: ``process_metrics()``. (Tests that run
several apps in one process share that set and compare counts before and after.)

Names carry their unit (``_seconds``, ``_sentences``, ``_tokens``); counters end in ``_total``.
What belongs to one model (its queue, its batches in the workers, tokens and sentences, its loads
and evictions) carries a ``model`` label, the model directory's name
(``app.models.served.model_names``); the HTTP metrics do not (a pivot request goes through two
models), nor do the workers' restarts (every worker serves every model). Code that records for
one model (a model's lane in a worker, its queue in the scheduler) uses
``Metrics.of_model(name)``: the same metrics with that label filled in.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client import values as _values

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Confidence in [0, 1] (``model.decoding.confidence``): tenths, finer at the top where most
# sentences are, so that a shift of the bulk shows.
CONFIDENCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MODEL = "model"  # the label of everything recorded for one model
KEY = "key"  # the label of what is recorded for one API key: its name


class OutcomeCounter(Protocol):
    """What ``Metrics.sentences`` offers: ``labels(model, outcome)`` on the family, and
    ``labels(outcome)`` in a model's view (``Metrics.of_model``), which the workers' code uses."""

    def labels(self, *values: Any, **kwargs: Any) -> Counter: ...


class _ModelBound:
    """A metric family with its ``model`` label (the first) filled in: ``labels`` takes the rest."""

    def __init__(self, family: OutcomeCounter, model: str) -> None:
        self.family, self.model = family, model

    def labels(self, *values: Any, **kwargs: Any) -> Counter:
        if kwargs:
            return self.family.labels(**{MODEL: self.model, **kwargs})
        return self.family.labels(self.model, *values)


class Metrics:
    """The metric objects of one process (``process_metrics``), writing into ``directory``.

    Which process records what: the front end the HTTP metrics, admission and the model's
    description; the workers the scheduling and decoding ones.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        # prometheus_client chooses multiprocess values when it is imported, if the variable is set
        # then, and a value opens its file in the directory the variable names when it is created.
        # Both are set here, before our first metric, whatever was imported earlier.
        os.environ[MULTIPROC_ENV] = str(self.directory)
        # The process id is read once: by default every sample update asks the kernel (a fork
        # check), ~9 system calls per request here; our processes are spawned, never forked.
        pid = os.getpid()
        _values.ValueClass = _values.MultiProcessValue(process_identifier=lambda: pid)
        # registry=None: in multiprocess mode samples are read from the files, not from a registry.
        self.requests = Counter(
            "nmt_requests_total",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=None,
        )
        self.request_latency = Histogram(
            "nmt_request_duration_seconds",
            "HTTP request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.retried = Counter(
            "nmt_retried_sentences_total",
            "Sentences sent again to a live worker because theirs exited",
            [MODEL],
            registry=None,
        )
        # Not per model: every worker serves every model.
        self.worker_restarts = Counter(
            "nmt_worker_restarts_total",
            "Model worker processes started again after they exited",
            registry=None,
        )
        self.queue_wait = Histogram(
            "nmt_queue_wait_seconds",
            "Time a sentence waits in its worker's queue before it joins the running batch",
            [MODEL],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.batch_size = Histogram(
            "nmt_batch_size_sequences",
            "Sequences (rows, beams included) in the running batch at each decoding step",
            [MODEL],
            buckets=BATCH_BUCKETS,
            registry=None,
        )
        self.decode_steps = Counter(
            "nmt_decode_steps_total", "Decoding steps run by the workers", [MODEL], registry=None
        )
        self.input_tokens = Counter("nmt_input_tokens_total", "Source tokens encoded", [MODEL], registry=None)
        self.generated_tokens = Counter(
            "nmt_generated_tokens_total",
            "Target tokens generated (best hypothesis, eos included)",
            [MODEL],
            registry=None,
        )
        # (model first: ``of_model`` fills it in and leaves ``labels(outcome)`` to the caller)
        self.sentences: OutcomeCounter = Counter(
            "nmt_sentences_total",
            "Sentences finished by the workers, by outcome",
            [MODEL, "outcome"],
            registry=None,
        )
        self.queue_depth = Gauge(
            "nmt_queue_depth_sentences",
            "Sentences waiting in the workers' queues",
            [MODEL],
            multiprocess_mode="livesum",
            registry=None,
        )
        self.active_sequences = Gauge(
            "nmt_active_sequences",
            "Sentences being decoded in the workers' running batches",
            [MODEL],
            multiprocess_mode="livesum",
            registry=None,
        )
        self.model_load = Gauge(
            "nmt_model_load_seconds",
            "Time a worker last took to load the model (weights, compiled or loaded step, warm-up)",
            [MODEL],
            multiprocess_mode="livemax",
            registry=None,
        )
        self.model_loads = Counter(
            "nmt_model_loads_total",
            "Times a worker loaded the model (at start, or on demand after it was evicted)",
            [MODEL],
            registry=None,
        )
        # Recorded by the front end (it calibrates): every sentence whose hypotheses carry token
        # log-probs (beam search, or a request that asked for confidence).
        self.confidence = Histogram(
            "nmt_sentence_confidence",
            "Confidence of each translated sentence's best translation: the model's calibrated "
            "estimate that its chrF against a reference is at least 50",
            [MODEL],
            buckets=CONFIDENCE_BUCKETS,
            registry=None,
        )
        self.model_load_wait = Histogram(
            "nmt_model_load_wait_seconds",
            "Time sentences waited for the model to load in a worker (it was not held when they came)",
            [MODEL],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.model_evictions = Counter(
            "nmt_model_evictions_total",
            "Times a worker evicted the model to keep its models within NMT_WORKER_MODEL_MEMORY_MB",
            [MODEL],
            registry=None,
        )
        # A gauge of value 1 labelled with the description: what an Info metric is on the wire (Info
        # metrics do not work in multiprocess mode).
        self.model_info = Gauge(
            "nmt_model_info",
            "The loaded model and the service version",
            [MODEL, "source", "target", "device", "dtype", "quantization", "version"],
            multiprocess_mode="livemax",
            registry=None,
        )
        # Per API key (app/keys/limits.py), labelled with the key's configured name, never the key:
        # as many label values as keys configured. Unknown keys are 403s in nmt_requests_total.
        self.key_requests = Counter(
            "nmt_key_requests_total",
            "Requests admitted under each API key's limits (a request with a list q counts once)",
            [KEY],
            registry=None,
        )
        self.key_characters = Counter(
            "nmt_key_characters_total",
            "Characters of the texts admitted under each API key (a file's, once it is read)",
            [KEY],
            registry=None,
        )
        self.key_limited = Counter(
            "nmt_key_limited_requests_total",
            "Requests refused by a limit of their API key (429, or 400/413 when one request is over it)",
            [KEY, "limit"],
            registry=None,
        )
        self.key_in_flight = Gauge(
            "nmt_key_requests_in_flight",
            "Requests of each API key being answered",
            [KEY],
            multiprocess_mode="livesum",
            registry=None,
        )

        # The front end's cache of recent sentence translations (app/terminology/cache.py).
        self.segment_cache_hits = Counter(
            "nmt_segment_cache_hits_total",
            "Sentences answered from the segment cache of recent translations, without decoding",
            registry=None,
        )
        self.segment_cache_misses = Counter(
            "nmt_segment_cache_misses_total",
            "Sentences looked up in the segment cache and not found there",
            registry=None,
        )
        self.segment_cache_bytes = Gauge(
            "nmt_segment_cache_bytes",
            "Bytes held by the segment caches of the front end's processes (as accounted, approximate)",
            multiprocess_mode="livesum",
            registry=None,
        )

        # The front end's event loop (app/monitoring/loop.py): recorded by the front end only.
        self.loop_lag = Histogram(
            "nmt_event_loop_lag_seconds",
            "Event loop lag of the front end, sampled every 50 ms: how long a callback waits to run",
            buckets=LOOP_LAG_BUCKETS,
            registry=None,
        )
        # livemax: the front end is the one live process that sets it (the workers' stays 0).
        self.loop_lag_max = Gauge(
            "nmt_event_loop_lag_max_seconds",
            "The largest lag of the front end's event loop in the last 30 to 60 seconds",
            multiprocess_mode="livemax",
            registry=None,
        )

    # The metrics recorded for one model: every one labelled ``model`` but the description.
    PER_MODEL = (
        "retried",
        "queue_wait",
        "batch_size",
        "decode_steps",
        "input_tokens",
        "generated_tokens",
        "queue_depth",
        "active_sequences",
        "model_load",
        "model_loads",
        "model_load_wait",
        "model_evictions",
        "confidence",
    )

    def of_model(self, name: str) -> Metrics:
        """These metrics with the ``model`` label set to ``name``: ``batch_size.observe(n)``,
        ``sentences.labels("translated").inc()``, ... record for that model (a view: the same
        files, nothing new to collect)."""
        view = copy.copy(self)
        for attribute in self.PER_MODEL:
            setattr(view, attribute, getattr(self, attribute).labels(name))
        view.sentences = _ModelBound(self.sentences, name)
        return view

    def registry(self) -> CollectorRegistry:
        """Every process's samples, merged (read afresh from the files)."""
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=str(self.directory))
        return merged

    def collect(self) -> bytes:
        """The Prometheus text exposition of every process's metrics."""
        return generate_latest(self.registry())

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One merged sample's value; 0 when absent."""
        return float(self.registry().get_sample_value(name, labels or {}) or 0.0)

    def process_exited(self, pid: int) -> None:
        """Drop the live gauges of a process that is gone (its counters stay: counts never go back)."""
        multiprocess.mark_process_dead(pid, str(self.directory))


_metrics: Metrics | None = None


def process_metrics(directory: str | Path | None = None) -> Metrics:
    """This process's metrics, made on the first call: in ``directory`` (a worker is given its
    front end's), or else in a new directory removed when this process exits (the front end)."""
    global _metrics
    if _metrics is None:
        if directory is None:
            directory = tempfile.mkdtemp(prefix="nmt-metrics-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _metrics = Metrics(directory)
    elif directory is not None and Path(directory) != _metrics.directory:
        raise RuntimeError(f"this process already records its metrics in {_metrics.directory}")
    return _metrics
