"""A GGUF's tokenizer read back from localgen's cache encodes, decodes and renders the chat
template exactly as the one transformers converts from the file."""

from __future__ import annotations

import os

import pytest

from localgen.models import gguf_source
from localgen.models.tokenizer_cache import TOKENIZER_FILE, cache_key
from tiny_models import make_model, write_gguf

TEXTS = ["Hello world", "  two  spaces\nand a newline\t tab", "naïve café ✓ 日本",
         "<|im_start|>user\nhi<|im_end|>", ""]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a cat."},
     {"role": "assistant", "content": "Tom."}, {"role": "user", "content": "Another?"}],
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = make_model("smollm")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, (model.state_dict(), model.config.to_dict()), "F32")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _entry(cache, gguf):
    return cache / "tokenizers" / cache_key(gguf)


def _assert_same(a, b):
    assert a.get_vocab() == b.get_vocab()
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id) == (b.eos_token_id, b.bos_token_id,
                                                                b.pad_token_id)
    assert a.all_special_tokens == b.all_special_tokens
    for text in TEXTS:
        for special in (True, False):
            ids = a(text, add_special_tokens=special)["input_ids"]
            assert ids == b(text, add_special_tokens=special)["input_ids"], text
            for skip in (True, False):
                assert a.decode(ids, skip_special_tokens=skip) == b.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for gen in (True, False):
            ra = a.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ra == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert "Hi there" in ra or "Another?" in ra


def test_the_cached_tokenizer_matches_the_converted_one(tiny_gguf, cache):
    fresh = gguf_source.convert_gguf_tokenizer(tiny_gguf)
    first = gguf_source.load_gguf_tokenizer(tiny_gguf)  # converts and saves
    assert (_entry(cache, tiny_gguf) / TOKENIZER_FILE).is_file()
    second = gguf_source.load_gguf_tokenizer(tiny_gguf)  # reads the cache
    _assert_same(fresh, first)
    _assert_same(fresh, second)


def test_a_cache_hit_does_not_convert(tiny_gguf, cache, monkeypatch):
    gguf_source.load_gguf_tokenizer(tiny_gguf)

    def convert(path):
        raise AssertionError("converted although the cache holds this file's tokenizer")

    monkeypatch.setattr(gguf_source, "convert_gguf_tokenizer", convert)
    assert gguf_source.load_gguf_tokenizer(tiny_gguf).eos_token_id is not None


def test_a_changed_file_gets_a_new_entry(tiny_gguf, tmp_path, cache):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    key = cache_key(copy)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cache_key(copy) != key
    assert cache_key(tiny_gguf) != key  # another path, another entry


def test_a_damaged_entry_is_converted_again(tiny_gguf, cache):
    gguf_source.load_gguf_tokenizer(tiny_gguf)
    tj = _entry(cache, tiny_gguf) / TOKENIZER_FILE
    tj.write_text(tj.read_text()[:100])
    tok = gguf_source.load_gguf_tokenizer(tiny_gguf)
    _assert_same(gguf_source.convert_gguf_tokenizer(tiny_gguf), tok)
    assert len(tj.read_text()) > 100  # rewritten whole


def test_an_unwritable_cache_still_gives_the_tokenizer(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LOCALGEN_CACHE_DIR", str(blocker))
    assert gguf_source.load_gguf_tokenizer(tiny_gguf).get_vocab()


def test_conversion_reads_through_the_fast_reader_with_the_stock_result(tiny_gguf, monkeypatch):
    import gguf
    from transformers import AutoTokenizer

    from localgen.models.gguf_reader import FastGGUFReader

    stock_class = gguf.GGUFReader
    stock = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    built = []
    real_init = FastGGUFReader.__init__

    def init(self, *a, **kw):
        built.append(a[0])
        real_init(self, *a, **kw)

    monkeypatch.setattr(FastGGUFReader, "__init__", init)
    fast = gguf_source.convert_gguf_tokenizer(tiny_gguf)
    assert built and gguf.GGUFReader is stock_class  # used inside, restored after
    _assert_same(stock, fast)
