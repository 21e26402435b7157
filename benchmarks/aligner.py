"""A word aligner that knows nothing of our translation model: IBM Model 1 in both directions.

The terminology benchmark (``benchmarks.terminology``) needs glossary entries derived from the
references, not from our decoder's output (a glossary built from what the model already says would
measure nothing). Word pairs come from this aligner: IBM Model 1 (Brown et al. 1993) trained by EM
on a parallel corpus (Multi30k train) in each direction, and the intersection of the two
directions' Viterbi links, which keeps the precise links and drops most of Model 1's garbage
collectors (a rare word aligned to everything).

EM runs on flat numpy arrays: every (sentence, target position, source position) triple once, the
translation table t(e|f) one value per distinct (f, e) pair, expectations summed with
``np.bincount``. On Multi30k (29k pairs, ~5M triples per direction) five iterations of both
directions take seconds; the tables are cached under the temp directory, keyed by the corpus and the
settings, so a second run only loads them.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Words: runs of letters/digits (Unicode), so "saftig-grünes" is two words and "Mann," is "Mann".
WORD = re.compile(r"\w+")
CACHE_DIR = Path(tempfile.gettempdir()) / "nmt-aligner"
NULL = 0  # id of the empty word every source sentence gets (target words with no counterpart)
# Plain Model 1 has no notion of position, so a word repeated in a sentence ("ein Mann ... ein
# Hut") ties exactly: t(e|f) is multiplied by (1 - TIE * distance from the diagonal), so the nearer
# occurrence wins, by a factor too small to override a real difference.
TIE = 1e-3
# With a diagonal prior (``diagonal`` > 0, fast_align's reparameterisation of Model 2, Dyer et al.
# 2013): P(NULL) = P0, P(source i | target j) ~ exp(-diagonal * |i/len(f) - j/len(e)|).
P0 = 0.08
DIAGONAL = 4.0  # fast_align's default tension; de-en reorders verbs but keeps nouns near the diagonal


def prior(n_src: int, n_tgt: int, diagonal: float) -> np.ndarray:
    """Alignment prior, rows NULL + source positions, columns target positions."""
    rel_src = (np.arange(n_src) + 1) / n_src
    rel_tgt = (np.arange(n_tgt) + 1) / n_tgt
    dist = np.abs(rel_src[:, None] - rel_tgt[None, :])
    if diagonal <= 0:
        return np.vstack([np.ones((1, n_tgt)), 1.0 - TIE * dist])
    w = np.exp(-diagonal * dist)
    return np.vstack([np.full((1, n_tgt), P0), (1.0 - P0) * w / w.sum(axis=0)])


@dataclass(frozen=True)
class Token:
    """A word of a sentence: as written, lower-cased (what the aligner sees), and where it is."""

    surface: str
    lower: str
    start: int
    end: int


def tokenize(text: str) -> list[Token]:
    return [Token(m.group(), m.group().lower(), m.start(), m.end()) for m in WORD.finditer(text)]


def words(text: str) -> list[str]:
    return [t.lower for t in tokenize(text)]


class Vocab:
    """Word <-> id; id 0 is the NULL word."""

    def __init__(self, items: Sequence[str] = ("<null>",)) -> None:
        self.items = list(items)
        self.ids = {w: i for i, w in enumerate(self.items)}

    def add(self, word: str) -> int:
        i = self.ids.get(word)
        if i is None:
            i = self.ids[word] = len(self.items)
            self.items.append(word)
        return i

    def __len__(self) -> int:
        return len(self.items)


class Model1:
    """t(e|f) of IBM Model 1 for one direction (f = source, e = target), as sorted pair keys
    ``f * len(target vocab) + e`` and their probabilities, with the alignment prior it was trained
    under (``diagonal`` 0: Model 1's uniform one)."""

    def __init__(self, src: Vocab, tgt: Vocab, keys: np.ndarray, probs: np.ndarray, diagonal: float) -> None:
        self.src, self.tgt, self.keys, self.probs, self.diagonal = src, tgt, keys, probs, diagonal

    @classmethod
    def train(
        cls,
        sources: Sequence[list[str]],
        targets: Sequence[list[str]],
        iterations: int = 5,
        diagonal: float = DIAGONAL,
    ) -> Model1:
        src, tgt = Vocab(), Vocab()
        f_parts: list[np.ndarray] = []
        e_parts: list[np.ndarray] = []
        g_parts: list[np.ndarray] = []
        w_parts: list[np.ndarray] = []
        n_targets = 0
        for fs, es in zip(sources, targets, strict=True):
            if not es:
                continue
            f_ids = np.array([NULL] + [src.add(w) for w in fs], dtype=np.int64)
            e_ids = np.array([tgt.add(w) for w in es], dtype=np.int64)
            # Target-major: all source words (NULL first) for target word 1, then for word 2, ...
            f_parts.append(np.tile(f_ids, len(e_ids)))
            e_parts.append(np.repeat(e_ids, len(f_ids)))
            # One group per target token: its alignment posterior is normalised over the group.
            g_parts.append(n_targets + np.repeat(np.arange(len(e_ids)), len(f_ids)))
            w_parts.append(prior(len(fs), len(es), diagonal).T.ravel())
            n_targets += len(e_ids)
        f_all, e_all, group = np.concatenate(f_parts), np.concatenate(e_parts), np.concatenate(g_parts)
        weight = np.concatenate(w_parts)
        keys_all = f_all * len(tgt) + e_all
        keys, pair = np.unique(keys_all, return_inverse=True)
        f_of_key = keys // len(tgt)
        t = np.full(len(keys), 1.0 / len(tgt))  # uniform start: every pair seen equally likely
        for _ in range(iterations):
            p = t[pair] * weight
            posterior = p / np.bincount(group, weights=p)[group]
            counts = np.bincount(pair, weights=posterior, minlength=len(keys))
            totals = np.bincount(f_of_key, weights=counts, minlength=len(src))
            t = counts / totals[f_of_key]
        return cls(src, tgt, keys, t, diagonal)

    def prob(self, f: list[str], e: list[str]) -> np.ndarray:
        """t(e_j | f_i) for i over NULL + ``f`` (rows) and j over ``e`` (columns); 0 for pairs never
        seen together in training (unknown words included)."""
        f_ids = np.array([NULL] + [self.src.ids.get(w, -1) for w in f], dtype=np.int64)
        e_ids = np.array([self.tgt.ids.get(w, -1) for w in e], dtype=np.int64)
        keys = f_ids[:, None] * len(self.tgt) + e_ids[None, :]
        at = np.clip(np.searchsorted(self.keys, keys), 0, len(self.keys) - 1)
        found = (self.keys[at] == keys) & (f_ids[:, None] >= 0) & (e_ids[None, :] >= 0)
        return np.where(found, self.probs[at], 0.0)

    def viterbi(self, f: list[str], e: list[str]) -> list[int | None]:
        """For each target word, the source position it aligns to (None: NULL or nothing known)."""
        if not f or not e:
            return [None] * len(e)
        p = self.prob(f, e) * prior(len(f), len(e), self.diagonal)
        best = p.argmax(axis=0)
        return [int(b) - 1 if b != NULL and p[b, j] > 0 else None for j, b in enumerate(best)]

    def save(self, path: Path) -> None:
        # Vocabularies as one newline-joined string (words never contain one): no pickle needed.
        np.savez(
            path,
            src=np.array("\n".join(self.src.items)),
            tgt=np.array("\n".join(self.tgt.items)),
            keys=self.keys,
            probs=self.probs,
            diagonal=np.array(self.diagonal),
        )

    @classmethod
    def load(cls, path: Path) -> Model1:
        with np.load(path) as z:
            src, tgt = str(z["src"]).split("\n"), str(z["tgt"]).split("\n")
            return cls(Vocab(src), Vocab(tgt), z["keys"], z["probs"], float(z["diagonal"]))


Link = tuple[int, int]  # (source position, target position), word indices


class Aligner:
    """Model 1 both ways; a sentence pair's links are where the two Viterbi alignments agree."""

    def __init__(self, forward: Model1, backward: Model1) -> None:
        self.forward = forward  # source -> target: t(target word | source word)
        self.backward = backward  # target -> source

    @classmethod
    def train(
        cls, sources: Sequence[str], targets: Sequence[str], iterations: int = 5, diagonal: float = DIAGONAL
    ) -> Aligner:
        f = [words(s) for s in sources]
        e = [words(t) for t in targets]
        return cls(Model1.train(f, e, iterations, diagonal), Model1.train(e, f, iterations, diagonal))

    def align(self, source: Sequence[str], target: Sequence[str], grow_diag: bool = False) -> set[Link]:
        """Links between the (lower-cased) words ``source`` and ``target``: the intersection of both
        directions; with ``grow_diag``, also union links next to (incl. diagonally) an accepted one
        whose two words are both still unaligned (Koehn et al. 2003), for recall over precision."""
        f, e = list(source), list(target)
        fwd = {(i, j) for j, i in enumerate(self.forward.viterbi(f, e)) if i is not None}
        bwd = {(i, j) for i, j in enumerate(self.backward.viterbi(e, f)) if j is not None}
        links = fwd & bwd
        if grow_diag:
            union = fwd | bwd
            grew = True
            while grew:
                grew = False
                for i, j in sorted(links):
                    for di in (-1, 0, 1):
                        for dj in (-1, 0, 1):
                            cand = (i + di, j + dj)
                            if cand in union and cand not in links:
                                src_free = all(a != cand[0] for a, _ in links)
                                tgt_free = all(b != cand[1] for _, b in links)
                                if src_free or tgt_free:
                                    links.add(cand)
                                    grew = True
        return links

    def flipped(self) -> Aligner:
        """The aligner for the opposite direction (same links, transposed)."""
        return Aligner(self.backward, self.forward)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.forward.save(directory / "forward.npz")
        self.backward.save(directory / "backward.npz")

    @classmethod
    def load(cls, directory: Path) -> Aligner:
        return cls(Model1.load(directory / "forward.npz"), Model1.load(directory / "backward.npz"))


def cached(
    sources: Sequence[str],
    targets: Sequence[str],
    iterations: int = 5,
    diagonal: float = DIAGONAL,
    cache_dir: Path = CACHE_DIR,
) -> Aligner:
    """The aligner for this corpus and these settings: loaded from ``cache_dir`` when trained
    before (keyed by a hash of the text and the settings), trained and stored otherwise."""
    h = hashlib.sha256(f"model1 v1 iterations={iterations} diagonal={diagonal}\n".encode())
    for lines in (sources, targets):
        for line in lines:
            h.update(line.encode())
            h.update(b"\n")
        h.update(b"\0")
    directory = cache_dir / h.hexdigest()[:16]
    if (directory / "backward.npz").exists():
        return Aligner.load(directory)
    aligner = Aligner.train(sources, targets, iterations, diagonal)
    # Written to a sibling then renamed: a run killed mid-write leaves no half cache behind.
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name, dir=cache_dir))
    aligner.save(tmp)
    try:
        tmp.rename(directory)
    except OSError:  # another process got there first: its copy is as good
        shutil.rmtree(tmp, ignore_errors=True)
    return aligner
