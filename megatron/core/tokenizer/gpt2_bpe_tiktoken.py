"""GPT-2 BPE through the optional `tiktoken` package, with the pure-Python encoder's ids.

tiktoken merges, in a pre-token, the adjacent pair whose concatenation has the lowest rank; GPT-2's
encoder merges the lowest-ranked pair listed in merges.txt. Ranking each merge's result by the
merge's line makes the two agree when (checked here, once per vocabulary):

- every merge makes a distinct token that is in vocab.json (no two lines build the same bytes),
  and every byte's symbol is in vocab.json (the Python encoder raises on a missing one);
- each merge's two parts are bytes or made by earlier lines (so merging one pair never makes a
  pair that ranks lower than it, and merging one occurrence at a time equals GPT-2's merging of
  all occurrences of the best pair at once);
- GPT-2's own algorithm rebuilds each merged token from its bytes (a token that it would split
  differently is a sign of merges that tiktoken would apply where GPT-2 does not).

The last check runs the `tokenizers` package's BPE (the same algorithm in Rust, 10x faster) when
installed, else the Python encoder: 0.1 s or about 1 s for GPT-2's 50,000 merges.

The checked tables are cached on disk under the SHA-256 of vocab.json and merges.txt (so any
edit of either file misses the cache): $MEGATRON_GPT2_BPE_CACHE, else
$XDG_CACHE_HOME/megatron-fp8/gpt2_bpe_tiktoken, else ~/.cache/megatron-fp8/gpt2_bpe_tiktoken;
MEGATRON_GPT2_BPE_CACHE=off turns the cache off. Only vocabularies that pass the check are cached.

tiktoken's ids are the ranks: vocab.json's ids when those follow the merge order, else a table
maps them. Its regex is GPT-2's, with
Unicode's \\s and \\p{L}/\\p{N} as the `regex` module that GPT-2's reference encoder uses.
"""

from __future__ import annotations

import hashlib
import logging
import marshal
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from megatron.core.environment import get_env

logger = logging.getLogger(__name__)

# GPT-2's pattern, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+,
# rewritten to match exactly the same pieces faster: the contractions share their apostrophe
# (a(b|c) is ab|ac for ordered alternation), and the alternatives without the lookahead form one
# group, which fancy-regex hands to the `regex` crate whole instead of trying them one by one in
# its backtracking VM. tiktoken's encoding is then 1.7x faster on Python source.
GPT2_SPLIT_PATTERN = (
    r"(?:'(?:[st]|re|ve|m|ll|d)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s+"
)


# Where the checked tables are cached ("off" or empty: no cache); see the module docstring.
CACHE_ENV = "MEGATRON_GPT2_BPE_CACHE"
# Part of every cache file's name: bump it when the check or the tables' layout changes, so that
# entries written by older code are never read.
CACHE_VERSION = 1

Tables = tuple[dict[bytes, int], np.ndarray | None]


def tiktoken_available() -> bool:
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return False
    return True


def build_tables(
    *,
    encoder: dict[str, int],
    bpe_ranks: dict[tuple[str, str], int],
    byte_encoder: dict[int, str],
    classic_bpe: Callable[[str], tuple[str, ...]],
) -> Tables | None:
    """(tiktoken's mergeable ranks, rank -> vocab id table) or None when the files do not
    qualify. The table is None when the ranks are the vocab ids themselves: GPT-2's vocab.json
    (and a `tokenizers`-trained one) numbers merged tokens in merge order, and tiktoken only
    compares the ranks of merged tokens, so no id mapping is needed then."""
    symbol_bytes: dict[str, bytes] = {}
    for byte in range(256):
        if byte_encoder[byte] not in encoder:
            logger.info("GPT-2 BPE: byte %d has no token; using the Python encoder", byte)
            return None
        symbol_bytes[byte_encoder[byte]] = bytes([byte])
    merges = sorted(bpe_ranks, key=bpe_ranks.__getitem__)
    merged_ids: list[int] = []
    for left, right in merges:
        # Parts must be bytes or earlier merges' results (both are in symbol_bytes by now).
        left_bytes, right_bytes = symbol_bytes.get(left), symbol_bytes.get(right)
        if left_bytes is None or right_bytes is None:
            return _unsuitable(left, right, "its parts are not bytes or earlier merges")
        symbol = left + right
        if symbol in symbol_bytes or symbol not in encoder:
            return _unsuitable(left, right, "its result is missing from vocab.json or repeated")
        symbol_bytes[symbol] = left_bytes + right_bytes
        merged_ids.append(encoder[symbol])
    rebuilds = _rebuilds_each_token(encoder, merges, classic_bpe)
    if rebuilds is not True:
        return _unsuitable(*rebuilds, "GPT-2's algorithm splits its result differently")
    if all(earlier < later for earlier, later in zip(merged_ids, merged_ids[1:])):
        return {token: encoder[symbol] for symbol, token in symbol_bytes.items()}, None
    ranks = {token: rank for rank, token in enumerate(symbol_bytes.values())}
    ids = [encoder[symbol] for symbol in symbol_bytes]
    return ranks, np.asarray(ids, dtype=np.int64)


