"""model.runtime.prepack: oneDNN pre-packed linear layers compute what nn.Linear does, and leave the
model's weights (state_dict) as they were."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sacrebleu
import torch
from conftest import compile_cache_dir

import model.decoding.translator
import model.runtime.prepack
from model.cache import KVCache
from model.layers import KEY_ALIGN
from model.runtime import int8mm
from model.runtime.prepack import (
    Int8Embedding,
    Int8Linear,
    PackedLinear,
    SharedInt8Embedding,
    available,
    prepack,
)
from model.tokenizer import PAD_ID
from model.transformer import Transformer
from model.translator import Translator

SHIPPED = Path(__file__).resolve().parents[1] / "artifacts" / "multi30k-de-en"


def test_available_on_this_build() -> None:
    # The CPU wheels we install (torch 2.13.0) ship oneDNN; if this fails, serving silently lost the lever.
    assert available()


@pytest.mark.parametrize("intel", [True, False])
@pytest.mark.parametrize(("tie_embeddings", "output_bias"), [(True, False), (False, True)])
def test_prepacked_model_computes_the_same_logits(
    make_model: Callable[..., Transformer],
    tie_embeddings: bool,
    output_bias: bool,
    intel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model.runtime.prepack, "_intel_cpu", lambda: intel)
    kinds = {"share_embeddings": tie_embeddings, "tie_output": tie_embeddings, "output_bias": output_bias}
    plain = make_model(seed=2, **kinds)
    packed = make_model(seed=2, **kinds)
    for m in (plain, packed):
        if m.output_bias is not None:  # a bias the packed projection must add, not zeros
            with torch.no_grad():
                m.output_bias.copy_(torch.linspace(-1, 1, m.cfg.vocab_size))
    assert prepack(packed)
    for layer in packed.decoder:  # per-token layers packed; once-per-input ones left to MKL on Intel
        assert isinstance(layer.self_attn.qkv, PackedLinear) and isinstance(layer.ff.fc2, PackedLinear)
        assert isinstance(layer.cross_attn.kv, torch.nn.Linear) == intel
    assert isinstance(packed.encoder[0].ff.fc1, torch.nn.Linear) == intel
    assert isinstance(packed.logits_proj, PackedLinear)
    src = torch.randint(4, plain.cfg.vocab_size, (3, 7))
    src[1, 5:] = PAD_ID
    tgt = torch.randint(4, plain.cfg.vocab_size, (3, 5))
    with torch.inference_mode():
        torch.testing.assert_close(packed(src, tgt), plain(src, tgt), atol=1e-5, rtol=1e-5)
        caches = []
        for m in (packed, plain):
            enc = m.encode(src)
            w = m.embed.weight
            cache = KVCache(m.cfg, capacity=3, positions=16, dtype=w.dtype, device=w.device, align=KEY_ALIGN)
            cache.append(m.source_kv(enc), enc.src_mask)
            caches.append(cache)
        for t in range(tgt.size(1)):
            lp, lq = [], []
            for m, cache, out in ((packed, caches[0], lp), (plain, caches[1], lq)):
                logits, new_kv = m.step(tgt[:, t], *cache.views())
                cache.advance(new_kv)
                out.append(logits)
            torch.testing.assert_close(lp[0], lq[0], atol=1e-5, rtol=1e-5)


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


# -- int8 -------------------------------------------------------------------------------------------
def test_int8_available_on_this_build() -> None:
    assert available(int8=True)


def test_int8_linear_is_close_to_the_float_layer() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(256, 1000)
    x = torch.randn(64, 1, 256)
    with torch.inference_mode():
        want = ref(x)
        got = Int8Linear(ref.weight, ref.bias)(x)
    # 8-bit weights per output feature, 8-bit activations per row: about 1% of the output's scale, and
    # far from exact (a bug that dropped the scales or the bias would be off by orders of magnitude).
    error = (got - want).abs().max() / want.abs().max()
    assert 1e-5 < error < 0.03


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_int8_model_keeps_its_state_dict_and_close_logits(
    make_model: Callable[..., Transformer], tie_embeddings: bool
) -> None:
    plain = make_model(seed=3, share_embeddings=tie_embeddings, tie_output=tie_embeddings)
    quantized = make_model(seed=3, share_embeddings=tie_embeddings, tie_output=tie_embeddings)
    before = {k: v.clone() for k, v in quantized.state_dict().items()}
    assert prepack(quantized, int8=True)
    for layer in quantized.decoder:
        assert isinstance(layer.self_attn.qkv, Int8Linear) and isinstance(layer.ff.fc1, Int8Linear)
    for enc_layer in quantized.encoder:  # the encoder too, and the cross-attention K/V projection
        assert isinstance(enc_layer.self_attn.qkv, Int8Linear) and isinstance(enc_layer.ff.fc2, Int8Linear)
    assert isinstance(quantized.decoder[0].cross_attn.kv, Int8Linear)
    assert isinstance(quantized.logits_proj, Int8Linear)  # the output projection, tied or not
    after = quantized.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    src = torch.randint(4, plain.cfg.vocab_size, (3, 7))
    tgt = torch.randint(4, plain.cfg.vocab_size, (3, 5))
    with torch.inference_mode():
        want, got = plain(src, tgt), quantized(src, tgt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_translator_quantization_options(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Translator.load(model_dir, device="cpu").quantization == "none"
    for fast, expected in ((True, "int8"), (False, "none")):  # auto: int8 where the CPU makes it pay
        monkeypatch.setattr(model.decoding.translator, "int8_pays", lambda cache_dir, fast=fast: fast)
        auto = Translator.load(model_dir, device="cpu", quantization="auto")
        assert auto.quantization == expected
        assert isinstance(auto.model.decoder[0].ff.fc1, Int8Linear) == (expected == "int8")
    half = Translator.load(model_dir, device="cpu", dtype="bfloat16", quantization="auto")
    assert half.quantization == "none"
    with pytest.raises(ValueError, match="float32"):
        Translator.load(model_dir, device="cpu", dtype="bfloat16", quantization="int8")
    with pytest.raises(ValueError, match="quantization must be"):
        Translator.load(model_dir, device="cpu", quantization="int4")


GERMAN = [
    "Ein Mann fährt mit dem Fahrrad durch die Stadt.",
    "Zwei Hunde spielen im Gras.",
    "Eine Frau in einem roten Kleid tanzt auf der Straße.",
    "Kinder spielen im Schnee.",
    "Ein kleines Mädchen isst ein Eis.",
    "Eine Gruppe von Menschen steht vor einem Gebäude.",
    "Ein Mann mit Hut sitzt auf einer Bank und liest eine Zeitung.",
    "Ein Junge springt in einen See.",
    "Zwei Männer arbeiten auf einem Dach.",
    "Eine ältere Frau kocht in der Küche.",
    "Ein Hund rennt am Strand entlang.",
    "Ein Musiker spielt Gitarre auf einer Bühne.",
    "Drei Kinder sitzen auf einer Mauer.",
    "Ein Mann in einem blauen Hemd schneidet Brot.",
    "Eine Frau fotografiert die Berge.",
    "Ein Fußballspieler schießt den Ball ins Tor.",
]


def test_int8_shipped_model_translates_like_float32() -> None:
    # The claim the service's default rests on: int8 changes (almost) nothing. On the full test and
    # val sets the two are 0.0-0.1 BLEU apart (``python -m benchmarks.engine``); here the int8
    # outputs must match the float32 ones closely (chrF against them as reference), and most must
    # be identical.
    outputs = {
        q: [
            r.hypotheses[0]
            for r in Translator.load(SHIPPED, device="cpu", quantization=q).translate_batch(
                GERMAN, beam_size=1
            )
        ]
        for q in ("none", "int8")
    }
    assert sacrebleu.corpus_chrf(outputs["int8"], [outputs["none"]]).score > 90
    assert sum(a == b for a, b in zip(outputs["int8"], outputs["none"], strict=True)) >= 12
    assert "dog" in outputs["int8"][1].lower()  # and they are translations


@pytest.mark.parametrize("ours", [True, False], ids=["our-kernel", "onednn"])
@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_a_model_served_in_int8_keeps_its_embeddings_in_int8_only(
    make_model: Callable[..., Transformer], tie_embeddings: bool, ours: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With our int8 kernel a tied model's lookups read the output projection's own copy; with
    # oneDNN's (opaque) a table of their own.
    if ours:
        assert int8mm.ensure(compile_cache_dir())
    else:
        monkeypatch.setattr(int8mm, "loaded", lambda: False)
    kinds = {"share_embeddings": tie_embeddings, "tie_output": tie_embeddings}
    plain = make_model(seed=4, **kinds)
    served = make_model(seed=4, **kinds)
    assert prepack(served, int8=True, keep_float=False)
    tables = [("embed", served.embed, plain.embed.weight)]
    if not tie_embeddings:
        assert plain.src_embed is not None
        tables.append(("src_embed", served.src_embed, plain.src_embed.weight))
    v, d = plain.cfg.vocab_size, plain.cfg.d_model
    # No float (V, D) table is left: the lookups read the int8 rows.
    assert not [
        name
        for name, p in served.named_parameters(remove_duplicate=False)
        if p.is_floating_point() and p.shape == (v, d)
    ]
    ids = torch.arange(v)
    for name, table, weight in tables:
        if ours and tie_embeddings:
            assert isinstance(table, SharedInt8Embedding), name
            assert table.blocked is served.logits_proj.blocked and table.blocked.dtype == torch.int8
        else:
            assert isinstance(table, Int8Embedding), name
            assert table.table.dtype == torch.int8
        # Recomputed here: each row rounded to 255 levels of its own largest magnitude.
        step = weight.abs().amax(dim=1, keepdim=True) / 127
        with torch.inference_mode():
            got = table(ids)
        want = torch.where(step > 0, torch.round(weight / step) * step, 0.0)  # (the padding row is 0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert 0 < (got - weight).abs().max() <= step.max() / 2 + 1e-6
    src = torch.randint(4, v, (3, 7))
    tgt = torch.randint(4, v, (3, 5))
    with torch.inference_mode():
        want, got = plain(src, tgt), served(src, tgt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
