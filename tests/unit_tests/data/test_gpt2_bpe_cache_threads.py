"""GPT-2 BPE preprocessing speed-ups keep the ids: tiktoken's rewritten split regex, the on-disk
cache of checked tables (invalidated by any change of vocab.json or merges.txt) and --workers as
threads for tokenizers that release the GIL."""

import json
import os

import pytest

from megatron.core.tokenizer import GPT2BPETokenizer, gpt2_bpe_tiktoken
from tests.unit_tests.data.test_gpt2_bpe_fast import TRAIN_TEXT, VARIED_TEXTS
from tools import preprocess_data
from tools.preprocess_data import preprocess

tiktoken = pytest.importorskip("tiktoken", reason="the fast GPT-2 encoder needs tiktoken")
tokenizers = pytest.importorskip("tokenizers", reason="training the test vocab needs tokenizers")

# GPT-2's split pattern as published (with the lookahead alternative tried one by one).
GPT2_PUBLISHED_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)


def _train(directory, texts, vocab_size):
    directory.mkdir(parents=True, exist_ok=True)
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"]
    )
    trainer.save_model(str(directory))
    return str(directory / "vocab.json"), str(directory / "merges.txt")


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("gpt2_bpe"), TRAIN_TEXT, 700)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(gpt2_bpe_tiktoken.CACHE_ENV, str(directory))
    return directory


@pytest.fixture
def build_calls(monkeypatch):
    """Counts the vocabulary checks (build_tables runs) while still running them."""
    calls = []
    build_tables = gpt2_bpe_tiktoken.build_tables

    def counting_build_tables(**kwargs):
        calls.append(1)
        return build_tables(**kwargs)

    monkeypatch.setattr(gpt2_bpe_tiktoken, "build_tables", counting_build_tables)
    return calls


def _code_point_text():
    code_points = [cp for cp in range(0x3100) if not 0xD800 <= cp <= 0xDFFF]
    return "".join(f"a{c}b {c}{c} 1{c}2 x {c}\n{c}  {c}" for c in map(chr, code_points))


def test_rewritten_split_pattern_gives_the_published_patterns_ids(vocab_files):
    tokenizer = GPT2BPETokenizer(*vocab_files)
    assert tokenizer.encoder_name == "tiktoken"
    ranks = tokenizer._tiktoken_tables[0]
    encodings = [
        tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        for name, pattern in (
            ("published", GPT2_PUBLISHED_PATTERN),
            ("rewritten", gpt2_bpe_tiktoken.GPT2_SPLIT_PATTERN),
        )
    ]
    assert gpt2_bpe_tiktoken.GPT2_SPLIT_PATTERN != GPT2_PUBLISHED_PATTERN
    texts = VARIED_TEXTS + ["it's 'll 'LL ''s 're've'm'd 'x", "a\n\n \t b  \n", _code_point_text()]
    for text in texts:
        published, rewritten = (encoding.encode_ordinary(text) for encoding in encodings)
        assert rewritten == published, repr(text[:80])


def test_cache_is_written_once_and_read_back(vocab_files, cache_dir, build_calls):
    first = GPT2BPETokenizer(*vocab_files)
    assert first.encoder_name == "tiktoken"
    assert len(build_calls) == 1
    (entry,) = os.listdir(cache_dir)
    assert entry.startswith(f"v{gpt2_bpe_tiktoken.CACHE_VERSION}-") and entry.endswith(".marshal")
    second = GPT2BPETokenizer(*vocab_files)
    assert second.encoder_name == "tiktoken"
    assert len(build_calls) == 1  # read from the cache: no second check
    assert second._tiktoken_tables[0] == first._tiktoken_tables[0]
    python = GPT2BPETokenizer(*vocab_files, encoder="python")
    for text in VARIED_TEXTS:
        assert second.tokenize(text) == python.tokenize(text), repr(text)
    # With cached tables merges.txt is parsed only when the Python encoder needs it.
    assert second._bpe_ranks is None
    assert second.tokenize_python(VARIED_TEXTS[4]) == python.tokenize(VARIED_TEXTS[4])
    assert second.bpe_ranks == python.bpe_ranks and len(python.bpe_ranks) == 234


