"""Batch-first translation: text -> tokens -> batch -> encoder -> cached decoder -> search -> text.

``Translator`` is a loaded model directory with its decoding step (``model.runtime``: eager or
compiled, picked once at load) and its default ``DecodeOptions``; every call decodes through the
same running batch as the service's workers (``model.decoding.batch``), so the library, the CLI and
the service give one answer per input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.checkpoint import ModelInfo, load_model, read_info_and_tokenizer, source_prefix
from model.decoding.batch import decode, pad_batch
from model.decoding.confidence import DEFAULT, Calibration
from model.decoding.constraints import beam_for
from model.decoding.options import MAX_BEAM_SIZE, DecodeOptions, nonblank
from model.decoding.search import Hypothesis
from model.runtime import DEFAULT_CACHE_DIR, int8mm
from model.runtime.allocator import keep_freed_memory, release_freed_memory
from model.runtime.precision import int8_pays
from model.runtime.prepack import prepack as prepack_linears
from model.runtime.runners import EagerRunner, PackagedRunner, Runner, load_runner
from model.tokenizer import Tokenizer
from model.transformer import Transformer, strip_dropout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "int8", "auto")
# Rows (beams) decoded together: the service's default running batch, so that the library and the
# service share a compiled step.
DEFAULT_CAPACITY = 64


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


@dataclass
class TranslationResult:
    hypotheses: list[str]  # n_best translations, best first
    scores: list[float]  # their length-normalised log-probabilities
    tokens: list[list[int]]  # their token ids (no bos/eos)
    # Per hypothesis, where each of the text's terms was realised: (start, end, term index) as
    # character offsets into that hypothesis (end exclusive), the term's index in the text's
    # ``terms`` as given; empty lists when the text had no terms.
    spans: list[list[tuple[int, int, int]]] = field(default_factory=list)
    # Per hypothesis, the model's calibrated estimate that its chrF against a reference is >= 50
    # (``model.decoding.confidence``: the model directory's confidence.json, else the geometric-mean
    # token probability); None for a blank input's.
    confidence: list[float | None] = field(default_factory=list)


class Translator:
    """A loaded model directory. ``translate_batch`` returns one result per input, in input order."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        info: ModelInfo,
        device: torch.device,
        quantization: str = "none",
        *,
        options: DecodeOptions | None = None,
        capacity: int = DEFAULT_CAPACITY,
        max_beam_size: int | None = None,
        compile: bool = False,
        cache_dir: Path | None = None,
        calibration: Calibration = DEFAULT,
        release_gil: bool = True,
        compile_encoder: bool = False,
    ) -> None:
        self.model = model
        self.calibration = calibration  # of ``TranslationResult.confidence``
        self.tokenizer = tokenizer
        self.info = info
        self.device = device
        self.quantization = quantization  # what the linear layers run in: none or int8
        self.options = options or DecodeOptions()
        self.capacity = capacity
        # (MAX_BEAM_SIZE by default, within the capacity: the step's candidates per row are the
        # service's, so that constrained sentences decode as there.)
        default = min(MAX_BEAM_SIZE, capacity)
        self.max_beam_size = max(max_beam_size or default, self.options.beam_size)
        if self.max_beam_size > capacity:
            raise ValueError(f"a beam of {self.max_beam_size} does not fit in {capacity} rows")
        self.compile, self.cache_dir = compile, cache_dir
        # The compiled CPU step called without the GIL (``model.runtime.native``: other threads of
        # the process step meanwhile), at ~25 us more per step than torch's binding, which holds
        # it: for a process whose threads decode side by side.
        self.release_gil = release_gil
        # With a compiled CPU step, the encoder compiled too, in the background (``load_runner``).
        self.compile_encoder = compile_encoder
        self._runner: Runner | None = None

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str | torch.dtype = "float32",
        prepack: bool = True,
        quantization: str = "none",
        options: DecodeOptions | None = None,
        capacity: int = DEFAULT_CAPACITY,
        max_beam_size: int | None = None,
        compile: bool = False,
        cache_dir: Path | None = None,
        release_gil: bool = True,
        compile_encoder: bool = False,
    ) -> Translator:
        """Load config.json, model.safetensors and sentencepiece.model from ``model_dir``.

        ``prepack``: on CPU in float32, pre-pack the linear layers' weights for oneDNN
        (``model.runtime.prepack``; faster decoding, same results up to float rounding).
        ``quantization``: ``"int8"`` runs the linear layers in int8 instead (CPU and float32 only;
        faster, each row quantized on its own); ``"auto"`` is int8 where that applies and int8
        layers were measured faster than float32's on this machine
        (``model.runtime.precision.int8_pays``, kept in ``cache_dir``), else none.
        ``options``: the default decoding (``DecodeOptions``); ``capacity``: rows decoded together;
        ``max_beam_size``: the largest beam a call may ask for (the step keeps 2x that many
        candidates per row; default ``MAX_BEAM_SIZE`` within ``capacity``, as the service);
        ``compile``: compile the decoding step (``model.runtime.runners``; falls back to eager where
        it cannot), kept in ``cache_dir``; ``compile_encoder``: with it, the encoder too, made in
        the background (``model.runtime.encoder``: the eager encoder serves meanwhile, the same bits).
        Raises ``ModelDirError`` naming the file when one is missing or corrupted, ``ValueError``
        for a device, dtype or quantization that cannot be used.
        """
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
        dev = resolve_device(device)
        cpu_float32 = dev.type == "cpu" and resolve_dtype(dtype) == torch.float32
        if quantization == "int8" and not cpu_float32:
            raise ValueError("int8 quantization runs on CPU with dtype float32 only")
        if quantization != "none" and cpu_float32:
            # Our int8 kernel (``model.runtime.int8mm``), built once per cache while the weights
            # are read (oneDNN's kernels where it cannot be).
            int8mm.ensure_beside(cache_dir or DEFAULT_CACHE_DIR)
        info, tokenizer = read_info_and_tokenizer(model_dir)
        model = strip_dropout(load_model(model_dir, info, device=dev, dtype=resolve_dtype(dtype)))
        if dev.type == "cpu":
            keep_freed_memory()  # CPU decoding allocates and frees large buffers at every step
        if quantization != "none" and cpu_float32:
            int8mm.ensure(cache_dir or DEFAULT_CACHE_DIR)  # (waits for the build started above)
        # "auto" falls back to float32 where this build cannot run int8 or int8 is measured slower.
        if quantization == "auto" and not (cpu_float32 and int8_pays(cache_dir)):
            quantization = "none"
        # A loaded model translates, it is never saved: its linear layers keep only the weights
        # they compute with (no float copy beside an int8 or a oneDNN-packed one).
        if quantization != "none" and cpu_float32 and prepack_linears(model, int8=True, keep_float=False):
            quantization = "int8"
        elif quantization == "int8":
            raise ValueError("int8 quantization is not supported by this torch build")
        else:
            quantization = "none"
            if prepack:
                prepack_linears(model, keep_float=False)
        if dev.type == "cpu":
            release_freed_memory()  # the weights as read, and the float copies prepacking replaced
        return cls(
            model,
            tokenizer,
            info,
            dev,
            quantization,
            options=options,
            capacity=capacity,
            max_beam_size=max_beam_size,
            compile=compile,
            cache_dir=cache_dir,
            calibration=Calibration.load(model_dir),
            release_gil=release_gil,
            compile_encoder=compile_encoder,
        )

    def sibling(self) -> Translator:
        """Another Translator on this one's weights, for another thread: the same model, tokenizer
        and options, and a decoding step of its own (this one's step's ``sibling`` where it has
        one: the same package in a container of its own, handed the same tensors, nothing compiled
        or copied; else made on first use), so that two threads never share what a step writes."""
        twin = Translator(
            self.model,
            self.tokenizer,
            self.info,
            self.device,
            self.quantization,
            options=self.options,
            capacity=self.capacity,
            max_beam_size=self.max_beam_size,
            compile=self.compile,
            cache_dir=self.cache_dir,
            calibration=self.calibration,
            release_gil=self.release_gil,
            compile_encoder=self.compile_encoder,
        )
        if isinstance(self._runner, EagerRunner | PackagedRunner):
            twin._runner = self._runner.sibling()
        return twin

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def runner(self) -> Runner:
        """The decoding step, made (compiled, or loaded from the cache) on first use."""
        if self._runner is None:
            self._runner = load_runner(
                self.model,
                top=self.options.candidates(self.max_beam_size),
                capacity=self.capacity,
                positions=self.options.positions(self.model.cfg.max_positions),
                compile=self.compile,
                cache_dir=self.cache_dir,
                release_gil=self.release_gil,
                compile_encoder=self.compile_encoder,
            )
            if self.device.type == "cpu":
                release_freed_memory()  # what compiling or loading the step took and dropped
        return self._runner

    @property
    def max_input_tokens(self) -> int:
        return self.options.input_limit(self.model.cfg.max_positions)

    def source_ids(self, texts: list[str], *, target: str | None = None) -> list[list[int]]:
        """Token ids of each text followed by eos, truncated (``DecodeOptions.max_input_tokens``);
        for a multilingual model preceded by ``target``'s token (``model.checkpoint.source_prefix``)."""
        return self.options.source_ids(self.info, self.tokenizer, texts, target)

    def batch(self, sources: list[list[int]]) -> torch.Tensor:
        """Right-padded (B, S) tensor of source ids (``model.decoding.batch.pad_batch``)."""
        return pad_batch(sources, self.model.cfg.pad_id, self.device)

    def _options(self, options: DecodeOptions | None, changes: dict[str, object]) -> DecodeOptions:
        chosen = (options or self.options).but(**{k: v for k, v in changes.items() if v is not None})
        if chosen.beam_size > self.max_beam_size:
            raise ValueError(f"beam_size {chosen.beam_size} exceeds this translator's {self.max_beam_size}")
        most = self.model.cfg.max_positions
        if chosen.positions(most) > self.options.positions(most):  # the step was made for the cache's size
            raise ValueError("max_input_tokens and max_output_tokens may not exceed the translator's own")
        return chosen

    @torch.inference_mode()
    def generate(
        self,
        sources: list[list[int]],
        options: DecodeOptions | None = None,
        *,
        beam_size: int | None = None,
        n_best: int | None = None,
        constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> list[list[Hypothesis]]:
        """The n-best hypotheses of each source (ids ending in eos), in order; ``constraints``: per
        source, target token sequences every hypothesis of it contains (``Hypothesis.spans`` says
        where), decoded with ``beam_for(beam_size, their number)`` (more than ``max_beam_size``
        allows: its rows then choose among fewer than 2K candidates each, plus the forced ones);
        no constraint is followed by a piece that would continue its last word. A model with an
        output prefix (``ModelInfo.output_prefix``) starts every hypothesis with it (its tokens
        include it; ``Tokenizer.decode`` skips it)."""
        chosen = self._options(options, {"beam_size": beam_size, "n_best": n_best})
        # The cache keeps the translator's positions (the step was made for them), whatever the call's.
        at = self.options.positions(self.model.cfg.max_positions)
        return decode(
            self.model,
            self.runner,
            sources,
            chosen,
            capacity=self.capacity,
            positions=at,
            constraints=constraints,
            word_continuations=self.tokenizer.word_continuations() if constraints else frozenset(),
            prefix=self.info.output_prefix,
        )

    def translate_batch(
        self,
        texts: list[str],
        *,
        target: str | None = None,
        options: DecodeOptions | None = None,
        beam_size: int | None = None,
        n_best: int | None = None,
        length_penalty: float | None = None,
        terms: Sequence[Sequence[str]] | None = None,
    ) -> list[TranslationResult]:
        """Translate ``texts``; results come back in input order.

        Args:
            target: the language to translate into; needed by a multilingual model (one of
                ``info.directions``' targets), optional for a bilingual one (its target_lang).
            options: the decoding (default: the translator's); ``beam_size``, ``n_best`` and
                ``length_penalty`` override its fields.
            terms: per text, target strings that must appear in its translation (lexically
                constrained decoding, ``model.decoding.constraints``): each is tokenized with the
                target tokenizer and rendered exactly as given (``Tokenizer.decode_spans``); blank
                ones are ignored, the others stripped of surrounding whitespace. A text with terms
                decodes with ``beam_for(beam_size, number of terms)``; one without decodes exactly
                as without ``terms``. Every hypothesis returned contains every term, so a text
                with terms may get fewer than ``n_best`` (where the search finished fewer); only
                where none could (the terms do not fit in the output's length limit) are the
                hypotheses that met the most returned instead.
        """
        chosen = self._options(
            options, {"beam_size": beam_size, "n_best": n_best, "length_penalty": length_penalty}
        )
        source_prefix(self.info, target)  # ValueError for a target it cannot give, even for blank input
        n = chosen.n_best
        results: list[TranslationResult | None] = [None] * len(texts)
        todo = nonblank(texts)
        for i in set(range(len(texts))) - set(todo):  # blank input: blank output, no model work
            results[i] = TranslationResult([""] * n, [0.0] * n, [[]] * n, [[] for _ in range(n)], [None] * n)
        if terms is not None and len(terms) != len(texts):
            raise ValueError(f"terms has {len(terms)} entries for {len(texts)} texts")
        # Per text, its distinct non-blank terms, each with its index in the text's terms.
        given = [
            {t.strip(): j for j, t in reversed(list(enumerate(terms[i]))) if t.strip()} if terms else {}
            for i in todo
        ]
        wanted = [sorted(g, key=g.__getitem__) for g in given]
        constraints = self._constraints(wanted) if any(wanted) else None
        if constraints is not None:
            most = max(beam_for(chosen.beam_size, len(c)) for c in constraints)
            if most > self.capacity:
                raise ValueError(f"a beam of {most} (for the terms) does not fit in {self.capacity} rows")
        if todo:
            sources = self.source_ids([texts[i] for i in todo], target=target)
            nbests = self.generate(sources, chosen, constraints=constraints)
            for i, nbest, mine, g in zip(todo, nbests, wanted, given, strict=True):
                tokens = [h.tokens for h in nbest]
                confidence = [self.calibration.of(h) for h in nbest]
                result = TranslationResult([], [h.score for h in nbest], tokens, confidence=confidence)
                if mine:
                    for h in nbest:
                        text, where = self.tokenizer.decode_spans_with_offsets(h.tokens, h.spans, mine)
                        result.hypotheses.append(text)
                        result.spans.append([(a, b, g[mine[c]]) for a, b, c in where])
                else:
                    result.hypotheses = self.tokenizer.decode(tokens)
                    result.spans = [[] for _ in nbest]
                results[i] = result
        return [r for r in results if r is not None]

    def _constraints(self, terms: list[list[str]]) -> list[tuple[tuple[int, ...], ...]]:
        """Each text's terms as target token sequences (``Source.constraints``). A term the
        target tokenizer makes nothing of is left as an empty constraint (met from the start)."""
        flat = [t for ts in terms for t in ts]
        encoded = iter(self.tokenizer.encode(flat, target=True)) if flat else iter([])
        return [tuple(tuple(next(encoded)) for _ in ts) for ts in terms]
