"""Which files a model reference ``REPO[:QUANT|:FILE]`` names (localgen/hub/refs.py), on file
lists shaped like real hub repos; and split GGUF names (localgen/models/gguf_split.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localgen.hub.refs import (
    ModelRef, RefError, available_quants, hf_dir_files, parse_ref, quant_of, select_files,
    select_gguf,
)
from localgen.models.gguf_split import split_parts

# the layout of a typical community GGUF repo (one file per quant, a split big quant in a
# folder, a vision projector beside them)
GGUF_FILES = [
    ".gitattributes", "README.md", "Qwen3-8B-Q2_K.gguf", "Qwen3-8B-Q4_K_M.gguf",
    "Qwen3-8B-IQ4_XS.gguf", "Qwen3-8B-Q8_0.gguf", "mmproj-Qwen3-8B-F16.gguf",
    "BF16/Qwen3-8B-BF16-00001-of-00002.gguf", "BF16/Qwen3-8B-BF16-00002-of-00002.gguf",
]
HF_FILES = [
    ".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "merges.txt", "vocab.json",
    "chat_template.jinja", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "model.safetensors.index.json", "consolidated.safetensors", "pytorch_model.bin",
    "original/params.json", "original/consolidated.00.pth", "onnx/model.onnx", "LICENSE",
]


@pytest.mark.parametrize("text, want", [
    ("org/name", ModelRef("org/name")),
    ("org/name:Q4_K_M", ModelRef("org/name", "Q4_K_M")),
    ("org/Name-1.5B-GGUF:sub/file-q8_0.gguf", ModelRef("org/Name-1.5B-GGUF", "sub/file-q8_0.gguf")),
    ("./org/name", None), ("/abs/path", None), ("model.gguf", None), ("org/name.gguf", None),
    ("org/name:", None), ("org/name:../x.gguf", None), ("org/name:a b", None), ("a/b/c", None),
])
def test_parse_ref(text, want):
    assert parse_ref(text) == want


@pytest.mark.parametrize("name, quant", [
    ("Qwen3-8B-Q4_K_M.gguf", "Q4_K_M"), ("llama-2-7b.q8_0.gguf", "Q8_0"),
    ("Model-UD-Q4_K_XL.gguf", "Q4_K_XL"), ("Model-IQ4_XS.gguf", "IQ4_XS"),
    ("Qwen2.5-0.5B-Instruct-f16.gguf", "F16"), ("BF16/Qwen3-8B-BF16-00001-of-00002.gguf", "BF16"),
    ("Phi-3-mini-4k-instruct-q4.gguf", "Q4"), ("Qwen3-8B.gguf", None),
    ("gpt-oss-20b-MXFP4.gguf", "MXFP4"), ("Model-Q4_0_4_4.gguf", "Q4_0_4_4"),
])
def test_quant_of_reads_the_quant_from_the_file_name(name, quant):
    assert quant_of(name) == quant


def test_a_tag_picks_its_file_case_insensitively():
    assert select_gguf(ModelRef("o/r", "q8_0"), GGUF_FILES) == ["Qwen3-8B-Q8_0.gguf"]
    assert select_gguf(ModelRef("o/r", "IQ4_xs"), GGUF_FILES) == ["Qwen3-8B-IQ4_XS.gguf"]


def test_no_tag_is_q4_k_m_else_the_first_model_file():
    assert select_gguf(ModelRef("o/r"), GGUF_FILES) == ["Qwen3-8B-Q4_K_M.gguf"]
    no_default = [f for f in GGUF_FILES if "Q4_K_M" not in f]
    assert select_gguf(ModelRef("o/r"), no_default) == [
        "BF16/Qwen3-8B-BF16-00001-of-00002.gguf", "BF16/Qwen3-8B-BF16-00002-of-00002.gguf"]


def test_a_split_quant_brings_all_its_parts_and_a_missing_part_is_named():
    assert select_gguf(ModelRef("o/r", "bf16"), GGUF_FILES) == GGUF_FILES[-2:]
    with pytest.raises(RefError, match="lacks part.*BF16-00002-of-00002.gguf"):
        select_gguf(ModelRef("o/r", "BF16"), GGUF_FILES[:-1])


def test_a_missing_quant_lists_the_repos_quants_without_projectors():
    with pytest.raises(RefError) as e:
        select_gguf(ModelRef("o/r", "Q5_K_M"), GGUF_FILES)
    assert str(e.value) == "o/r has no Q5_K_M GGUF; its quants: BF16, IQ4_XS, Q2_K, Q4_K_M, Q8_0"
    assert "F16" not in available_quants(GGUF_FILES)  # the mmproj file is no model


def test_a_file_tag_names_a_path_and_two_files_of_one_quant_are_ambiguous():
    ref = ModelRef("o/r", "BF16/Qwen3-8B-BF16-00001-of-00002.gguf")
    assert select_gguf(ref, GGUF_FILES) == GGUF_FILES[-2:]
    with pytest.raises(RefError, match="has no file nope.gguf; its GGUF files: .*Q8_0.gguf"):
        select_gguf(ModelRef("o/r", "nope.gguf"), GGUF_FILES)
    with pytest.raises(RefError, match="Q8_0 matches several files .* name one as o/r:FILE.gguf"):
        select_gguf(ModelRef("o/r", "Q8_0"), ["a-Q8_0.gguf", "b-Q8_0.gguf"])


def test_a_safetensors_repo_gets_config_tokenizer_and_weights_only():
    fmt, files = select_files(ModelRef("o/r"), HF_FILES)
    assert fmt == "hf"
    assert files == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "merges.txt", "vocab.json", "chat_template.jinja",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"])
    assert hf_dir_files(HF_FILES) == files


def test_a_tag_means_gguf_and_a_repo_with_neither_format_is_refused():
    assert select_files(ModelRef("o/r", "Q4_K_M"), HF_FILES + ["x-Q4_K_M.gguf"]) == ("gguf", ["x-Q4_K_M.gguf"])
    with pytest.raises(RefError, match="o/r has no GGUF files, so it has no Q4_K_M"):
        select_files(ModelRef("o/r", "Q4_K_M"), HF_FILES)
    with pytest.raises(RefError, match="neither GGUF files nor a Hugging Face model directory"):
        select_files(ModelRef("o/r"), ["README.md", "pytorch_model.bin", "config.json"])


def test_split_parts_from_any_part():
    parts = split_parts(Path("/m/x-Q8_0-00002-of-00003.gguf"))
    assert [p.name for p in parts] == [f"x-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_parts(Path("/m/x-Q8_0.gguf")) is None
