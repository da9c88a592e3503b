"""FastGGUFReader gives the fields and tensors `gguf.GGUFReader` gives, and fails on the same
damaged files (open_gguf turns both into one CorruptModelError)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from localgen.models.config import CorruptModelError
from localgen.models.gguf_reader import FastGGUFReader
from localgen.models.gguf_source import open_gguf
from tiny_models import make_model, write_gguf

_LISTS = {
    "test.floats": [0.5, -1.25, 3e38],
    "test.ints": [1, -2, 2**31 - 1],
    "test.bools": [True, False, True],
    "test.words": ["héllo", "", "wörld ✓", "a" * 300],
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = make_model("smollm")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, (model.state_dict(), model.config.to_dict()), "Q8_0", metadata=_LISTS)


def _same_field(a, b, key):
    assert a.types == b.types, key
    assert a.data == b.data, key
    assert len(a.parts) == len(b.parts), key
    for x, y in zip(a.parts, b.parts):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), key
    assert a.contents() == b.contents(), key
    if a.types and a.types[0] == gguf.GGUFValueType.ARRAY and a.data:
        assert a.contents(len(a.data) - 1) == b.contents(len(b.data) - 1), key


def test_fields_and_tensors_match_the_stock_reader(tiny_gguf):
    stock, fast = gguf.GGUFReader(str(tiny_gguf)), FastGGUFReader(str(tiny_gguf))
    assert list(stock.fields) == list(fast.fields)
    for key in stock.fields:
        _same_field(stock.fields[key], fast.fields[key], key)
    assert fast.fields["test.words"].contents() == _LISTS["test.words"]
    assert len(fast.fields["tokenizer.ggml.tokens"].contents()) > 300
    assert [t.name for t in stock.tensors] == [t.name for t in fast.tensors]
    for s, f in zip(stock.tensors, fast.tensors):
        assert (s.tensor_type, s.n_bytes, s.data_offset) == (f.tensor_type, f.n_bytes, f.data_offset)
        assert np.array_equal(s.shape, f.shape) and np.array_equal(s.data, f.data)


def test_opening_walks_a_string_array_without_slicing_it(tiny_gguf):
    """The vocabulary's parts are made at the first read past the field's head, and then equal
    the stock reader's, negative indices included."""
    stock, fast = gguf.GGUFReader(str(tiny_gguf)), FastGGUFReader(str(tiny_gguf))
    a, b = fast.fields["tokenizer.ggml.tokens"], stock.fields["tokenizer.ggml.tokens"]
    assert a.parts._all is None and len(a.parts) == len(b.parts)
    assert a.parts[1].tobytes() == b"tokenizer.ggml.tokens" and a.parts._all is None  # the key
    assert a.parts[-1].tobytes() == b.parts[-1].tobytes() and a.parts._all is not None
    assert a.contents(0) == b.contents(0)


def test_a_vocabulary_cut_short_is_a_corrupt_file(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    at = data.index(b"tokenizer.ggml.merges")  # inside the metadata, past the token list
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:at])
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        open_gguf(cut)


