"""IncrementalDetokenizer, streamed (``tokenizers.DecodeStream``) and by whole-output decode:
the deltas build exactly the whole decode (up to the first stop string), never showing part of a
split character or of a stop string, on a byte-level BPE (GPT-2 style) and a SentencePiece-style
BPE with byte fallback (Llama style)."""

import random

import pytest

from localgen.runtime.detokenizer import IncrementalDetokenizer
from tests.tiny_models import make_tokenizer

TEXT = ("hello world, this is a tiny test. héllo wörld: 日本語 and 🙂 emoji; "
        "tokens split characters across pieces ÷ç≠ end")


class WholeDecode:
    """The same tokenizer seen only through ``decode``: IncrementalDetokenizer's reference path."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _spm_byte_fallback_tokenizer():
    """A Llama-style tokenizer: Metaspace words, BPE merges trained on TEXT, <0xNN> byte pieces
    for characters outside the vocabulary, and Llama's decoder chain."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train_from_iterator(["hello world this is a tiny test end tokens split pieces"],
                             trainer=trainer)
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in __import__("json").loads(base.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


TOKENIZERS = {"byte-level": make_tokenizer, "spm-byte-fallback": _spm_byte_fallback_tokenizer}


def _settled(whole: str, stop: tuple[str, ...]) -> str:
    """The text a stream with ``stop`` strings ends with: ``whole`` up to the first stop."""
    cut = min((i for i in (whole.find(s) for s in stop) if i >= 0), default=len(whole))
    return whole[:cut]


@pytest.mark.parametrize("path", ["stream", "whole"])
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("stop", [(), ("wör",), ("🙂 e", "zzz")])
def test_deltas_build_the_whole_decode(path, name, stop):
    tok = TOKENIZERS[name]()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    ids.insert(len(ids) // 2, tok.eos_token_id)  # a special token inside: skipped
    whole = tok.decode(ids, skip_special_tokens=True)
    want = _settled(whole, stop)
    d = IncrementalDetokenizer(tok if path == "stream" else WholeDecode(tok), stop)
    assert (d._stream is not None) == (path == "stream")
    rng, n, text, hit = random.Random(0), 0, "", False
    while n < len(ids) and not hit:
        n += rng.choice((1, 1, 1, 2, 3))  # a step may add several tokens (a prefill's first)
        delta, hit = d.update(ids[:n])
        text += delta
        assert want.startswith(text), (n, text)  # never a byte of a split character or a stop
    if not hit:
        text += d.update(ids, final=True)[0]
    assert text == d.emitted == want
    assert hit == (want != whole)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_final_releases_an_incomplete_character(name):
    tok = TOKENIZERS[name]()
    ids = tok("ab 🙂", add_special_tokens=False)["input_ids"]
    whole = tok.decode(ids[:-1], skip_special_tokens=True)  # the emoji cut short
    assert whole.endswith("\ufffd")
    fast, ref = IncrementalDetokenizer(tok), IncrementalDetokenizer(WholeDecode(tok))
    assert fast.update(ids[:-1]) == ref.update(ids[:-1])
    assert not fast.emitted.endswith("\ufffd")  # held back while the character may complete
    assert fast.update(ids[:-1], final=True) == ref.update(ids[:-1], final=True)
    assert fast.emitted == whole


def test_cleanup_tokenizers_keep_the_whole_decode():
    tok = make_tokenizer()
    tok.clean_up_tokenization_spaces = True  # decode() edits the backend's text afterwards
    assert IncrementalDetokenizer(tok)._stream is None
