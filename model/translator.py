"""Batch-first translation: text -> tokens -> padded batch -> encoder -> cached decoder -> search -> text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.allocator import keep_freed_memory
from model.checkpoint import ModelInfo, load_model, read_info_and_tokenizer, source_prefix
from model.layers import aligned
from model.prepack import prepack as prepack_linears
from model.search import Hypothesis, beam_search, greedy_search, max_lengths
from model.tokenizer import EOS_ID, PAD_ID, Tokenizer
from model.transformer import Transformer, strip_dropout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "int8", "auto")


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


class Translator:
    """A loaded model directory. ``translate_batch`` returns one result per input, in input order."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        info: ModelInfo,
        device: torch.device,
        quantization: str = "none",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.device = device
        self.quantization = quantization  # what the linear layers run in: none or int8

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str | torch.dtype = "float32",
        prepack: bool = True,
        quantization: str = "none",
    ) -> Translator:
        """Load config.json, model.safetensors and sentencepiece.model from ``model_dir``.

        ``prepack``: on CPU in float32, pre-pack the linear layers' weights for oneDNN
        (``model.prepack``; faster decoding, same results up to float rounding).
        ``quantization``: ``"int8"`` runs the linear layers in int8 instead (CPU and
        float32 only; faster, BLEU within 0.2 on Multi30k: BENCHMARKS.md); ``"auto"`` is
        int8 where that applies and this torch build supports it, else none.
        Raises ``ModelDirError`` naming the file when one is missing or corrupted, ``ValueError``
        for a device, dtype or quantization that cannot be used.
        """
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
        dev = resolve_device(device)
        cpu_float32 = dev.type == "cpu" and resolve_dtype(dtype) == torch.float32
        if quantization == "int8" and not cpu_float32:
            raise ValueError("int8 quantization runs on CPU with dtype float32 only")
        info, tokenizer = read_info_and_tokenizer(model_dir)
        model = strip_dropout(load_model(model_dir, info, device=dev, dtype=resolve_dtype(dtype)))
        if dev.type == "cpu":
            keep_freed_memory()  # CPU decoding allocates and frees large caches at every step
        # prepack_linears checks that this build runs int8 at all; "auto" falls back to float32.
        if quantization != "none" and cpu_float32 and prepack_linears(model, int8=True):
            quantization = "int8"
        elif quantization == "int8":
            raise ValueError("int8 quantization is not supported by this torch build")
        else:
            quantization = "none"
            if prepack:
                prepack_linears(model)
        return cls(model, tokenizer, info, dev, quantization)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed.weight.dtype

    @property
    def max_input_tokens(self) -> int:
        return self.model.cfg.max_positions - 1  # room for eos

    def source_ids(self, texts: list[str], *, target: str | None = None) -> list[list[int]]:
        """Token ids of each text followed by eos, truncated to what the model's positions allow;
        for a multilingual model preceded by ``target``'s token (``model.checkpoint.source_prefix``)."""
        prefix = source_prefix(self.info, target)
        limit = self.max_input_tokens - len(prefix)
        return [prefix + ids[:limit] + [EOS_ID] for ids in self.tokenizer.encode(texts)]

    def batch(self, sources: list[list[int]]) -> torch.Tensor:
        """Right-padded (B, S) tensor of source ids, S a multiple of ``KEY_ALIGN``: a sentence's
        encoding must not depend on how long the others in its batch are."""
        src = torch.full((len(sources), aligned(max(map(len, sources)))), PAD_ID, dtype=torch.long)
        for i, ids in enumerate(sources):
            src[i, : len(ids)] = torch.tensor(ids)
        return src.to(self.device)

    @torch.inference_mode()
    def generate(
        self,
        sources: list[list[int]],
        *,
        beam_size: int = 5,
        n_best: int = 1,
        length_penalty: float = 1.0,
        max_length_a: float = 1.5,
        max_length_b: int = 10,
        max_length: int = 256,
    ) -> list[list[Hypothesis]]:
        """Search for one padded batch of source ids (each ending in eos)."""
        if not 1 <= n_best <= beam_size:
            raise ValueError(f"n_best must be between 1 and beam_size ({beam_size}), got {n_best}")
        src = self.batch(sources)
        enc = self.model.encode(src)
        cap = min(max_length, self.model.cfg.max_positions)
        limits = max_lengths((src != PAD_ID).sum(1), max_length_a, max_length_b, cap)
        if beam_size == 1:
            return greedy_search(self.model, enc, limits, length_penalty=length_penalty)
        return beam_search(
            self.model, enc, limits, beam_size=beam_size, length_penalty=length_penalty, n_best=n_best
        )

    def translate_batch(
        self,
        texts: list[str],
        *,
        target: str | None = None,
        beam_size: int = 5,
        n_best: int = 1,
        length_penalty: float = 1.0,
        max_length_a: float = 1.5,
        max_length_b: int = 10,
        max_length: int = 256,
        max_batch_size: int = 64,
    ) -> list[TranslationResult]:
        """Translate ``texts``; results come back in input order.

        Args:
            target: the language to translate into; needed by a multilingual model (one of
                ``info.directions``' targets), optional for a bilingual one (its target_lang).
            beam_size: 1 is greedy search.
            n_best: hypotheses returned per input (at most ``beam_size``).
            length_penalty: scores are log-prob / length**length_penalty (0 = no normalisation).
            max_length_a, max_length_b: each output has at most a * source_tokens + b tokens...
            max_length: ...and never more than this.
            max_batch_size: inputs per model batch; inputs are sorted by length so that a batch
                holds similar lengths and little padding.
        """
        if beam_size < 1 or max_batch_size < 1:
            raise ValueError("beam_size and max_batch_size must be >= 1")
        source_prefix(self.info, target)  # ValueError for a target it cannot give, even for blank input
        results: list[TranslationResult | None] = [None] * len(texts)
        todo = [i for i, t in enumerate(texts) if t.strip()]
        for i in set(range(len(texts))) - set(todo):  # blank input: blank output, no model work
            results[i] = TranslationResult([""] * n_best, [0.0] * n_best, [[]] * n_best)
        sources = self.source_ids([texts[i] for i in todo], target=target)
        order = sorted(range(len(todo)), key=lambda j: len(sources[j]), reverse=True)
        for start in range(0, len(order), max_batch_size):
            chunk = order[start : start + max_batch_size]
            hyps = self.generate(
                [sources[j] for j in chunk],
                beam_size=beam_size,
                n_best=n_best,
                length_penalty=length_penalty,
                max_length_a=max_length_a,
                max_length_b=max_length_b,
                max_length=max_length,
            )
            for j, nbest in zip(chunk, hyps, strict=True):
                tokens = [h.tokens for h in nbest]
                results[todo[j]] = TranslationResult(
                    hypotheses=self.tokenizer.decode(tokens), scores=[h.score for h in nbest], tokens=tokens
                )
        return [r for r in results if r is not None]