def test_string_indices_find_tokens_in_place_as_a_dict_over_the_list_would(tmp_path):
    """Last occurrence of a repeated string, strings absent left out, non-ASCII matched by
    bytes; the array's parts are never made."""
    model = make_model("smollm")
    words = ["<|im_end|>", "a", "wörld ✓", "<|im_end|>", "", "ab", "wörld"]
    path = write_gguf(tmp_path / "dup.gguf", (model.state_dict(), model.config.to_dict()), "F32",
                      metadata={"test.dups": words})
    fast = FastGGUFReader(str(path))
    wanted = ["<|im_end|>", "wörld ✓", "", "missing", "ab"]
    want = {w: i for i, w in enumerate(words) if w in wanted}
    assert fast.string_indices("test.dups", wanted) == want == {"<|im_end|>": 3, "wörld ✓": 2, "": 4, "ab": 5}
    assert fast.fields["test.dups"].parts._all is None
    vocab = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    some = [vocab[0], vocab[len(vocab) // 2], vocab[-1]]
    assert fast.string_indices("tokenizer.ggml.tokens", some) == {t: i for i, t in enumerate(vocab) if t in some}
    assert fast.string_indices("test.floats", ["x"]) is None  # not a string array
    assert fast.string_indices("no.such.key", ["x"]) is None


def test_the_eos_ids_and_config_come_without_making_the_vocabulary(tiny_gguf):
    from localgen.models.gguf_config import gguf_hf_config

    fast, stock = FastGGUFReader(str(tiny_gguf)), gguf.GGUFReader(str(tiny_gguf))
    assert gguf_hf_config(fast) == gguf_hf_config(stock)
    assert fast.fields["tokenizer.ggml.tokens"].parts._all is None


def test_the_embedded_models_eos_ids_are_the_chat_end_token():
    from localgen.models.gguf_config import gguf_eos_token_ids
    from localgen.models.sources import embedded_gguf_path

    path = str(embedded_gguf_path())
    fast, stock = FastGGUFReader(path), gguf.GGUFReader(path)
    assert gguf_eos_token_ids(fast) == gguf_eos_token_ids(stock)
    vocab = stock.fields["tokenizer.ggml.tokens"].contents()
    assert vocab[gguf_eos_token_ids(fast)[-1]] == "<|im_end|>"
    assert fast.fields["tokenizer.ggml.tokens"].parts._all is None


def _mapped_rows(t):
    flat = np.asarray(t.data).view(np.uint8).reshape(-1)
    rows = int(t.shape[-1]) if len(t.shape) > 1 else 1
    return flat.reshape(rows, -1)


def test_tensor_rows_read_from_the_file_equal_the_mapped_ones(tiny_gguf, monkeypatch):
    """Every tensor, read in short reads of at most 7 bytes (a read resumes where the last one
    stopped, as one of over 2 GiB does on Linux), equals its mapped bytes."""
    from localgen.models.gguf_tensors import read_tensor_rows

    real = os.preadv
    monkeypatch.setattr(os, "preadv",
                        lambda fd, bufs, off: real(fd, [memoryview(bufs[0])[:7]], off))
    reader = open_gguf(tiny_gguf)
    for t in reader.tensors:
        want = _mapped_rows(t)
        got = torch.empty(want.shape, dtype=torch.uint8)
        assert read_tensor_rows(t, got)
        assert (got.numpy() == want).all(), t.name


def test_a_file_cut_after_opening_names_the_tensor_and_the_missing_bytes(tiny_gguf, tmp_path):
    from localgen.models.gguf_tensors import read_tensor_rows

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes())
    reader = open_gguf(cut)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    with open(cut, "r+b") as f:
        f.truncate(int(last.data_offset) + 3)
    with pytest.raises(CorruptModelError, match=rf"tensor {last.name} ends {int(last.n_bytes) - 3} bytes"):
        read_tensor_rows(last, torch.empty(1, int(last.n_bytes), dtype=torch.uint8))


def _rss_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Rss:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="Linux only")
def test_empty_rows_faults_its_pages_in_before_they_are_written():
    """A 64 MiB buffer (four populate chunks, so several threads) is resident as soon as it is
    made: process RSS grows by at least its size before anything writes it, and it reads
    zeros (fresh anonymous pages)."""
    from localgen.models.gguf_tensors import POPULATE_CHUNK_BYTES, empty_rows

    n = 4 * POPULATE_CHUNK_BYTES
    before = _rss_kib()
    buf = empty_rows(n // 4096, 4096)
    grown = _rss_kib() - before
    assert grown >= n // 1024 * 0.98, f"RSS grew {grown} KiB for a {n // 1024} KiB buffer"
    assert int(buf[:: 997].sum()) == 0


def _mapping_fields(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address addr."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                if inside:
                    break
                inside = lo <= addr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(_thp_mode() == "never", reason="no transparent huge pages here")
def test_empty_rows_asks_for_huge_pages_when_told(monkeypatch):
    """With LOCALGEN_HUGE_PAGES=1 a weight buffer of a few huge pages starts on a 2 MiB boundary
    and its mapping may take transparent huge pages (smaps' THPeligible); by default it is not
    advised."""
    from localgen.models import gguf_tensors
    from localgen.models.gguf_tensors import HUGE_PAGE_BYTES, empty_rows

    monkeypatch.setenv(gguf_tensors.HUGE_PAGES_ENV, "1")
    buf = empty_rows(3 * HUGE_PAGE_BYTES // 4096, 4096)
    assert buf.data_ptr() % HUGE_PAGE_BYTES == 0
    fields = _mapping_fields(buf.data_ptr())
    assert fields.get("THPeligible") == "1", fields
    if _thp_mode() == "madvise":  # where every anonymous map is eligible, there is no contrast
        monkeypatch.delenv(gguf_tensors.HUGE_PAGES_ENV)
        plain = empty_rows(3 * HUGE_PAGE_BYTES // 4096, 4096)
        assert _mapping_fields(plain.data_ptr()).get("THPeligible") == "0"


@pytest.mark.parametrize("rows,width", [(3, 144), (1024, 1040)])  # below and above 1 MiB
def test_empty_rows_is_writable_row_memory_that_outlives_its_views(rows, width):
    """A tensor's byte buffer: ``[rows, width]`` contiguous uint8, writable; a row view keeps
    the (populated, for 1 MiB and up) map alive after the tensor itself is dropped."""
    import gc

    from localgen.models.gguf_tensors import POPULATE_MIN_BYTES, empty_rows

    buf = empty_rows(rows, width)
    assert buf.shape == (rows, width) and buf.dtype == torch.uint8 and buf.is_contiguous()
    assert (rows * width >= POPULATE_MIN_BYTES) == (rows == 1024)
    buf.copy_(torch.arange(rows * width, dtype=torch.int64).remainder(251).view(rows, width))
    last = buf[-1]
    del buf
    gc.collect()
    want = torch.arange((rows - 1) * width, rows * width).remainder(251).to(torch.uint8)
    assert torch.equal(last, want)
