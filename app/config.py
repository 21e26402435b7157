"""Service settings, read from ``NMT_*`` environment variables (pydantic-settings).

Every value is validated when ``Settings()`` is built, so a typo in the environment stops the
service at start with a message naming the variable instead of failing on the first request.
"""

from __future__ import annotations

import re
from dataclasses import replace
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.formats.limits import DocumentLimits
from app.terminology.glossaries import GlossaryLimits
from model.decoding.options import MAX_BEAM_SIZE, DecodeOptions
from model.decoding.terms import MAX_TERMS_PER_SENTENCE
from model.fetch import DEFAULT_ARGOS_INDEX, DEFAULT_STORE, FetchError, parse_name
from model.runtime import DEFAULT_CACHE_DIR

ENV_PREFIX = "NMT_"
JOB_PACKAGE_FACTOR = 4  # a job's package may inflate to, and hold, this many times a file's

_DECODE = DecodeOptions()  # the defaults
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


def service_version() -> str:
    """The installed package's version (one source of truth: pyproject.toml)."""
    try:
        return _dist_version("nmt-service")
    except PackageNotFoundError:  # running from a source tree that was never pip-installed
        return "0+unknown"


class Settings(BaseSettings):
    """All knobs of the service; each field ``x`` is read from the environment variable ``NMT_X``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # The model directories to serve: comma-separated paths, each a model directory or a directory
    # of model directories (every subdirectory with a config.json, by name; app.models.served). By default
    # every model shipped in artifacts/: both directions where both are shipped. Each model is one
    # worker's own (app/serving/frontend/placement.py: the machine holds it once, more only for a
    # hot model), not workers of its own (NMT_WORKER_MODEL_MEMORY_MB bounds what a worker holds).
    model_dir: Annotated[tuple[Path, ...], NoDecode] = (Path("artifacts"),)
    # Models by name, comma-separated (model/fetch/): opus-mt:SRC-TGT (Helsinki-NLP/opus-mt-SRC-TGT),
    # hf:OWNER/REPO[@REVISION] (any MarianMTModel repository), argos:SRC-TGT (the Argos package
    # index's). Fetched at start into model_store (downloaded and converted once; every later start
    # finds them there and checks their sha256s, offline too) and served with model_dir's models.
    models: Annotated[tuple[str, ...], NoDecode] = ()
    model_store: Path = DEFAULT_STORE
    argos_index: str = DEFAULT_ARGOS_INDEX  # where argos: names are looked up (argostranslate's default)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # int8: the linear layers run in int8 (CPU with float32 only; faster, BLEU as float32's on
    # Multi30k, each row quantized on its own so that answers never depend on the batch:
    # python -m benchmarks.determinism); auto: int8 on CPU with float32 where int8 layers are
    # measured faster than float32's on this machine (model.runtime.precision.int8_pays, the
    # verdict kept in NMT_COMPILE_CACHE_DIR so that every worker serves the same), none elsewhere.
    quantization: Literal["auto", "none", "int8"] = "auto"

    # Engine (batching) limits.
    max_batch_size: PositiveInt = 64  # rows in the running batch (each beam counts: sentences x beam)
    max_batch_tokens: PositiveInt = 8192  # padded source length x rows in a step (its cross-attention)
    # Sentences waiting for a worker (beyond those decoding); a request that does not fit gets 503,
    # one with more sentences than this 413.
    max_queue: PositiveInt = 1024
    request_timeout_s: Annotated[float, Field(gt=0)] = 30.0

    # Request limits.
    max_chars: PositiveInt = 5000  # summed over all texts of one request
    max_texts: PositiveInt = 128  # items in a q list
    max_body_bytes: PositiveInt = 1024 * 1024
    # Files (POST /translate_file): the upload's size, the text in it to translate, and how long a
    # translated file waits to be downloaded (it is deleted once downloaded, and kept in memory only).
    max_file_bytes: PositiveInt = 2 * 1024 * 1024
    max_file_chars: PositiveInt = 100_000
    file_ttl_s: Annotated[float, Field(gt=0)] = 600.0
    # What a file may hold, checked while it is read, before anything is built from it (a file over
    # one gets 413; app/formats/limits.py): sentences; for a .docx (a zip package) its files, what
    # they inflate to (all of them, and each: at most NMT_MAX_FILE_RATIO times its compressed size
    # beyond 1 MiB) and its XML elements; an HTML file's tags and nesting depth.
    max_file_sentences: PositiveInt = 10_000
    max_file_entries: PositiveInt = 1_000
    max_file_unpacked_bytes: PositiveInt = 32 * 1024 * 1024
    max_file_entry_bytes: PositiveInt = 16 * 1024 * 1024
    max_file_ratio: PositiveInt = 100
    max_file_elements: PositiveInt = 200_000
    max_file_depth: PositiveInt = 512
    # Each file is read (and written back) in a child process of its own (app/formats/sandbox.py):
    # this many at a time, each within this many seconds of CPU time (a reader that uses no CPU for
    # as many seconds of wall-clock time is killed: it waits instead of reading), allocating at most
    # this many MiB beyond what it starts with; a file that needs more gets 413, and never costs the
    # front end memory. The costliest files within the limits above took 110-145 MB and 3-5 s of
    # CPU to read and write (2.6 s each way for a 180,000-element .docx on a 2-core Intel Xeon).
    file_readers: PositiveInt = 2
    file_read_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    file_reader_memory_mb: PositiveInt = 256
    # File requests in progress at a time (each holds its upload in memory until it is translated);
    # more get 503 with Retry-After.
    max_file_requests: PositiveInt = 16
    # Requests open at once from one client address (its connections with a request in progress:
    # one waiting for its body counts), 0 for no bound; past it a request is answered 429 and its
    # connection closed, five seconds later (app/http/slow_clients.py). The address is the one a trusted
    # proxy forwarded (uvicorn's FORWARDED_ALLOW_IPS), else the peer's: behind an untrusted proxy
    # every client shares the proxy's. Health probes are never counted.
    max_connections_per_client: NonNegativeInt = 512
    # Document jobs (POST /jobs: app/jobs): uploads translated in the background, their state and
    # files in NMT_DATA_DIR/jobs (kept across restarts; a job in progress when the service stopped
    # goes on from its last finished chunk). A job's file may be larger and hold more text than a
    # /translate_file upload, and its reader gets more time and memory; the result is kept for
    # job_ttl_s after it finishes. At most max_running_jobs are read and translated at a time
    # (sharing the workers fairly with interactive requests: each is one more turn of the
    # round-robin), the oldest first among the keys with the fewest running; a key holds at most
    # max_jobs_per_key jobs (any state: delete finished ones, or they expire), all keys max_jobs.
    job_max_bytes: PositiveInt = 32 * 1024 * 1024
    job_max_chars: PositiveInt = 2_000_000
    job_max_sentences: PositiveInt = 100_000
    job_read_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    job_reader_memory_mb: PositiveInt = 1024
    job_ttl_s: Annotated[float, Field(gt=0)] = 24 * 3600.0
    max_running_jobs: PositiveInt = 2
    # A job's runner holds it this long unless renewed (every third of it): a runner that died
    # (its replica killed) gives its jobs to another this long after its last renewal.
    job_lease_s: Annotated[float, Field(ge=3)] = 30.0
    max_jobs_per_key: PositiveInt = 20
    max_jobs: PositiveInt = 200
    # The page at / (and LibreTranslate's /frontend/settings): quiet typing before it translates.
    frontend_timeout_ms: PositiveInt = 500
    # Comma-separated in the environment ("k1,k2"); empty means no authentication (unless a keys file).
    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    # More keys, each with a name and limits of its own: a TOML file (app/keys/accepted.py,
    # docs/keys.md "API keys and limits"), read at start.
    api_keys_file: Path | None = None
    # Each key's limits where the keys file sets none (0: no limit): requests as LibreTranslate's
    # req_limit counts them (a list q is one per text) and characters, in any minute and any 24 hours;
    # requests of one key in flight at once; characters of one text (LibreTranslate's char_limit).
    key_requests_per_minute: NonNegativeInt = 0
    key_requests_per_day: NonNegativeInt = 0
    key_chars_per_minute: NonNegativeInt = 0
    key_chars_per_day: NonNegativeInt = 0
    key_max_concurrent: NonNegativeInt = 0
    key_char_limit: NonNegativeInt = 0
    # Per-key metrics (nmt_key_*, labelled with each key's name) on /metrics, which needs no key:
    # off by default, so that strangers cannot read the keys' names and usage there.
    key_metrics: bool = False
    # The keys' windows and requests in flight in this Redis (redis://[:password@]host:port/db,
    # rediss:// for TLS, unix://), shared by every replica of the service, so that a key's limits
    # hold across them (app/keys/usage_redis.py). Unset: counted in NMT_DATA_DIR (usage.sqlite3), shared
    # only by the processes that use the same directory.
    redis_url: str | None = None
    # The jobs (with their files), stored glossaries and translation memories in this PostgreSQL
    # (postgresql://user:password@host:port/database), shared by every replica of the service, so
    # that whichever replica answers finds them (app/stores/database/). Unset: SQLite files and job
    # directories in NMT_DATA_DIR, shared only by the processes that use the same directory.
    database_url: str | None = None
    # Where the keys' usage is counted (usage.sqlite3) without NMT_REDIS_URL: shared by the front
    # end's processes that use the same directory, and kept across restarts. Touched only when a key
    # has a counted limit.
    data_dir: Path = Path.home() / ".local" / "share" / "nmt-service"
    # What document jobs may keep in NMT_DATA_DIR/jobs (uploads, progress, results), in MiB, all
    # keys together; a job that would pass it is refused (507, Retry-After) until others expire or
    # are deleted. New jobs are refused too while the disk under NMT_DATA_DIR has less free space
    # than data_reserve_mb, so that the stores beside them (usage, glossaries, memory) keep working.
    data_quota_mb: PositiveInt = 8 * 1024
    data_reserve_mb: NonNegativeInt = 256
    # Without API keys: whether the stores that would be shared by every client of the service are
    # on: stored glossaries (/glossaries), the translation memory (/memories) and the list of jobs
    # (GET /jobs). Off by default: a stranger's glossary or memory would change what everyone else
    # is answered, and a list of jobs would show everyone's documents. A job stays reachable by its
    # unguessable id either way. With keys, each key has its own stores and this is ignored.
    shared_stores: bool = False
    # Glossaries (/glossaries) and translation memories (/memories), each API key's own (the
    # service's, without keys), kept in NMT_DATA_DIR (glossaries.sqlite3, memory.sqlite3, made when
    # the first one is stored) across restarts. Past a limit a request gets 413 (409 for one
    # glossary too many). A glossary's entries are matched in every sentence of a request that
    # names it; an uploaded CSV or TSV table is at most glossary_max_bytes.
    max_glossaries: PositiveInt = 100  # per API key
    glossary_max_entries: PositiveInt = 10_000
    glossary_max_bytes: PositiveInt = 1024 * 1024
    glossary_max_term_chars: PositiveInt = 256
    memory_max_segments: PositiveInt = 100_000  # per API key, all language pairs together
    memory_max_bytes: PositiveInt = 16 * 1024 * 1024  # an uploaded TMX or TSV file
    # Recent sentence translations kept in each front-end process's memory, in MiB (least recently
    # used evicted first): a sentence seen again (a header, boilerplate) costs no decoding. 0: off.
    segment_cache_mb: NonNegativeInt = 64

    # Decoding (model.decoding.options.DecodeOptions, which documents each; the CLI's defaults are
    # the same). A request's beam size and alternatives are its own, within these limits.
    default_beam_size: PositiveInt = 5
    max_beam_size: PositiveInt = MAX_BEAM_SIZE  # the CLI's --max-beam-size, the library's default
    max_alternatives: Annotated[int, Field(ge=0)] = 3
    # A sentence whose confidence (model.decoding.confidence: the model's calibrated P(chrF >= 50))
    # is below this is flagged in /translate's answer, or withheld where the request says so; a
    # request's own min_confidence replaces it. None: no threshold unless a request sets one.
    min_confidence: Annotated[float, Field(ge=0, le=1)] | None = None
    # Terminology (app.terminology): entries of a request's inline glossary, characters of a term
    # (source or target), and terms decoded as constraints in one sentence (each one more raises
    # that sentence's beam: ``model.decoding.constraints.beam_for``).
    max_glossary_entries: PositiveInt = 1000
    max_term_chars: PositiveInt = 200
    max_terms_per_sentence: PositiveInt = MAX_TERMS_PER_SENTENCE
    length_penalty: Annotated[float, Field(ge=0)] = _DECODE.length_penalty
    max_input_tokens: PositiveInt = _DECODE.max_input_tokens  # longer sentences are truncated
    max_length_a: Annotated[float, Field(ge=0)] = _DECODE.max_length_a
    max_length_b: NonNegativeInt = _DECODE.max_length_b
    max_output_tokens: PositiveInt = _DECODE.max_output_tokens
    no_repeat_ngram_size: NonNegativeInt = _DECODE.no_repeat_ngram_size  # 0: off

    # Model worker processes, each serving every model (a running batch per model it is
    # translating, one model thread); the server process keeps HTTP, the queues and metrics
    # (app/serving). 0: one per usable core on CPU (one thread each: the most sentences/s, and no
    # thread waits for another that the HTTP side preempted), one on a GPU. Not per model: 20 models
    # on 2 cores are 2 workers.
    replicas: Annotated[int, Field(ge=0)] = 0
    # The processes the workers run in: 1 (the default) = every worker a thread of one process, which
    # opens each model's weights once for all of them and runs the compiled step without the GIL
    # (app/serving/worker/shared.py, model/runtime/native.py): at OPUS-MT's size on 2 cores, 898
    # MB idle against 1,553 MB for a process per worker, at the same speed; N = the workers dealt
    # out over N processes; 0 = a process per worker (the threads' Python between steps takes
    # turns: 3-6% fewer sentences/s on the shipped 7.6M model). BENCHMARKS.md, "One process".
    worker_processes: NonNegativeInt = 1
    # torch intra-op threads per worker; 0 = the usable cores shared out among the workers.
    threads: Annotated[int, Field(ge=0)] = 0
    # What the models' weights held by one worker may take, in MiB (measured as loaded: int8 and
    # packed copies included). Each worker loads the first of its own models before it is ready
    # and, in the background, its other own models: all of them with 0 (no limit), those that fit
    # otherwise. Any other model loads when a sentence first needs it (that sentence waits for the
    # load; the worker's other models go on), the least recently used idle model evicted to make
    # room (app/serving/worker/models.py).
    worker_model_memory_mb: NonNegativeInt = 0
    # true: a worker that is the only one with work (every other idle for 50 ms) runs on the
    # threads of all the workers (replicas x threads), so that a lone request is not held to one
    # core while the others sleep (app/serving/cores.py; same translations on any thread count).
    # Off by default: it counts only this service's workers as the cores' users, and a core that
    # another process keeps busy stalls every parallel region of the step (a lone beam-5 request
    # took 1.3-1.6 s instead of 25-27 ms beside one busy process: BENCHMARKS.md, "A lone request on
    # every core"). For a machine given to the service alone.
    idle_cores: bool = False
    warmup: bool = True
    # Each decoding step as one compiled graph (model.runtime.runners): on CPU exported and compiled
    # ahead of time by AOTInductor when a worker starts, before /health/ready (~1-2 min the first
    # time on 2 cores), loaded from the cache in a second afterwards; on CUDA captured and replayed
    # as CUDA graphs. Where compiling fails, and with false, the eager step (/info says which). On
    # float32 the compiled step's translations are the eager ones for all 1,000 test_2016 sentences.
    compile: bool = True
    # With the compiled CPU step, the encoder compiled too (model.runtime.encoder): about twice as
    # fast as eager, the same bits; made in the background the first time (~20 s of a core, at a
    # lower priority, beside the step's compiling), the eager encoder serving until then; loaded
    # with the step afterwards.
    compile_encoder: bool = True
    # Where compiled steps are kept between starts (one .pt2 file per architecture and settings, shared
    # by models of the same shape; TorchInductor builds in its inductor/ folder): a volume in Docker
    # keeps them across containers.
    compile_cache_dir: Path = DEFAULT_CACHE_DIR

    def decode_options(self) -> DecodeOptions:
        """How workers decode (a request's beam size and n-best replace the first two)."""
        return DecodeOptions(
            beam_size=self.default_beam_size,
            length_penalty=self.length_penalty,
            max_input_tokens=self.max_input_tokens,
            max_length_a=self.max_length_a,
            max_length_b=self.max_length_b,
            max_output_tokens=self.max_output_tokens,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
        )

    def glossary_limits(self) -> GlossaryLimits:
        return GlossaryLimits(
            max_bytes=self.glossary_max_bytes,
            max_entries=self.glossary_max_entries,
            max_term_chars=self.glossary_max_term_chars,
        )

    def job_limits(self) -> DocumentLimits:
        """A job's document: ``document_limits`` with the job's own text, time and memory."""
        return replace(
            self.document_limits(),
            max_chars=self.job_max_chars,
            max_sentences=self.job_max_sentences,
            read_seconds=self.job_read_timeout_s,
            memory_bytes=self.job_reader_memory_mb * 1024 * 1024,
            # a job's file may be 16x a /translate_file upload: its package and XML a few times more
            max_unpacked_bytes=JOB_PACKAGE_FACTOR * self.max_file_unpacked_bytes,
            max_elements=JOB_PACKAGE_FACTOR * self.max_file_elements,
        )

    def document_limits(self) -> DocumentLimits:
        return DocumentLimits(
            max_chars=self.max_file_chars,
            max_sentences=self.max_file_sentences,
            max_entries=self.max_file_entries,
            max_unpacked_bytes=self.max_file_unpacked_bytes,
            max_entry_bytes=self.max_file_entry_bytes,
            max_ratio=self.max_file_ratio,
            max_elements=self.max_file_elements,
            max_depth=self.max_file_depth,
            read_seconds=self.file_read_timeout_s,
            memory_bytes=self.file_reader_memory_mb * 1024 * 1024,
        )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("model_dir", mode="before")
    @classmethod
    def _split_model_dirs(cls, value: Any) -> Any:
        if isinstance(value, str | Path):
            value = str(value).split(",")
        if isinstance(value, list | tuple):
            return tuple(Path(str(p).strip()) for p in value if str(p).strip())
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            return tuple(str(n).strip() for n in value if str(n).strip())
        return value

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            try:
                parse_name(name)
            except FetchError as e:
                raise ValueError(str(e)) from None
        return value

    @model_validator(mode="after")
    def _check_model_dirs(self) -> Settings:
        # NMT_MODEL_DIR may be empty when NMT_MODELS names the models.
        if not self.model_dir and not self.models:
            raise ValueError("no model directory given (NMT_MODEL_DIR), and no model named (NMT_MODELS)")
        return self

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_api_keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple | set | frozenset):
            return tuple(k.strip() for k in value if isinstance(k, str) and k.strip())
        return value

    @property
    def keys_required(self) -> bool:
        """Whether requests need an ``api_key`` (some key is configured)."""
        return bool(self.api_keys) or self.api_keys_file is not None

    @model_validator(mode="after")
    def _check_key_limits(self) -> Settings:
        # Limits with no key to carry them would silently limit nothing. (key_metrics is no limit:
        # with no key it shows nothing, harmlessly.)
        given = [
            name
            for name in type(self).model_fields
            if name.startswith("key_") and name != "key_metrics" and getattr(self, name)
        ]
        if given and not self.keys_required:
            names = ", ".join(f"{ENV_PREFIX}{name.upper()}" for name in given)
            raise ValueError(
                f"{names} limit API keys, but none is configured (NMT_API_KEYS or NMT_API_KEYS_FILE)"
            )
        return self

    @model_validator(mode="after")
    def _check_quantization(self) -> Settings:
        if self.quantization == "int8" and (self.dtype != "float32" or self.device.startswith("cuda")):
            raise ValueError("NMT_QUANTIZATION=int8 runs on CPU with NMT_DTYPE=float32 only")
        return self

    @model_validator(mode="after")
    def _check_beams(self) -> Settings:
        # Every request must be servable: alternatives need n_best = alternatives + 1 <= beam size.
        if self.default_beam_size > self.max_beam_size:
            raise ValueError(
                f"NMT_DEFAULT_BEAM_SIZE ({self.default_beam_size}) exceeds NMT_MAX_BEAM_SIZE "
                f"({self.max_beam_size})"
            )
        if self.max_alternatives + 1 > self.max_beam_size:
            raise ValueError(
                f"NMT_MAX_ALTERNATIVES + 1 ({self.max_alternatives + 1}) exceeds NMT_MAX_BEAM_SIZE "
                f"({self.max_beam_size})"
            )
        return self


def describe_settings_error(error: ValidationError) -> str:
    """One line naming each bad environment variable, e.g. ``NMT_MAX_QUEUE: Input should be > 0``."""
    parts = []
    for err in error.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        name = f"{ENV_PREFIX}{loc.upper()}" if loc else "settings"
        got = err.get("input")
        # Echo short scalar inputs to make typos obvious, but never the API keys.
        shown = f" (got {got!r})" if loc and loc != "api_keys" and isinstance(got, str | int | float) else ""
        parts.append(f"{name}: {err['msg']}{shown}")
    return "invalid configuration: " + "; ".join(parts)


def stores_on(settings: Settings, owner: str) -> bool:
    """Whether ``owner`` (``key_owner``'s) may use stored glossaries, memories and the list of jobs:
    a key's own always; without keys ("") only where the operator shares them
    (``NMT_SHARED_STORES``): one store for every stranger would let each change what the others
    are answered, and see their documents."""
    return bool(owner) or settings.shared_stores
