"""Durable, all-or-nothing checkpoint directories, and the error for an unusable checkpoint.

A directory is written under `<final>.tmp`, its files and directories fsynced, then published by
`publish_dir`: an existing `<final>` is renamed to `<final>.old`, `<final>.tmp` is renamed to
`<final>`, the parent directory is fsynced, and only then is `<final>.old` deleted. A kill at any
point leaves one complete copy: under `<final>`, or (between the two renames) under
`<final>.old`. Readers go through `resolve_published_dir`, which returns that copy and never the
`.tmp` one, whose files may be half-written.
"""

from __future__ import annotations

import os
import shutil

TMP_SUFFIX = ".tmp"
ASIDE_SUFFIX = ".old"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the fix."""


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a directory's entries to stable storage (a no-op cost when clean)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under root (bottom-up, so entries are durable first)."""
    for directory, _, filenames in os.walk(root, topdown=False):
        for filename in filenames:
            fsync_path(os.path.join(directory, filename))
        fsync_path(directory)


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the complete directory `tmp` to `final`, replacing any previous `final`.

    The caller has fsynced `tmp`'s contents. Single-process: rank 0 calls it.
    """
    tmp, final = os.fspath(tmp), os.fspath(final)
    aside = final + ASIDE_SUFFIX
    if os.path.isdir(aside):
        if os.path.isdir(final):  # killed after the new copy was in place: the aside is stale
            shutil.rmtree(aside)
        else:  # killed between the renames: the aside is the only complete copy, restore it
            os.replace(aside, final)
    if os.path.isdir(final):
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    shutil.rmtree(aside, ignore_errors=True)


def resolve_published_dir(final: str | os.PathLike) -> str | None:
    """`final`, or its `.old` copy when a kill fell between publish_dir's renames, or None."""
    final = os.fspath(final)
    if os.path.isdir(final):
        return final
    aside = final + ASIDE_SUFFIX
    return aside if os.path.isdir(aside) else None
