"""TikTokenizer and the SentencePiece tokenizers from tiny local files: ids, round trips, errors."""

import base64
import io
import json
import pickle
import sys

import pytest

from megatron.core.tokenizer import (
    GPTSentencePieceTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    build_tokenizer,
)
from tools.preprocess_data import preprocess

# Ranks 256.. of the tiny tiktoken vocabulary: each merge's parts exist at a lower rank.
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b" world", b"12"]


def _write_tiktoken_vocab(path, tokens):
    entries = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": ""}
        for rank, token in enumerate(tokens)
    ]
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path)


@pytest.fixture
def tiktoken_vocab(tmp_path):
    pytest.importorskip("tiktoken", reason="TikTokenizer needs `pip install tiktoken`")
    tokens = [bytes([byte]) for byte in range(256)] + MERGES
    return _write_tiktoken_vocab(tmp_path / "vocab.json", tokens)


def test_tiktokenizer_ids_follow_megatron_layout(tiktoken_vocab):
    # 5 special ids first (<unk> <s> </s> <SPECIAL_3> <SPECIAL_4>), then rank + 5.
    tokenizer = build_tokenizer(
        tokenizer_type="TikTokenizer",
        tokenizer_model=tiktoken_vocab,
        tiktoken_pattern="v1",
        vocab_size=256 + len(MERGES) + 5,
        tiktoken_num_special_tokens=5,
    )
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.bos, tokenizer.unk) == (270, 2, 1, 0)
    assert tokenizer.special_tokens == {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<SPECIAL_3>": 3,
        "<SPECIAL_4>": 4,
    }
    # v1 splits "hello world!" into "hello", " world", "!": ranks 259, 263 and byte 33.
    assert tokenizer.tokenize("hello world!") == [259 + 5, 263 + 5, 33 + 5]
    # v1 takes digits one at a time (\p{N}), so the "12" merge never applies.
    assert tokenizer.tokenize("12") == [ord("1") + 5, ord("2") + 5]
    text = "héllo wörld </s> 🙂\n\n  x"
    ids = tokenizer.tokenize(text)
    assert tokenizer.eod not in ids  # a special token in the text is plain text
    assert tokenizer.detokenize(ids) == text
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(text) == ids


def test_tiktokenizer_v2_pattern_and_custom_special_tokens(tiktoken_vocab):
    tokenizer = TikTokenizer(
        tiktoken_vocab,
        pattern="v2",
        vocab_size=256 + len(MERGES) + 4,
        num_special_tokens=4,
        special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
    )
    assert (tokenizer.eod, tokenizer.bos, tokenizer.unk) == (1, 0, 2)
    # v2 splits "Hello" as one word ("H" upper + "ello" lower); "hello" merges fully.
    assert tokenizer.tokenize("hello") == [259 + 4]
    assert tokenizer.tokenize("Hello") == [ord("H") + 4, ord("e") + 4, 257 + 4, ord("o") + 4]
    assert tokenizer.detokenize(tokenizer.tokenize("Hello world")) == "Hello world"


def test_tiktokenizer_errors_name_the_flag(tiktoken_vocab, tmp_path):
    size = 256 + len(MERGES) + 5
    with pytest.raises(ValueError, match="holds 265 tokens.*--vocab-size 270"):
        TikTokenizer(tiktoken_vocab, pattern="v1", num_special_tokens=5)  # default 2**17
    with pytest.raises(ValueError, match="must include"):
        TikTokenizer(tiktoken_vocab, pattern="v1", vocab_size=size, special_tokens=["<s>"])
    with pytest.raises(ValueError, match="--tiktoken-num-special-tokens 2"):
        TikTokenizer(tiktoken_vocab, pattern="v1", vocab_size=size, num_special_tokens=2)
    with pytest.raises(ValueError, match="needs --tiktoken-pattern"):
        build_tokenizer(tokenizer_type="TikTokenizer", tokenizer_model=tiktoken_vocab)
    bad = _write_tiktoken_vocab(tmp_path / "bad.json", [bytes([1])] + [b"x"] * 3)
    with pytest.raises(ValueError, match="entry 0 must be the single byte 0"):
        TikTokenizer(bad, pattern="v1", vocab_size=8, num_special_tokens=4)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        TikTokenizer(
            str(tmp_path / "missing.json"), pattern="v1", vocab_size=8, num_special_tokens=4
        )


def test_tiktokenizer_without_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match="pip install tiktoken"):
        TikTokenizer(str(tmp_path / "vocab.json"), pattern="v1")


SPM_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny sentencepiece model",
    "numbers 123 456 and café naïve",
] * 40


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    sentencepiece = pytest.importorskip(
        "sentencepiece", reason="SentencePiece tokenizers need `pip install sentencepiece`"
    )
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TEXT),
        model_writer=model,
        vocab_size=80,
        model_type="bpe",
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("spm") / "tiny.model"
    path.write_bytes(model.getvalue())
    return str(path), sentencepiece.SentencePieceProcessor(model_file=str(path))


