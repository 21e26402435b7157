"""What the front end knows of the model it serves: its metadata and vocabulary (read from the
model directory; the weights stay in the workers) and what the workers run it on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.serving.scheduler import Hypotheses
from app.serving.worker import ModelDescription
from model.checkpoint import ModelInfo, read_info_and_tokenizer
from model.tokenizer import EOS_ID, Tokenizer

MAX_INPUT_TOKENS = 250  # longer sentences are truncated (and the model's positions are finite)


@dataclass(frozen=True)
class ServedModel:
    name: str  # the model directory's name (its full path says nothing useful to clients)
    info: ModelInfo
    tokenizer: Tokenizer
    description: ModelDescription  # device, dtype, quantization, as the workers report them

    @classmethod
    def open(cls, model_dir: Path) -> tuple[ModelInfo, Tokenizer]:
        """The directory's metadata and vocabulary; ``ModelDirError`` naming a missing or broken file."""
        return read_info_and_tokenizer(model_dir)

    @property
    def max_input_tokens(self) -> int:
        return min(MAX_INPUT_TOKENS, self.info.config.max_positions - 1)  # room for eos

    def source_ids(self, sentences: list[str]) -> list[list[int]]:
        """Each sentence's token ids, truncated, then eos: what a worker decodes."""
        limit = self.max_input_tokens
        return [ids[:limit] + [EOS_ID] for ids in self.tokenizer.encode(sentences)]

    def texts(self, results: list[Hypotheses]) -> list[list[str]]:
        """The n-best texts of each sentence's hypotheses."""
        flat = self.tokenizer.decode([tokens for nbest in results for tokens, _ in nbest])
        out, start = [], 0
        for nbest in results:
            out.append(flat[start : start + len(nbest)])
            start += len(nbest)
        return out
