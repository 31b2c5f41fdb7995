"""GPT-2 BPE through tiktoken gives the pure-Python encoder's ids, and the same .bin/.idx bytes."""

import json
import pickle
import sys

import pytest

from megatron.core.tokenizer import GPT2BPETokenizer
from tests.unit_tests.data.megatron_format import read_megatron_pair
from tools.preprocess_data import preprocess

pytest.importorskip("tiktoken", reason="the fast GPT-2 encoder needs `pip install tiktoken`")
tokenizers = pytest.importorskip("tokenizers", reason="training the test vocab needs tokenizers")

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see 12,345 foxes (or 3.5).",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, Ελληνικά, русский, עברית, emoji 🙂🙂.",
    "def f(x):\n    return x ** 2  # squares\n\n\nclass A:\n\tpass\r\n",
    "numbers 0 1 22 333 4444 ² ³ ½ Ⅻ ١٢٣ and symbols @#$%^&*()[]{}<>|\\/~`",
] * 30

VARIED_TEXTS = [
    "",
    " ",
    "hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\r\nand   runs     of spaces\n\n\n",
    "contractions: it's don't we'll they've I'm she'd you're IT'S 'S 's's",
    "numbers: 0 007 3.14159 1,000,000 -42 +7 1e-9 ²³ ½ Ⅻ ١٢٣ 𝟙𝟚",
    "unicode: héllo wörld naïve café 日本語 中文 한국어 Ελληνικά русский עברית العربية",
    "emoji 🙂👍🏽👨‍👩‍👧 flags 🇫🇷 and ZWJ\u200d joiners, combining e\u0301 a\u0308",
    "specials <|endoftext|> <s></s> [CLS] @user #tag $x %y ^z &amp; *bold* ~tilde~ `code`",
    "separators \x1c\x1d\x1e\x1f and controls \x00\x01\x7f and NBSP\xa0 ideographic\u3000sp",
    "x \x1c\n\x1c  \x1c y \x1f  \x1f\t\x1e",
    "unicode spaces \u2000\u2001\u2002\u2028\u2029\u202f\u205f and \x85 next line",
    "mixed123abc ABC123 a1b2c3 __init__ snake_case CamelCase kebab-case",
    "punctuation!!! ??? ... --- ,,, ;;; ::: '''' \"\"\" ((( ))) <<<>>>",
    "x" * 300 + " " + "ab" * 200,
    "The lazy fox's 99 cafés!!  \n\n  done",
] + TRAIN_TEXT[:4]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2_bpe")
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        TRAIN_TEXT, vocab_size=700, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    trainer.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def test_tiktoken_and_python_encoders_give_the_same_ids(vocab_files):
    fast = GPT2BPETokenizer(*vocab_files)
    python = GPT2BPETokenizer(*vocab_files, encoder="python")
    assert (fast.encoder_name, python.encoder_name) == ("tiktoken", "python")
    for text in VARIED_TEXTS:
        ids = fast.tokenize(text)
        assert ids == python.tokenize(text), repr(text)
        assert python.detokenize(ids) == text
    # Merged tokens are used (not just bytes), and "<|endoftext|>" in text is plain text.
    assert len(fast.tokenize("The quick brown fox")) < len("The quick brown fox") // 2
    assert fast.eod not in fast.tokenize("a <|endoftext|> b")


def test_every_code_point_splits_alike(vocab_files):
    # Letters, numbers and whitespace are spelled out as ranges in the Python regex and are
    # Unicode properties in tiktoken's: every assigned plane (0-3) must agree.
    fast = GPT2BPETokenizer(*vocab_files)
    python = GPT2BPETokenizer(*vocab_files, encoder="python")
    # Every code point to U+3100 (all whitespace, Latin, Greek, Cyrillic, Arabic, Indic, ...),
    # then every 29th up to plane 3: the Python encoder is slow on text that never repeats.
    code_points = list(range(0x3100)) + list(range(0x3100, 0x40000, 29))
    code_points = [cp for cp in code_points if not 0xD800 <= cp <= 0xDFFF]
    chunk = 4096
    for start in range(0, len(code_points), chunk):
        # Each code point inside a word, a number, a run of itself and whitespace runs.
        text = "".join(
            f"a{c}b {c}{c} 1{c}2 x {c}\n{c}  {c}"
            for c in map(chr, code_points[start : start + chunk])
        )
        assert fast.tokenize(text) == python.tokenize(text), hex(code_points[start])


