"""Tokenizers: exact ids, round trips, missing-file errors that name the flag."""

import json
import sys

import pytest

from megatron.core.tokenizer import (
    ByteTokenizer,
    GPT2BPETokenizer,
    NullTokenizer,
    build_tokenizer,
)
from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode

MIXED_TEXT = "héllo wörld ✓ 日本語 🙂 it's 42 ²\n\ttabs  and  spaces  "


def test_byte_tokenizer_ids_and_round_trip():
    tokenizer = build_tokenizer(tokenizer_type="ByteTokenizer")
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert tokenizer.tokenize("aé") == [97, 195, 169]
    ids = tokenizer.tokenize(MIXED_TEXT)
    assert len(ids) == len(MIXED_TEXT.encode("utf-8"))
    assert tokenizer.detokenize(ids) == MIXED_TEXT
    # eod carries no text; a cut multi-byte character becomes U+FFFD rather than an error.
    assert tokenizer.detokenize([104, 105, 256, 33]) == "hi!"
    assert tokenizer.detokenize([97, 195]) == "a\ufffd"
    with pytest.raises(ValueError, match="token id 257 is outside the vocabulary"):
        tokenizer.detokenize([257])


def test_null_tokenizer():
    tokenizer = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=100)
    assert (tokenizer.vocab_size, tokenizer.eod) == (100, 99)
    assert tokenizer.tokenize("3 5\n7") == [3, 5, 7]
    assert tokenizer.detokenize([3, 5, 7]) == "3 5 7"
    with pytest.raises(ValueError, match="token id 100 is outside"):
        tokenizer.tokenize("1 100")
    with pytest.raises(ValueError, match="non-integer word"):
        tokenizer.tokenize("1 two")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer(tokenizer_type="NullTokenizer")


def test_unknown_tokenizer_type_lists_choices():
    with pytest.raises(ValueError, match="unknown --tokenizer-type 'Bert'.*ByteTokenizer"):
        build_tokenizer(tokenizer_type="Bert")


def _write_tiny_bpe(tmp_path):
    vocab = {
        **{symbol: index for index, symbol in enumerate("helo")},  # h0 e1 l2 o3
        "Ġ": 4,
        "w": 5,
        "r": 6,
        "d": 7,
        "he": 8,
        "ll": 9,
        "hell": 10,
        "hello": 11,
        "Ġw": 12,
        "or": 13,
        "Ġwor": 14,
        "<|endoftext|>": 15,
        "!": 16,
    }
    merges = ["#version: 0.2", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merge_file.write_text("\n".join(merges) + "\n", encoding="utf-8")
    return str(vocab_file), str(merge_file)


def test_gpt2_bpe_exact_ids_on_hand_made_vocab(tmp_path):
    vocab_file, merge_file = _write_tiny_bpe(tmp_path)
    tokenizer = build_tokenizer(
        tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file
    )
    assert (tokenizer.vocab_size, tokenizer.eod) == (17, 15)
    # "hello" merges fully by rank: h+e, l+l, he+ll, hell+o. " world" becomes Ġw, or, Ġwor and
    # then l, d stay (no "l d" merge). The space is byte 0x20, shown as "Ġ".
    assert tokenizer.tokenize("hello world!") == [11, 14, 2, 7, 16]
    assert tokenizer.tokenize("hel") == [8, 2]
    assert tokenizer.detokenize([11, 14, 2, 7, 16]) == "hello world!"
    with pytest.raises(ValueError, match="missing from --vocab-file"):
        tokenizer.tokenize("x")


def test_bytes_to_unicode_is_gpt2_map():
    mapping = bytes_to_unicode()
    assert len(set(mapping.values())) == 256
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ" and mapping[ord("A")] == "A"
    assert mapping[0] == chr(256) and mapping[0xAD] == chr(256 + 67)


def test_missing_tokenizer_files_name_path_and_flag(tmp_path):
    vocab_file, merge_file = _write_tiny_bpe(tmp_path)
    missing = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match=f"{missing}.*--vocab-file"):
        GPT2BPETokenizer(missing, merge_file)
    with pytest.raises(FileNotFoundError, match=f"{missing}.*--merge-file"):
        GPT2BPETokenizer(vocab_file, missing)
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file)
    pytest.importorskip("tokenizers", reason="HuggingFaceTokenizer needs `pip install tokenizers`")
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*--tokenizer-model"):
        build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll see 12345 foxes.",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🙂🙂 and ² ³ ½.",
    "def f(x):\n    return x ** 2  # squares\n\n\nclass A:\n    pass\n",
] * 20


def _train_hf_byte_bpe(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="needs `pip install tokenizers`")
    trainer_tokenizer = tokenizers.ByteLevelBPETokenizer()
    trainer_tokenizer.train_from_iterator(
        TRAIN_TEXT, vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    trainer_tokenizer.save_model(str(tmp_path))
    trainer_tokenizer.save(str(tmp_path / "tokenizer.json"))
    return trainer_tokenizer


def test_gpt2_bpe_matches_huggingface_byte_level_bpe(tmp_path):
    hf = _train_hf_byte_bpe(tmp_path)
    ours = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    texts = [
        MIXED_TEXT,
        "The lazy fox's 99 cafés!!  \n\n  done",
        "they'll've   x\ty  ½²³ Ⅻ",
        TRAIN_TEXT[2],
    ]
    for text in texts:
        expected = hf.encode(text).ids
        assert ours.tokenize(text) == expected, text
        assert ours.detokenize(expected) == text
    assert ours.eod == hf.token_to_id("<|endoftext|>")


def test_huggingface_tokenizer_from_tokenizer_json(tmp_path):
    hf = _train_hf_byte_bpe(tmp_path)
    tokenizer = build_tokenizer(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")
    )
    assert tokenizer.vocab_size == hf.get_vocab_size()
    assert tokenizer.eod == hf.token_to_id("<|endoftext|>")
    ids = tokenizer.tokenize(MIXED_TEXT)
    assert ids == hf.encode(MIXED_TEXT).ids
    assert tokenizer.detokenize(ids) == MIXED_TEXT
    # tokenizer_config.json's eos_token wins over the built-in candidates.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "e"}))
    from_dir = build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert from_dir.eod == hf.token_to_id("e")


def test_huggingface_tokenizer_without_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now fails
    with pytest.raises(ImportError, match="optional `tokenizers` package: pip install tokenizers"):
        build_tokenizer(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_tokenizers_satisfy_protocol_and_null_rejects_tiny_vocab():
    assert ByteTokenizer().eod == 256
    with pytest.raises(ValueError, match="vocab-size >= 2"):
        NullTokenizer(1)