def test_gpt_sentencepiece_uses_the_models_ids(spm_model):
    path, processor = spm_model
    tokenizer = build_tokenizer(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=path)
    # sentencepiece's defaults: unk 0, bos 1, eos 2, no pad; 80 pieces.
    assert (tokenizer.vocab_size, tokenizer.eod) == (80, 2) == (80, processor.eos_id())
    text = "hello world, the lazy fox"
    ids = tokenizer.tokenize(text)
    assert ids == processor.encode_as_ids(text) and len(ids) < len(text)
    assert tokenizer.detokenize(ids) == text
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(text) == ids


def test_sentencepiece_tokenizer_adds_megatron_special_tokens(spm_model):
    path, processor = spm_model
    tokenizer = build_tokenizer(tokenizer_type="SentencePieceTokenizer", tokenizer_model=path)
    # <CLS> <SEP> <EOD> <MASK> <PAD> are not pieces: appended as 80..84; <s> and </s> are the
    # model's bos/eos pieces (1, 2).
    assert tokenizer.special_tokens == {
        "<CLS>": 80,
        "<SEP>": 81,
        "<EOD>": 82,
        "<MASK>": 83,
        "<PAD>": 84,
        "<s>": 1,
        "</s>": 2,
    }
    assert (tokenizer.vocab_size, tokenizer.eod) == (85, 82)
    ids = tokenizer.tokenize("hello world<EOD>the fox</s>")
    expected = processor.encode_as_ids("hello world") + [82]
    expected += processor.encode_as_ids("the fox") + [2]
    assert ids == expected
    assert tokenizer.detokenize(ids) == "hello world <EOD> the fox </s> "
    assert tokenizer.tokenize("plain text") == processor.encode_as_ids("plain text")


def test_sentencepiece_missing_package_and_file(monkeypatch, tmp_path, spm_model):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        GPTSentencePieceTokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "junk.model"))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        GPTSentencePieceTokenizer(spm_model[0])


def test_preprocess_with_sentencepiece_and_two_workers(spm_model, tmp_path):
    path, processor = spm_model
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in SPM_TEXT[:3]))
    tokenizer = GPTSentencePieceTokenizer(path)
    (prefix,) = preprocess(
        [str(corpus)],
        output_prefix=str(tmp_path / "out"),
        tokenizer=tokenizer,
        append_eod=True,
        workers=2,
        show_progress=False,
    ).values()
    from megatron.core.datasets import IndexedDataset

    documents = IndexedDataset(prefix)
    assert [documents[index].tolist() for index in range(3)] == [
        processor.encode_as_ids(text) + [2] for text in SPM_TEXT[:3]
    ]


def _tiny_gpt_with(tokenizer_flags):
    from tests.unit_tests.training.common import TINY_GPT

    drop = {"--tokenizer-type", "NullTokenizer", "--vocab-size", "512"}
    return [arg for arg in TINY_GPT if arg not in drop] + tokenizer_flags


def test_tiktokenizer_flags_checked_at_parse_time(tiktoken_vocab, capsys):
    from megatron.training.flags.arguments import parse_args

    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tiktoken_vocab]
    with pytest.raises(SystemExit) as info:
        parse_args(_tiny_gpt_with(flags), world_size=1)
    assert info.value.code == 2
    assert "--tokenizer-type TikTokenizer needs --tiktoken-pattern." in capsys.readouterr().err
    flags += [
        "--tiktoken-pattern",
        "v2",
        "--vocab-size",
        "270",
        "--tiktoken-num-special-tokens",
        "5",
    ]
    args = parse_args(_tiny_gpt_with(flags), world_size=1)
    assert (args.tiktoken_pattern, args.vocab_size, args.tiktoken_num_special_tokens) == (
        "v2",
        270,
        5,
    )
    assert args.tiktoken_special_tokens is None


def test_pretrain_two_iterations_on_a_tiktokenizer_corpus(tiktoken_vocab, tmp_path):
    from tests.unit_tests.training.common import run_pretrain

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"hello world {i} " * 40}) + "\n" for i in range(30))
    )
    tokenizer_flags = [
        "--tokenizer-type",
        "TikTokenizer",
        "--tokenizer-model",
        tiktoken_vocab,
        "--tiktoken-pattern",
        "v1",
        "--vocab-size",
        "270",
        "--tiktoken-num-special-tokens",
        "5",
    ]
    tokenizer = build_tokenizer(
        tokenizer_type="TikTokenizer",
        tokenizer_model=tiktoken_vocab,
        tiktoken_pattern="v1",
        vocab_size=270,
        tiktoken_num_special_tokens=5,
    )
    (prefix,) = preprocess(
        [str(corpus)],
        output_prefix=str(tmp_path / "data"),
        tokenizer=tokenizer,
        append_eod=True,
        show_progress=False,
    ).values()
    argv = [arg for arg in _tiny_gpt_with(tokenizer_flags) if arg != "--mock-data"]
    argv += ["--data-path", prefix, "--split", "1", "--train-iters", "2"]
    result = run_pretrain(argv)
    assert sorted(result.losses) == [1, 2]
    # The first loss is about ln(vocab): 270 ids padded for the model.
    assert 4.5 < result.losses[1] < 6.5