def test_cache_misses_when_either_file_changes(vocab_files, tmp_path, cache_dir, build_calls):
    vocab_file, merge_file = vocab_files
    original = GPT2BPETokenizer(vocab_file, merge_file)
    assert original.encoder_name == "tiktoken"
    vocab = json.loads(open(vocab_file, encoding="utf-8").read())
    merges = open(merge_file, encoding="utf-8").read()
    text = "The quick brown fox"
    assert original.tokenize(text) == [
        vocab[token] for token in ("The", "Ġquick", "Ġbrown", "Ġfox")
    ]
    # One more merge, of the first two tokens of " quickbrown", with the next id: a stale
    # cache would not know it.
    decoder = {token_id: token for token, token_id in vocab.items()}
    first, second = (decoder[token_id] for token_id in original.tokenize(" quickbrown")[:2])
    assert first + second not in vocab
    longer = dict(vocab, **{first + second: len(vocab)})
    (tmp_path / "longer.json").write_text(json.dumps(longer), encoding="utf-8")
    (tmp_path / "longer.txt").write_text(merges + f"{first} {second}\n", encoding="utf-8")
    with_merge = GPT2BPETokenizer(str(tmp_path / "longer.json"), str(tmp_path / "longer.txt"))
    assert with_merge.encoder_name == "tiktoken"
    assert len(build_calls) == 2 and len(os.listdir(cache_dir)) == 2
    assert with_merge.tokenize(" quickbrown")[0] == len(vocab)
    python = GPT2BPETokenizer(
        str(tmp_path / "longer.json"), str(tmp_path / "longer.txt"), encoder="python"
    )
    assert with_merge.tokenize(" quickbrown") == python.tokenize(" quickbrown")
    # The same merges with two ids swapped (vocab.json alone changes): ids follow the file,
    # through a rank -> id table since the merged ids no longer follow the merge order.
    swapped = dict(vocab)
    swapped["<|endoftext|>"], swapped["Ġquick"] = vocab["Ġquick"], vocab["<|endoftext|>"]
    (tmp_path / "swapped.json").write_text(json.dumps(swapped), encoding="utf-8")
    moved = GPT2BPETokenizer(str(tmp_path / "swapped.json"), merge_file)
    assert moved.encoder_name == "tiktoken"
    assert len(build_calls) == 3 and len(os.listdir(cache_dir)) == 3
    assert moved._tiktoken_tables[1] is not None
    assert moved.eod == vocab["Ġquick"]
    assert moved.tokenize(text) == [
        vocab["The"],
        vocab["<|endoftext|>"],
        vocab["Ġbrown"],
        vocab["Ġfox"],
    ]
    # Each of the three reads back from the cache with no further check.
    for files in (vocab_files, (str(tmp_path / "swapped.json"), merge_file)):
        assert GPT2BPETokenizer(*files).tokenize(text) == GPT2BPETokenizer(
            *files, encoder="python"
        ).tokenize(text)
    assert len(build_calls) == 3