def _unsuitable(left: str, right: str, reason: str) -> None:
    logger.info(
        "GPT-2 BPE: merge %r %r does not suit tiktoken (%s); using Python", left, right, reason
    )
    return None


def _rebuilds_each_token(
    encoder: dict[str, int],
    merges: list[tuple[str, str]],
    classic_bpe: Callable[[str], tuple[str, ...]],
) -> bool | tuple[str, str]:
    """True when GPT-2's algorithm turns each merge's result into that one token, else the
    first merge for which it does not."""
    try:
        from tokenizers import models

        model = models.BPE(vocab=dict(encoder), merges=merges)

        def pieces(symbol: str) -> int:
            return len(model.tokenize(symbol))

    except Exception:  # no tokenizers, or merges it refuses: check with the Python encoder

        def pieces(symbol: str) -> int:
            return len(classic_bpe(symbol))

    for left, right in merges:
        # Two single bytes always merge into their token; only longer results can split
        # otherwise. One piece covering the whole symbol is the symbol itself.
        if (len(left) > 1 or len(right) > 1) and pieces(left + right) != 1:
            return left, right
    return True


def make_encoding(ranks: dict[bytes, int]) -> Any:
    """A tiktoken Encoding of these ranks with GPT-2's split regex and no special tokens."""
    import tiktoken

    return tiktoken.Encoding(
        "megatron_gpt2_bpe", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )


def files_digest(vocab_data: bytes, merges_data: bytes) -> str:
    """SHA-256 of vocab.json's and merges.txt's bytes (each length-prefixed): the cache key."""
    digest = hashlib.sha256()
    for data in (vocab_data, merges_data):
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def cache_dir() -> str | None:
    """The directory of cached tables, or None when MEGATRON_GPT2_BPE_CACHE turns it off."""
    configured = get_env(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0") else configured
    root = get_env("XDG_CACHE_HOME")
    if not root:
        home = os.path.expanduser("~")
        if home == "~":  # no home directory to be found: no cache rather than a "~" folder here
            return None
        root = os.path.join(home, ".cache")
    return os.path.join(root, "megatron-fp8", "gpt2_bpe_tiktoken")


def cache_path(digest: str) -> str | None:
    directory = cache_dir()
    if directory is None:
        return None
    return os.path.join(directory, f"v{CACHE_VERSION}-{digest}.marshal")


def load_cached_tables(digest: str) -> Tables | None:
    """The tables cached for these files' digest, or None (no entry, no cache, or an entry
    that is unreadable or malformed: the caller then checks the files again)."""
    path = cache_path(digest)
    if path is None:
        return None
    try:
        with open(path, "rb") as handle:
            ranks, ids = marshal.loads(handle.read())
    except (OSError, EOFError, ValueError, TypeError):
        return None
    # marshal only rebuilds plain values; still make sure they are the ones written.
    if not isinstance(ranks, dict) or not (ids is None or isinstance(ids, list)):
        return None
    if not all(type(token) is bytes and type(rank) is int for token, rank in ranks.items()):
        return None
    if ids is None:
        return ranks, None
    if len(ids) != len(ranks) or not all(type(token_id) is int for token_id in ids):
        return None
    return ranks, np.asarray(ids, dtype=np.int64)


def store_tables(digest: str, tables: Tables) -> None:
    """Cache the tables of checked files (best effort: a read-only home only costs the check
    next time). Written under a temporary name and renamed, so readers never see half a file."""
    path = cache_path(digest)
    if path is None:
        return
    ranks, ids = tables
    payload = marshal.dumps((ranks, None if ids is None else ids.tolist()))
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "wb") as handle:
            handle.write(payload)
        os.replace(temporary, path)
    except OSError as error:
        logger.info("GPT-2 BPE: cannot cache the tiktoken tables in %s (%s)", path, error)
        try:
            os.remove(temporary)
        except OSError:
            pass
