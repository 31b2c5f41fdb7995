"""tools/preprocess_data.py output checked by an independent reader of Megatron's format."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.core.tokenizer import ByteTokenizer, NullTokenizer
from tests.unit_tests.data.megatron_format import read_megatron_pair
from tools.preprocess_data import preprocess

REPO_ROOT = Path(__file__).resolve().parents[3]

JSON_DOCUMENTS = ["first document", "héllo wörld ✓ 🙂", "x", "line one\nline two\n"]
TEXT_DOCUMENTS = {"a.txt": "plain file A\n", "sub/b.txt": "naïve café — B", "sub/c.md": "C!"}


def _write_corpus(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "docs.jsonl", "w", encoding="utf-8") as handle:
        for text in JSON_DOCUMENTS:
            handle.write(json.dumps({"text": text, "other": text.upper()}) + "\n")
    for name, text in TEXT_DOCUMENTS.items():
        (root / "text" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "text" / name).write_text(text, encoding="utf-8")


def _expected_byte_documents() -> list[list[int]]:
    # Order: the JSONL lines, then the directory's files sorted (a.txt, sub/b.txt, sub/c.md).
    texts = JSON_DOCUMENTS + [TEXT_DOCUMENTS[name] for name in sorted(TEXT_DOCUMENTS)]
    return [list(text.encode("utf-8")) + [256] for text in texts]


def test_script_output_round_trips_through_independent_reader(tmp_path):
    _write_corpus(tmp_path / "corpus")
    command = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        str(tmp_path / "corpus" / "docs.jsonl"),
        str(tmp_path / "corpus" / "text"),
        "--json-keys",
        "text",
        "--output-prefix",
        str(tmp_path / "out" / "corpus"),
        "--tokenizer-type",
        "ByteTokenizer",
        "--append-eod",
        "--workers",
        "2",
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    prefix = str(tmp_path / "out" / "corpus_text_document")
    assert result.stdout.strip().splitlines()[-1] == prefix
    assert "docs/s" in result.stderr and "MB/s" in result.stderr
    code, document_indices, documents = read_megatron_pair(prefix)
    assert code == 8  # uint16: the byte vocabulary with eod has 257 ids
    expected = _expected_byte_documents()
    assert document_indices.tolist() == list(range(len(expected) + 1))
    assert [document.tolist() for document in documents] == expected
    assert sorted(os.listdir(tmp_path / "out")) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]  # no temporary files left behind

    # The library function with one worker writes byte-identical files.
    written = preprocess(
        [str(tmp_path / "corpus" / "docs.jsonl"), str(tmp_path / "corpus" / "text")],
        output_prefix=str(tmp_path / "lib" / "corpus"),
        tokenizer=ByteTokenizer(),
        append_eod=True,
        workers=1,
        show_progress=False,
    )
    assert written == {"text": str(tmp_path / "lib" / "corpus_text_document")}
    for suffix in (".bin", ".idx"):
        assert Path(prefix + suffix).read_bytes() == Path(written["text"] + suffix).read_bytes()


def test_multiple_json_keys_glob_and_two_workers(tmp_path):
    _write_corpus(tmp_path / "corpus")
    written = preprocess(
        [str(tmp_path / "corpus" / "*.jsonl")],
        output_prefix=str(tmp_path / "out" / "multi"),
        tokenizer=ByteTokenizer(),
        json_keys=["text", "other"],
        workers=2,  # spawned workers from inside a process that already runs torch threads
        show_progress=False,
    )
    for key, transform in (("text", str), ("other", str.upper)):
        _, _, documents = read_megatron_pair(written[key])
        expected = [list(transform(text).encode("utf-8")) for text in JSON_DOCUMENTS]
        assert [document.tolist() for document in documents] == expected


@pytest.mark.parametrize(("vocab_size", "code"), [(200, 1), (65536, 8), (70000, 4)])
def test_token_dtype_is_smallest_that_fits(tmp_path, vocab_size, code):
    corpus = tmp_path / "ids.jsonl"
    documents = [[1, vocab_size - 2, 7], [vocab_size - 3, 0]]
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(map(str, ids))}) + "\n" for ids in documents)
    )
    written = preprocess(
        [str(corpus)],
        output_prefix=str(tmp_path / "ids"),
        tokenizer=NullTokenizer(vocab_size),
        append_eod=True,
        show_progress=False,
    )
    found_code, _, found = read_megatron_pair(written["text"])
    assert found_code == code
    assert [document.tolist() for document in found] == [
        ids + [vocab_size - 1] for ids in documents
    ]


def test_plain_progress_lines_without_tqdm(tmp_path, monkeypatch, capsys):
    _write_corpus(tmp_path / "corpus")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    preprocess(
        [str(tmp_path / "corpus" / "docs.jsonl")],
        output_prefix=str(tmp_path / "out" / "plain"),
        tokenizer=ByteTokenizer(),
        log_interval=2,
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" (")[0] for line in lines[:-1]] == [
        "processed 2 documents",
        "processed 4 documents",
    ]
    assert "docs/s" in lines[0] and "MB/s" in lines[0]
    num_bytes = sum(len(text.encode("utf-8")) for text in JSON_DOCUMENTS)
    assert lines[-1].startswith(f"done: 4 documents, {num_bytes} bytes in ")


def test_empty_corpus_is_an_error_and_leaves_no_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="the corpus is empty: 0 documents"):
        preprocess(
            [str(tmp_path / "empty.jsonl")],
            output_prefix=str(tmp_path / "out" / "empty"),
            tokenizer=ByteTokenizer(),
            show_progress=False,
        )
    assert os.listdir(tmp_path / "out") == []
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="holds no files: the corpus is empty"):
        preprocess(
            [str(tmp_path / "emptydir")],
            output_prefix=str(tmp_path / "out" / "empty"),
            tokenizer=ByteTokenizer(),
        )


def test_bad_inputs_name_the_problem(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "no text key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no string field 'text'.*--json-keys"):
        preprocess(
            [str(tmp_path / "bad.jsonl")],
            output_prefix=str(tmp_path / "bad"),
            tokenizer=ByteTokenizer(),
            show_progress=False,
        )
    with pytest.raises(FileNotFoundError, match="--input .*missing.txt' is not a file"):
        preprocess([str(tmp_path / "missing.txt")], output_prefix="x", tokenizer=ByteTokenizer())


def test_script_missing_tokenizer_file_exits_with_flag_name(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    missing = str(tmp_path / "vocab.json")
    command = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        str(tmp_path / "a.txt"),
        "--output-prefix",
        str(tmp_path / "out"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        missing,
        "--merge-file",
        str(tmp_path / "merges.txt"),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{missing!r} does not exist; pass the local vocab.json with --vocab-file" in (
        result.stderr
    )


# 2000 UTF-8 lines (40 kB, past the decoder's read-ahead, so documents are written before the
# error), then "café" in Latin-1 on line 2001: its é (0xe9, column 14) is not UTF-8.
BAD_LINE = 2001


def _write_latin1_jsonl(path: Path) -> None:
    good = b"".join(b'{"text": "line %05d"}\n' % index for index in range(BAD_LINE - 1))
    path.write_bytes(good + b'{"text": "caf\xe9"}\n' + b'{"text": "after"}\n')


def test_script_non_utf8_jsonl_names_file_and_line_and_leaves_no_files(tmp_path):
    corpus = tmp_path / "latin1.jsonl"
    _write_latin1_jsonl(corpus)
    command = [
        sys.executable,
        "tools/preprocess_data.py",
        "--input",
        str(corpus),
        "--output-prefix",
        str(tmp_path / "out" / "corpus"),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert (
        f"error: {corpus}:{BAD_LINE}: byte 0xe9 at column 14 is not UTF-8; re-encode --input "
        "as UTF-8" in result.stderr
    )
    assert "Traceback" not in result.stderr
    done = [line for line in result.stderr.splitlines() if line.startswith("done: ")]
    assert int(done[0].split()[1]) > 1000  # documents were written before the bad line ...
    assert os.listdir(tmp_path / "out") == []  # ... and the temporary .bin/.idx were removed


@pytest.mark.parametrize("workers", [1, 2])
def test_non_utf8_jsonl_error_with_workers(tmp_path, workers):
    corpus = tmp_path / "latin1.jsonl"
    _write_latin1_jsonl(corpus)
    message = rf"latin1\.jsonl:{BAD_LINE}: byte 0xe9 at column 14 is not UTF-8"
    with pytest.raises(ValueError, match=message):
        preprocess(
            [str(corpus)],
            output_prefix=str(tmp_path / "out" / "corpus"),
            tokenizer=ByteTokenizer(),
            workers=workers,
            show_progress=False,
        )
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("how", "preset", "expected"),
    [("script", None, "1"), ("script", "3", "3"), ("import", None, "None")],
)
def test_openblas_threads_default_to_one_only_when_run_as_a_script(how, preset, expected):
    # The script needs no BLAS threads; a program importing the module keeps its own setting.
    run = (
        "import runpy, sys\n"
        "sys.argv = ['preprocess_data.py', '--help']\n"
        "try:\n"
        "    runpy.run_path('tools/preprocess_data.py', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        if how == "script"
        else "import tools.preprocess_data\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        environment["OPENBLAS_NUM_THREADS"] = preset
    environment["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run(
        [sys.executable, "-c", run + "import os; print(os.environ.get('OPENBLAS_NUM_THREADS'))"],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip().splitlines()[-1] == expected
