"""`trinity_trl.hf_tokenizer`: pad-token and Gemma-2 eos corrections, kwargs forwarding; `tool_chat_template`."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from trinity_trl import hf_tokenizer

END_OF_TURN = "<end_of_turn>"


def _messages(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in record if text in str(w.message)]


def _save(tokenizer, path: Path) -> Path:
    path.mkdir(parents=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def no_pad_dir(tiny_tokenizer, tmp_path: Path) -> Path:
    tiny_tokenizer.pad_token = None
    path = _save(tiny_tokenizer, tmp_path / "no_pad")
    assert AutoTokenizer.from_pretrained(path).pad_token_id is None  # the fixture really lacks a pad token
    return path


def _gemma2_dir(tokenizer, tmp_path: Path, with_end_of_turn: bool, name: str = "tiny-Gemma-2-it") -> Path:
    if with_end_of_turn:
        tokenizer.add_tokens([AddedToken(END_OF_TURN, special=True)])
    return _save(tokenizer, tmp_path / name)


def test_missing_pad_token_becomes_eos_with_warning(no_pad_dir: Path):
    with pytest.warns(UserWarning, match="no pad token") as record:
        tok = hf_tokenizer(str(no_pad_dir))
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == tok.eos_token_id is not None
    assert "<|im_end|>" in _messages(record.list, "no pad token")[0]
    assert tok(["a", "a b c"], padding=True).input_ids[0][0] == tok.eos_token_id  # left padding uses it


def test_missing_pad_token_left_alone_when_not_correcting(no_pad_dir: Path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tok = hf_tokenizer(no_pad_dir, correct_pad_token=False)
    assert tok.pad_token_id is None
    assert not _messages(record, "pad token")


def test_existing_pad_token_unchanged_and_silent(tiny_tokenizer_dir: str):
    expected = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tok = hf_tokenizer(tiny_tokenizer_dir)
    assert (tok.pad_token, tok.pad_token_id) == (expected.pad_token, expected.pad_token_id) == ("<|endoftext|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == (
        expected.eos_token,
        expected.eos_token_id,
    )
    assert not [w for w in record if issubclass(w.category, UserWarning)], [str(w.message) for w in record]


def test_no_pad_and_no_eos_is_an_error(tiny_tokenizer, tmp_path: Path):
    tiny_tokenizer.pad_token = None
    tiny_tokenizer.eos_token = None
    path = _save(tiny_tokenizer, tmp_path / "bare")
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        hf_tokenizer(path)
    assert hf_tokenizer(path, correct_pad_token=False).pad_token is None


def test_gemma2_eos_switched_to_end_of_turn(tiny_tokenizer, tmp_path: Path):
    path = _gemma2_dir(tiny_tokenizer, tmp_path, with_end_of_turn=True)
    end_of_turn_id = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(END_OF_TURN)
    with pytest.warns(UserWarning, match="Gemma-2") as record:
        tok = hf_tokenizer(str(path))
    assert tok.eos_token == END_OF_TURN
    assert tok.eos_token_id == end_of_turn_id
    assert f"id {end_of_turn_id}" in _messages(record.list, "Gemma-2")[0]
    assert tok.pad_token == "<|endoftext|>"  # the pad token is not touched


def test_gemma2_eos_kept_when_not_correcting(tiny_tokenizer, tmp_path: Path):
    path = _gemma2_dir(tiny_tokenizer, tmp_path, with_end_of_turn=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tok = hf_tokenizer(path, correct_gemma2=False)
    assert tok.eos_token == "<|im_end|>"
    assert not _messages(record, "Gemma-2")


def test_gemma2_name_match_is_case_insensitive_and_not_fooled_by_gemma(tiny_tokenizer, tmp_path: Path):
    path = _gemma2_dir(tiny_tokenizer, tmp_path, with_end_of_turn=True, name="GEMMA-2-2B-IT")
    with pytest.warns(UserWarning, match="Gemma-2"):
        assert hf_tokenizer(path).eos_token == END_OF_TURN
    other = shutil.copytree(path, tmp_path / "gemma-3-1b-it")  # same vocabulary, not a Gemma-2 name
    assert hf_tokenizer(other).eos_token == "<|im_end|>"


@pytest.mark.parametrize("with_model_config", [False, True], ids=["no-unk", "unk-token"])
def test_gemma2_without_end_of_turn_is_an_error(tiny_tokenizer, tmp_path: Path, with_model_config: bool):
    path = _gemma2_dir(tiny_tokenizer, tmp_path, with_end_of_turn=False)
    if with_model_config:
        # Next to a Qwen2 config, transformers loads `Qwen2Tokenizer`, which has an unk token: unknown tokens then
        # map to the unk id instead of None, and must still be detected.
        (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": len(tiny_tokenizer)}))
        assert AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(END_OF_TURN) is not None
    with pytest.raises(ValueError, match="no '<end_of_turn>' token"):
        hf_tokenizer(path)
    assert hf_tokenizer(path, correct_gemma2=False).eos_token == "<|im_end|>"


def test_kwargs_are_forwarded(tiny_tokenizer_dir: str):
    assert AutoTokenizer.from_pretrained(tiny_tokenizer_dir).padding_side == "left"
    tok = hf_tokenizer(tiny_tokenizer_dir, padding_side="right", model_max_length=64)
    assert tok.padding_side == "right"
    assert tok.model_max_length == 64


def test_model_directory_loads(tiny_model_dir: str):
    tok = hf_tokenizer(tiny_model_dir)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.chat_template is not None


# --------------------------------------------------------------------------- tool_chat_template (issue 27 item 6)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = [
    {"role": "user", "content": "What is 3 times 4?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "3*4"}}}],
    },
    {"role": "tool", "content": "12"},
]


def test_tool_chat_template_renders_tools_and_calls(tiny_tokenizer, tiny_model_dir: str):
    from trl.chat_template_utils import supports_tool_calling

    from trinity_trl import tool_chat_template

    assert not supports_tool_calling(tiny_tokenizer)  # the tiny model's ChatML, like SmolLM2's, drops tool calls
    same = tool_chat_template(tiny_tokenizer)
    assert same is tiny_tokenizer and supports_tool_calling(same)
    text = same.apply_chat_template(CALL, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "calc"' in text and "<tool_call>" in text and "12" in text and text.startswith("<|im_start|>")
    loaded = tool_chat_template(tiny_model_dir)  # a path: loaded as the RL trainers load it
    assert supports_tool_calling(loaded) and loaded.padding_side == "left" and loaded.truncation_side == "left"


def test_tool_chat_template_refuses_what_cannot_work(tiny_tokenizer):
    from trinity_trl import tool_chat_template

    with pytest.raises(ValueError, match="template must be one of \\['qwen2_5'\\], got 'llama9'"):
        tool_chat_template(tiny_tokenizer, "llama9")
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    renamed = tiny_tokenizer.backend_tokenizer.to_str().replace("<|im_start|>", "<|start|>")
    other = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(renamed))
    with pytest.raises(ValueError, match="this tokenizer has no <\\|im_start\\|>"):
        tool_chat_template(other)
