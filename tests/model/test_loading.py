"""load_model's errors: every bad spec ends in one ModelLoadError line that says what is wrong (no traceback from
transformers, gguf or struct)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from verispec.model.loading import ModelLoadError, _resolve, load_model


def _write_gguf(path) -> int:
    """A small valid GGUF file; returns the byte offset where its header (magic, counts, key-values, tensor
    infos) ends."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_name("tiny")
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return int(gguf.GGUFReader(str(path)).data_offset)


def test_gguf_truncated_inside_its_header_is_a_clear_error(tmp_path):
    full = tmp_path / "full.gguf"
    header_end = _write_gguf(full)
    data = full.read_bytes()
    assert 24 < header_end < len(data)
    cut = tmp_path / "cut.gguf"
    for n in sorted({4, 10, 23, 24, 40, header_end // 2, header_end - 1}):  # magic, counts, key-values, tensor info
        cut.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match="truncated or corrupt") as info:
            load_model(cut)
        assert "\n" not in str(info.value) and "cut.gguf" in str(info.value), n


def test_missing_paths_say_so(tmp_path):
    with pytest.raises(ModelLoadError, match=r"^no such file or directory: .*missing-dir$"):
        load_model(tmp_path / "missing-dir")
    with pytest.raises(ModelLoadError, match=r"^no such file or directory: \./not-here$"):
        load_model("./not-here")
    with pytest.raises(ModelLoadError, match=r"^no such file or directory: .*missing\.gguf$"):
        load_model(tmp_path / "missing.gguf")


def test_a_directory_without_a_model_says_what_it_lacks(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"is a directory but holds no model \(no config.json / \*.gguf\)$"):
        load_model(empty)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=r"has a config\.json but no tokenizer") as info:
        load_model(config_only)
    assert "\n" not in str(info.value) and not str(info.value).endswith(": ")
    two = tmp_path / "two-ggufs"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        load_model(two)
    plain_file = tmp_path / "notes.txt"
    plain_file.write_text("hello")
    with pytest.raises(ModelLoadError, match="is a file but not a model"):
        load_model(plain_file)


def test_resolution_of_specs(tmp_path):
    assert _resolve("org/model") == ("org/model", "org/model", {})  # a hub id, not a missing local path
    assert _resolve("gpt2") == ("gpt2", "gpt2", {})
    one = tmp_path / "one-gguf"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert _resolve(one) == (str(one), str(one), {"gguf_file": "m.gguf"})
    f = tmp_path / "x.gguf"
    f.write_bytes(b"")
    assert _resolve(f) == (str(tmp_path), str(f), {"gguf_file": "x.gguf"})


def test_a_saved_model_directory_loads(tmp_path):
    from ..helpers.tiny import make_model, make_tokenizer

    make_model(0).save_pretrained(tmp_path / "m")
    make_tokenizer().save_pretrained(tmp_path / "m")
    m = load_model(tmp_path / "m")
    assert m.name == str(tmp_path / "m") and len(m.tokenizer) > 0 and not m.model.training
