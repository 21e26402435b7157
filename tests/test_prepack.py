"""model.prepack: oneDNN pre-packed linear layers compute what nn.Linear does, and leave the
model's weights (state_dict) as they were."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from model.prepack import PackedLinear, available, prepack
from model.tokenizer import PAD_ID
from model.transformer import Transformer
from model.translator import Translator


def test_available_on_this_build() -> None:
    # The CPU wheels we install (torch 2.13.0) ship oneDNN; if this fails, serving silently lost the lever.
    assert available()


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_prepacked_model_computes_the_same_logits(
    make_model: Callable[..., Transformer], tie_embeddings: bool
) -> None:
    plain = make_model(seed=2, tie_embeddings=tie_embeddings)
    packed = make_model(seed=2, tie_embeddings=tie_embeddings)
    assert prepack(packed)
    for layer in packed.decoder:  # per-token layers packed; once-per-input ones left to MKL
        assert isinstance(layer.self_attn.qkv, PackedLinear) and isinstance(layer.ff.fc2, PackedLinear)
        assert isinstance(layer.cross_attn.kv, torch.nn.Linear)
    assert isinstance(packed.encoder[0].ff.fc1, torch.nn.Linear)
    assert isinstance(packed.logits_proj, PackedLinear) == tie_embeddings
    src = torch.randint(4, plain.cfg.vocab_size, (3, 7))
    src[1, 5:] = PAD_ID
    tgt = torch.randint(4, plain.cfg.vocab_size, (3, 5))
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, tgt), plain(src, tgt), atol=1e-5, rtol=1e-5)
        cache_p = packed.start_cache(packed.encode(src))
        cache_q = plain.start_cache(plain.encode(src))
        for t in range(tgt.size(1)):
            lp, cache_p = packed.decode_step(tgt[:, t], cache_p)
            lq, cache_q = plain.decode_step(tgt[:, t], cache_q)
            torch.testing.assert_close(lp, lq, atol=1e-5, rtol=1e-5)


def test_state_dict_is_unchanged(make_model: Callable[..., Transformer]) -> None:
    model = make_model(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert prepack(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_only_eval_float32_cpu_models_are_packed(make_model: Callable[..., Transformer]) -> None:
    assert not prepack(make_model().train())
    assert not prepack(make_model().to(torch.bfloat16))


def test_translator_prepacks_by_default_and_translates_the_same(
    model_dir: Path, sentences: list[str]
) -> None:
    packed = Translator.load(model_dir, device="cpu")
    plain = Translator.load(model_dir, device="cpu", prepack=False)
    assert isinstance(packed.model.decoder[0].ff.fc1, PackedLinear)
    assert isinstance(plain.model.decoder[0].ff.fc1, torch.nn.Linear)
    for beam in (1, 3):
        a = packed.translate_batch(sentences, beam_size=beam)
        b = plain.translate_batch(sentences, beam_size=beam)
        assert [r.tokens for r in a] == [r.tokens for r in b]