def test_corrupt_cache_entry_is_checked_again_and_rewritten(vocab_files, cache_dir, build_calls):
    reference = GPT2BPETokenizer(*vocab_files)
    assert reference.encoder_name == "tiktoken"
    (entry,) = cache_dir.iterdir()
    good = entry.read_bytes()
    for damaged in (good[: len(good) // 2], b"not marshal", b""):
        entry.write_bytes(damaged)
        tokenizer = GPT2BPETokenizer(*vocab_files)
        assert tokenizer.encoder_name == "tiktoken"
        assert tokenizer.tokenize(VARIED_TEXTS[7]) == reference.tokenize(VARIED_TEXTS[7])
        assert entry.read_bytes() == good
    assert len(build_calls) == 4


def test_cache_off_writes_nothing(vocab_files, tmp_path, monkeypatch, build_calls):
    monkeypatch.setenv(gpt2_bpe_tiktoken.CACHE_ENV, "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for _ in range(2):
        assert GPT2BPETokenizer(*vocab_files).encoder_name == "tiktoken"
    assert len(build_calls) == 2
    assert os.listdir(tmp_path) == []


def test_default_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv(gpt2_bpe_tiktoken.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gpt2_bpe_tiktoken.cache_dir() == str(
        tmp_path / "xdg" / "megatron-fp8" / "gpt2_bpe_tiktoken"
    )
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / ".cache" / "megatron-fp8" / "gpt2_bpe_tiktoken"
    assert gpt2_bpe_tiktoken.cache_dir() == str(expected)
    # No home directory at all: no cache (rather than a folder named "~" in the working one).
    monkeypatch.setattr(gpt2_bpe_tiktoken.os.path, "expanduser", lambda path: path)
    assert gpt2_bpe_tiktoken.cache_dir() is None
    assert gpt2_bpe_tiktoken.cache_path("0" * 64) is None


def test_unsuitable_vocabulary_is_not_cached(tmp_path, cache_dir):
    from megatron.core.tokenizer.gpt2_bpe import bytes_to_unicode

    # "b c" ranks first, so GPT-2 never builds "abc" from "ab c": tiktoken would (see
    # test_gpt2_bpe_fast.py); such files stay on the Python encoder and leave no cache entry.
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    symbols = list(bytes_to_unicode().values()) + [left + right for left, right in merges]
    vocab = {symbol: index for index, symbol in enumerate(symbols + ["<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{left} {right}" for left, right in merges]
    (tmp_path / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tokenizer.encoder_name == "python"
    assert not cache_dir.exists() or os.listdir(cache_dir) == []


def _write_corpus(path, documents):
    with open(path, "w", encoding="utf-8") as handle:
        for text in documents:
            handle.write(json.dumps({"text": text}) + "\n")


def _preprocess_bytes(corpus, prefix, tokenizer, workers):
    (written,) = preprocess(
        [str(corpus)],
        output_prefix=str(prefix),
        tokenizer=tokenizer,
        append_eod=True,
        workers=workers,
        show_progress=False,
    ).values()
    return [open(f"{written}.{suffix}", "rb").read() for suffix in ("bin", "idx")]


@pytest.mark.parametrize("workers", [2, 3])
def test_threads_processes_cache_and_python_write_identical_files(
    vocab_files, tmp_path, cache_dir, monkeypatch, workers
):
    # Many small chunks, so that the in-flight window fills, drains and refills.
    monkeypatch.setattr(preprocess_data, "_THREAD_CHUNK_DOCUMENTS", 3)
    documents = VARIED_TEXTS * 5
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, documents)
    python = GPT2BPETokenizer(*vocab_files, encoder="python")
    expected = _preprocess_bytes(corpus, tmp_path / "python", python, 1)
    uncached = GPT2BPETokenizer(*vocab_files)  # checks and writes the cache
    cached = GPT2BPETokenizer(*vocab_files)  # reads it
    assert uncached.tokenize_releases_gil and cached.tokenize_releases_gil
    assert not python.tokenize_releases_gil
    assert _preprocess_bytes(corpus, tmp_path / "one", uncached, 1) == expected
    contexts = []
    get_context = preprocess_data.multiprocessing.get_context

    def recording_get_context(*args, **kwargs):
        contexts.append(args)
        return get_context(*args, **kwargs)

    monkeypatch.setattr(preprocess_data.multiprocessing, "get_context", recording_get_context)
    assert _preprocess_bytes(corpus, tmp_path / "many", cached, workers) == expected
    # Two workers are threads of this process; more are (spawned) processes.
    assert contexts == ([] if workers == 2 else [("spawn",)])
    expected_tokens = sum(len(python.tokenize(text)) + 1 for text in documents)
    assert len(expected[0]) == 2 * expected_tokens  # uint16 ids for a 700-token vocabulary


def test_thread_workers_report_the_bad_line_and_leave_no_files(vocab_files, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess_data, "_THREAD_CHUNK_DOCUMENTS", 2)
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus, VARIED_TEXTS)
    with open(corpus, "a", encoding="utf-8") as handle:
        handle.write('{"text": "unterminated\n')
        handle.write(json.dumps({"text": "after"}) + "\n")
    bad_line = len(VARIED_TEXTS) + 1
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=rf"corpus\.jsonl:{bad_line} is not valid JSON"):
        preprocess(
            [str(corpus)],
            output_prefix=str(tmp_path / "out" / "corpus"),
            tokenizer=GPT2BPETokenizer(*vocab_files),
            workers=2,
            show_progress=False,
        )
    assert os.listdir(tmp_path / "out") == []