def test_pickled_tokenizer_keeps_tiktoken_tables(vocab_files):
    fast = GPT2BPETokenizer(*vocab_files)
    assert fast.encoder_name == "tiktoken"
    copy = pickle.loads(pickle.dumps(fast))
    assert copy.encoder_name == "tiktoken"
    assert copy.tokenize(VARIED_TEXTS[7]) == fast.tokenize(VARIED_TEXTS[7])


def _write_bytes_vocab(tmp_path, merges):
    """vocab.json with the 256 byte symbols, the merges' results and <|endoftext|>."""
    from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode

    symbols = list(bytes_to_unicode().values()) + [left + right for left, right in merges]
    vocab = {symbol: index for index, symbol in enumerate(symbols)}
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{left} {right}" for left, right in merges]
    (tmp_path / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


@pytest.mark.parametrize("checker", ["tokenizers", "python"])
def test_merges_tiktoken_would_apply_differently_stay_in_python(tmp_path, monkeypatch, checker):
    if checker == "python":  # the check then runs GPT-2's algorithm in Python
        monkeypatch.setitem(sys.modules, "tokenizers", None)
    # "b c" ranks first, so GPT-2 turns "abc" into [a, bc] and never uses "ab c"; tiktoken would
    # merge a + bc because "abc" is a token. The check keeps this vocabulary in Python.
    vocab_file, merge_file, vocab = _write_bytes_vocab(
        tmp_path, [("b", "c"), ("a", "b"), ("ab", "c")]
    )
    auto = GPT2BPETokenizer(vocab_file, merge_file)
    assert auto.encoder_name == "python"
    assert auto.tokenize("abc") == [vocab["a"], vocab["bc"]]
    assert auto.tokenize("abd") == [vocab["ab"], vocab["d"]]
    with pytest.raises(ValueError, match="do not suit tiktoken"):
        GPT2BPETokenizer(vocab_file, merge_file, encoder="tiktoken").tokenize("abc")


def test_consistent_hand_made_merges_use_tiktoken_with_vocab_ids(tmp_path):
    vocab_file, merge_file, vocab = _write_bytes_vocab(tmp_path, [("a", "b"), ("ab", "c")])
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    assert tokenizer.encoder_name == "tiktoken"
    # "abcab" -> a b c a b -> ab c ab -> abc ab; " abc" -> Ġ abc (Ġ is the space byte).
    expected = [vocab["abc"], vocab["ab"], vocab["Ġ"], vocab["abc"]]
    assert tokenizer.tokenize("abcab abc") == expected
    python = GPT2BPETokenizer(vocab_file, merge_file, encoder="python")
    assert python.tokenize("abcab abc") == expected


def test_without_tiktoken_python_encoder_and_clear_message(vocab_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken now fails
    auto = GPT2BPETokenizer(*vocab_files)
    assert auto.encoder_name == "python"
    assert auto.tokenize("hello world") == GPT2BPETokenizer(
        *vocab_files, encoder="python"
    ).tokenize("hello world")
    with pytest.raises(ImportError, match="pip install tiktoken"):
        GPT2BPETokenizer(*vocab_files, encoder="tiktoken").tokenize("x")


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_identical_files_with_either_encoder(vocab_files, tmp_path, workers):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as handle:
        for text in VARIED_TEXTS * 3:
            handle.write(json.dumps({"text": text}) + "\n")
    outputs = {}
    for encoder in ("tiktoken", "python"):
        tokenizer = GPT2BPETokenizer(*vocab_files, encoder=encoder)
        (prefix,) = preprocess(
            [str(corpus)],
            output_prefix=str(tmp_path / encoder),
            tokenizer=tokenizer,
            append_eod=True,
            workers=workers if encoder == "tiktoken" else 1,
            show_progress=False,
        ).values()
        outputs[encoder] = [open(f"{prefix}.{suffix}", "rb").read() for suffix in ("bin", "idx")]
    assert outputs["tiktoken"] == outputs["python"]
    _, document_indices, documents = read_megatron_pair(str(tmp_path / "tiktoken_text_document"))
    assert len(documents) == len(VARIED_TEXTS) * 3
    python = GPT2BPETokenizer(*vocab_files, encoder="python")
    for text, document in zip(VARIED_TEXTS, documents):
        assert document.tolist() == python.tokenize(text) + [python.eod]
