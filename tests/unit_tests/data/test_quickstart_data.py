"""scripts/prepare_quickstart_data.py: > 1e6 byte tokens of stdlib source, cached on rerun."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron.core.datasets import IndexedDataset
from megatron.core.tokenizer import ByteTokenizer

REPO_ROOT = Path(__file__).resolve().parents[3]


def _run(output_dir):
    command = [sys.executable, "scripts/prepare_quickstart_data.py", "--output-dir", output_dir]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_quickstart_corpus_round_trips_and_is_cached(tmp_path):
    output_dir = str(tmp_path / "quickstart")
    first = _run(output_dir)
    prefix = first.stdout.strip().splitlines()[-1]
    assert prefix == os.path.join(output_dir, "stdlib_text_document")
    dataset = IndexedDataset(prefix)
    assert dataset.num_tokens > 1_000_000
    assert str(dataset.dtype) == "uint16"
    with open(os.path.join(output_dir, "stdlib_manifest.json"), encoding="utf-8") as handle:
        files = [path for path, _, _ in json.load(handle)["files"]]
    assert len(dataset) == len(files) > 10
    assert not any(f"{os.sep}test{os.sep}" in path or "site-packages" in path for path in files)
    tokenizer = ByteTokenizer()
    for index, path in enumerate(files):
        document = dataset[index]
        assert int(document[-1]) == tokenizer.eod  # --append-eod
        assert tokenizer.detokenize(document.tolist()) == Path(path).read_text(encoding="utf-8")

    mtime = os.stat(prefix + ".bin").st_mtime_ns
    second = _run(output_dir)
    assert second.stdout.strip().splitlines()[-1] == prefix
    assert "reused cached" in second.stderr
    assert os.stat(prefix + ".bin").st_mtime_ns == mtime
