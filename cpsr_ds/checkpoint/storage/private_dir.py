"""Directories this user's alone: the survivor root (``checkpoint.survivor_dir``) and everything under it.

Survivor dumps and host snapshots hold the training state in shared memory, and a
restart resumes from them. A directory there that another user owns or may write to
lets them plant a dump the restart resumes, or put a symlink in its place that sends
the dumps elsewhere; one they may read gives them the weights. So each directory is
checked by ``lstat`` or through a descriptor opened with ``O_NOFOLLOW`` (a symlink is
refused, never followed), refused where it is another user's or group- or
world-writable, and made 0700 (files 0600) with an explicit mode and ``fchmod``, so
that no umask widens or narrows it.
"""

from __future__ import annotations

import os
import pwd
import stat
from typing import Optional

DIR_MODE = 0o700
FILE_MODE = 0o600


class PrivateDirError(RuntimeError):
    """A path that must be this user's alone is not, or cannot be made so; the message names the path, its owner
    and mode, and what to do."""

    def __init__(self, path: str, problem: str, remedy: str):
        super().__init__(f"cpsr: {path} {problem}; {remedy}")
        self.path = path


def user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` where the system knows no name for it."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def describe(st: os.stat_result) -> str:
    return f"owned by {user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def problem(st: os.stat_result, uid: int) -> Optional[str]:
    """What makes the directory ``st`` (an lstat result) unfit to be private to user ``uid``; None where it is fit."""
    if stat.S_ISLNK(st.st_mode):
        return f"is a symlink ({describe(st)}), not a directory: it could send what is kept there elsewhere"
    if not stat.S_ISDIR(st.st_mode):
        return f"is not a directory ({describe(st)})"
    if st.st_uid != uid:
        return f"is {describe(st)}, not by you ({user(uid)}): its owner could read or replace what is kept there"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"is group- or world-writable ({describe(st)}): another user could replace what is kept there"
    return None


def remedy(path: str, setting: str) -> str:
    return f"remove it (rm -r {path}, as its owner or root) or set {setting} to a directory of your own"


def check(path: str, setting: str) -> None:
    """Raise :class:`PrivateDirError` unless directory ``path`` is this user's alone (FileNotFoundError where it is
    missing); ``setting``: the config key that moves it."""
    found = problem(os.lstat(path), os.geteuid())
    if found is not None:
        raise PrivateDirError(path, found, remedy(path, setting))


def ensure(path: str, setting: str) -> None:
    """Make directory ``path`` (its parent must exist) this user's alone: 0700 whether made here or found; raises
    :class:`PrivateDirError` where it is not ours, a symlink, group- or world-writable, or cannot be made."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except OSError as err:
        raise PrivateDirError(path, f"cannot be made: {err.strerror}", f"check {setting}") from None
    fd = _open_dir(path, setting)
    try:
        found = problem(os.fstat(fd), os.geteuid())  # what was opened, whatever the path names by now
        if found is not None:
            raise PrivateDirError(path, found, remedy(path, setting))
        os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def _open_dir(path: str, setting: str) -> int:
    """``path`` opened as a directory, never through a symlink; one that cannot be opened because it is a
    symlink, not a directory or another user's is refused by name."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        check(path, setting)
        raise
