"""Model id derivation and model path resolution (SPEC §1)."""

from __future__ import annotations

import pytest

from mlx_server.engine.loader import ModelError, derive_model_id, resolve_model_path


@pytest.mark.parametrize(
    "arg,expected",
    [
        ("/m/Foo/model.safetensors", "model"),
        ("/m/Qwen3-4B", "Qwen3-4B"),
        ("/m/Qwen2.5-7B", "Qwen2.5-7B"),
        ("/m/Qwen2.5-7B/", "Qwen2.5-7B"),
        ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
        ("/m/Llama-3.1-8B-Instruct-4bit", "Llama-3.1-8B-Instruct-4bit"),
        ("model.GGUF", "model"),
    ],
)
def test_model_id_keeps_dots_that_are_not_file_extensions(arg, expected):
    assert derive_model_id(arg) == expected


def test_directory_with_config_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_subdirectory_falls_back_to_parent_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    assert resolve_model_path(str(tmp_path / "sub")) == tmp_path


def test_file_inside_model_directory_means_the_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model_path(str(tmp_path / "model.safetensors")) == tmp_path


def test_gguf_file_is_used_directly(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model_path(str(f)) == f


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_directory_without_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        resolve_model_path(str(tmp_path))
