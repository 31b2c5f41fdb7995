"""Parse-time checks of the paths that flags name, so a bad path fails before training.

Each check raises ValueError with a message naming the flag and the fix; argument_checks.py turns it
into exit status 2. Without them, --save pointing at a file failed only at the first checkpoint,
after training, and --tensorboard-dir or --data-cache-path with a raw FileExistsError.
"""

from __future__ import annotations

import os

TOKENIZER_JSON = "tokenizer.json"


def check_output_dir(path: str, *, flag: str) -> None:
    """`path` is a directory that training creates or writes into.

    It must not be an existing non-directory (file or broken link), and its nearest existing
    ancestor (itself when it exists) must be a directory this user can write into.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(
            f"{flag} {path} exists and is not a directory; pass a directory, or a path that "
            "does not exist yet (it is created)"
        )
    ancestor = os.path.abspath(path)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(
            f"{flag} {path} cannot be created: {ancestor} is a file, not a directory; pass a "
            "path outside it"
        )
    # Searching (X) is needed as well as W to create entries in a directory.
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(
            f"{flag} {path}: directory {ancestor} is not writable by this user; pass a "
            "writable location or fix its permissions"
        )


def check_input_file(path: str, *, flag: str) -> None:
    """`path` is a local file that is read (a tokenizer's vocabulary, merges or model).

    --tokenizer-model also accepts the directory that holds a tokenizer.json, as
    HuggingFaceTokenizer does.
    """
    if os.path.isdir(path):
        if flag == "--tokenizer-model":
            if not os.path.isfile(os.path.join(path, TOKENIZER_JSON)):
                raise ValueError(
                    f"--tokenizer-model {path} is a directory without a {TOKENIZER_JSON}; pass "
                    f"the {TOKENIZER_JSON} file itself or the directory that holds it"
                )
            return
        raise ValueError(f"{flag} {path} is a directory; pass the file itself")
    if not os.path.isfile(path):
        raise ValueError(
            f"{flag} {path}: no such file; pass the path of a local file (nothing is downloaded)"
        )
