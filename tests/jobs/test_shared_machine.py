"""On a machine other users share: the survivor root private and refused where another user could reach it, the
run directory's lock out of their reach, a copied run directory a run of its own, and bad paths named.

Another user is ``nobody`` (uid 65534): files are given to it with chown, and processes run as it; that needs root.
"""

import contextlib
import fcntl
import logging
import os
import select
import shutil
import signal
import stat
import tempfile

import pytest

from benchmarks.common.processes import tiny_config
from cpsr_ds.checkpoint.capture import dumps, host_snapshot, run_id, survivor
from cpsr_ds.checkpoint.storage.private_dir import PrivateDirError
from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds.runtime.rundir import GUARD, LOCK, RunDirectoryBusy, acquire, holders
from support.training import build, process_group, trained  # noqa: F401 (a fixture; process_group is autouse)


NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user and running a process as "
                                                       "another user take root")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def give_to_nobody(path) -> None:
    """``path`` and everything under it made another user's, as if that user had made them."""
    os.lchown(path, NOBODY, NOBODY)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(top, name), NOBODY, NOBODY)


def forked(fn, *args, uid=None) -> tuple[int, int]:
    """``fn(*args)`` started in a child process (of user ``uid``; None: this one): its pid, and the descriptor its
    outcome comes from (:func:`outcome`)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # no exec: the interpreter may lie where another user cannot reach it
        try:
            signal.set_wakeup_fd(-1)  # the parent's, where a signal to the child would wake the parent's dumper
            os.close(read)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            try:
                out = repr(fn(*args))
            except BaseException as err:
                out = f"{type(err).__module__}.{type(err).__name__}: {err}"
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def outcome(child: tuple[int, int], timeout_s: float = 120.0) -> str:
    """What the ``forked`` child's function returned, or the error it raised, as text (or that it did not end
    within ``timeout_s``: then it is killed)."""
    pid, read = child
    with os.fdopen(read, "rb") as f:
        ended = select.select([f], [], [], timeout_s)[0]
        if not ended:
            os.kill(pid, signal.SIGKILL)
        out = f.read().decode() if ended else f"did not end within {timeout_s:g} s"
    os.waitpid(pid, 0)
    return out


def as_nobody(fn, *args) -> str:
    return outcome(forked(fn, *args, uid=NOBODY))


@pytest.fixture
def reachable():
    """A directory every user can reach (pytest's own are its user's alone), removed after the test."""
    path = tempfile.mkdtemp(prefix="cpsr-test-")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def cfg_of(engine, **update):
    return engine.cpsr.cfg.checkpoint.model_copy(update=update)


# ---------------------------------------------------------------- the survivor root


def test_the_survivor_root_and_everything_under_it_are_private_whatever_the_umask(tmp_path):
    root = tmp_path / "survivors"
    root.mkdir(mode=0o755)  # as an earlier version left it
    with umask(0):
        engine, _ = trained(tmp_path, iterations=2, memory_interval=1)
        assert engine.cpsr.survivor.dump("test")
    found = [(top, name) for top, dirs, files in os.walk(root) for name in dirs + files]
    assert any(name == dumps.STATE_FILE for _, name in found) and any(name.endswith(".memory0") for _, name in found)
    assert mode(root) == 0o700
    assert {(os.path.join(top, name), mode(os.path.join(top, name))) for top, name in found} == {
        (os.path.join(top, name), 0o700 if os.path.isdir(os.path.join(top, name)) else 0o600) for top, name in found}
    engine.destroy()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine, _ = trained(tmp_path_factory.mktemp("engine"))
    yield engine
    engine.destroy()


def planted(path, kind: str) -> str:
    """A survivor root another user made first, or could write to: ``kind`` says how."""
    if kind == "symlink":
        target = f"{path}-target"
        os.mkdir(target, 0o700)
        os.symlink(target, path)
        return path
    os.mkdir(path)
    os.chmod(path, 0o777 if kind.endswith("777") else 0o755)
    if kind.startswith("nobody"):
        give_to_nobody(path)
    return path


REFUSALS = {"nobody-777": r"is owned by nobody \(uid 65534\), mode 0777, not by you \(root \(uid 0\)\)",
            "nobody-755": r"is owned by nobody \(uid 65534\), mode 0755, not by you \(root \(uid 0\)\)",
            "ours-777": r"is group- or world-writable \(owned by root \(uid 0\), mode 0777\)",
            "symlink": r"is a symlink \(owned by root \(uid 0\), mode 0777\), not a directory"}


@as_root
@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_a_survivor_root_another_user_could_reach_is_refused_by_name(engine, tmp_path, kind):
    root = planted(str(tmp_path / "survivors"), kind)
    for install, update in ((survivor.install, {}), (host_snapshot.install, {"survivor": False, "memory_interval": 1})):
        with pytest.raises(PrivateDirError) as refused:
            install(engine, cfg_of(engine, survivor_dir=root, **update), attempt=2)
        message = str(refused.value)
        assert message.startswith(f"cpsr: {root} ") and refused.value.path == root
        assert f"remove it (rm -r {root}, as its owner or root) or set checkpoint.survivor_dir" in message
        assert __import__("re").search(REFUSALS[kind], message), message
    if kind == "symlink":
        assert os.listdir(f"{root}-target") == []  # never followed


@as_root
def test_a_planted_dump_is_refused_when_read_and_the_restart_stops_with_a_named_error(tmp_path, caplog):
    """Another user's root holding a dump of the failure point (here this run's own, given to them) is not read by
    the restart's recovery, and the job stops at the root with an error that names it."""
    engine, _ = trained(tmp_path, iterations=4, interval=3)
    assert engine.cpsr.survivor.dump("test")
    engine.destroy()
    root, run = str(tmp_path / "survivors"), run_id.run_identity(str(tmp_path / "run"))
    assert dumps.read_survivor(root, 0, run).iteration == 4
    give_to_nobody(root)
    os.chmod(root, 0o777)
    caplog.clear()
    config = tiny_config(tmp_path / "run", stages=1)
    config["cpsr"]["checkpoint"].update(survivor_dir=root, interval=3)
    with pytest.raises(PrivateDirError, match=f"cpsr: {root} is owned by nobody"):
        build(config)
    assert f"survivor dump of rank 0 in {dumps.dump_dir(root, run, 0)} not used: cpsr: {root} is owned by nobody" \
           in caplog.text


@as_root
def test_another_users_directory_or_lock_file_we_cannot_open_is_refused_by_name_not_with_a_raw_error(reachable):
    """Seen by user nobody: a survivor root and a lock file of root's, 0700 and 0600."""
    root, run_dir = os.path.join(reachable, "survivors"), os.path.join(reachable, "run")
    os.mkdir(root, 0o700)
    os.mkdir(run_dir)
    os.chmod(run_dir, 0o777)
    refused = as_nobody(dumps.prepare, CPSRConfig.parse_block(
        {"checkpoint": {"dir": run_dir, "survivor_dir": root}}).checkpoint)
    assert refused.startswith(f"cpsr_ds.checkpoint.storage.private_dir.PrivateDirError: cpsr: {root} is owned by root (uid 0), "
                              "mode 0700, not by you (nobody (uid 65534))"), refused
    acquire(run_dir).release()
    refused = as_nobody(acquire, run_dir)
    assert refused.startswith(f"cpsr_ds.checkpoint.storage.private_dir.PrivateDirError: cpsr: {run_dir}/{GUARD} is owned by "
                              "root (uid 0), mode 0600, not by you (nobody (uid 65534))"), refused


# ---------------------------------------------------------------- the run's identity


def test_a_copied_run_directory_is_a_run_of_its_own_and_does_not_take_the_originals_dump(tmp_path, caplog):
    engine, _ = trained(tmp_path, iterations=2)
    assert engine.cpsr.survivor.dump("test")
    root, run = str(tmp_path / "survivors"), run_id.run_identity(str(tmp_path / "run"))
    copy = str(tmp_path / "runB")
    shutil.copytree(tmp_path / "run", copy)  # cp -r: cpsr_run.json too
    assert run_id.run_identity(copy) not in (run, None)
    assert run_id.run_identity(copy) == run_id.run_identity(copy)  # and keeps it
    assert dumps.read_survivor(root, 0, run_id.run_identity(copy)) is None
    assert dumps.read_survivor(root, 0, run) is not None  # the original's is still the original's
    with caplog.at_level(logging.WARNING):
        survivor.install(engine, cfg_of(engine, dir=copy), attempt=2)
    assert f"the run directory {os.path.realpath(copy)} was made as {os.path.realpath(tmp_path / 'run')}" in caplog.text
    engine.destroy()


def test_every_process_that_sees_a_run_directory_gets_one_identity(tmp_path):
    """Ranks on one node ask at once, at the first start and in a copy; each directory gets one identity."""
    first, copy = tmp_path / "run", tmp_path / "copy"
    first.mkdir()
    made = {outcome(child) for child in [forked(run_id.run_identity, str(first)) for _ in range(8)]}
    shutil.copytree(first, copy)
    copied = {outcome(child) for child in [forked(run_id.run_identity, str(copy)) for _ in range(8)]}
    assert len(made) == len(copied) == 1 and made != copied, (made, copied)


def test_a_dump_whose_run_directory_holds_another_run_now_is_refused(tmp_path, caplog):
    engine, _ = trained(tmp_path, iterations=2)
    assert engine.cpsr.survivor.dump("test")
    engine.destroy()
    root, run = str(tmp_path / "survivors"), run_id.run_identity(str(tmp_path / "run"))
    copy = str(tmp_path / "runB")
    shutil.copytree(tmp_path / "run", copy)
    owner = os.path.join(root, run, dumps.OWNER)
    with open(owner, "w") as f:
        f.write(f'{{"run_dir": "{copy}"}}')
    assert dumps.read_survivor(root, 0, run) is None
    assert f"its run directory {copy} ({dumps.OWNER}) holds another run now, not run {run!r}" in caplog.text
    os.unlink(owner)
    assert dumps.read_survivor(root, 0, run) is None and "its run directory is unknown" in caplog.text


# ---------------------------------------------------------------- the run directory's lock


def test_the_lock_file_is_private_whatever_the_umask(tmp_path):
    with umask(0):
        lock = acquire(str(tmp_path / "run"))
    try:
        assert mode(tmp_path / "run" / LOCK) == mode(tmp_path / "run" / GUARD) == 0o600
    finally:
        lock.release()


@as_root
def test_another_user_cannot_open_the_lock_file(reachable):
    lock = acquire(os.path.join(reachable, "run"))
    lock.release()
    opened = as_nobody(os.open, os.path.join(reachable, "run", LOCK), os.O_RDONLY)
    assert opened.startswith("builtins.PermissionError"), opened


@contextlib.contextmanager
def held_by_nobody(path):
    """A process of user nobody holding a shared flock on ``path``, which it opened read-only; yields its pid."""
    ready, release = os.pipe(), os.pipe()

    def hold():
        fcntl.flock(os.open(path, os.O_RDONLY), fcntl.LOCK_SH)
        os.write(ready[1], b"held")
        os.close(release[1])
        os.read(release[0], 1)  # until the test closes its end

    child = forked(hold, uid=NOBODY)
    os.close(ready[1])
    os.close(release[0])
    try:
        assert os.read(ready[0], 4) == b"held"
        yield child[0]
    finally:
        os.close(release[1])
        os.close(ready[0])
        outcome(child)


@as_root
def test_a_lock_held_by_another_users_process_does_not_keep_the_run_from_starting(reachable, caplog):
    """An earlier version's world-readable lock file, opened and flocked by another user: the lock file is
    replaced by a private one, with a warning naming that user; a job of ours is still kept out."""
    run_dir = os.path.join(reachable, "run")
    os.mkdir(run_dir)
    path = os.path.join(run_dir, LOCK)
    with open(path, "w") as f:
        f.write('{"host": "h", "pid": 1, "master": "m", "started": "s", "attempt": 1}')
    os.chmod(path, 0o644)
    old = os.stat(path).st_ino
    with held_by_nobody(path) as holder:
        lock = acquire(run_dir)
        try:
            assert lock.attempt == 2 and os.stat(path).st_ino != old and mode(path) == 0o600
            assert f"the lock file {path} was held by pid {holder} of user nobody (uid 65534), not by a job of " \
                   "yours: the run directory or its lock file is reachable by another user" in caplog.text
            with pytest.raises(RunDirectoryBusy, match=f"is in use by another job: host .* pid {os.getpid()} "):
                acquire(run_dir)
        finally:
            lock.release()


def test_the_holders_of_a_lock_are_found_with_their_user(tmp_path):
    lock = acquire(str(tmp_path / "run"))
    try:
        fd = os.open(tmp_path / "run" / LOCK, os.O_RDONLY)
        try:
            assert holders(fd) == {os.getpid(): os.geteuid()}
        finally:
            os.close(fd)
    finally:
        lock.release()


@as_root
@pytest.mark.parametrize("kind", ["nobody", "symlink"])
def test_a_lock_file_of_another_user_or_a_symlink_is_refused_by_name(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / LOCK
    if kind == "nobody":
        path.write_text("")
        os.chmod(path, 0o644)
        os.chown(path, NOBODY, NOBODY)
        expected = r"is owned by nobody \(uid 65534\), mode 0644, not by you \(root \(uid 0\)\)"
    else:
        (tmp_path / "elsewhere").write_text("")
        path.symlink_to(tmp_path / "elsewhere")
        expected = r"is a symlink \(owned by root \(uid 0\), mode 0777\)"
    with pytest.raises(PrivateDirError, match=f"cpsr: {path} {expected}; another user who can open it can hold "
                                              f"the lock and keep this run from starting; remove it \\(rm {path}\\)"):
        acquire(str(run_dir))


# ---------------------------------------------------------------- named errors


def test_a_checkpoint_dir_that_cannot_be_made_is_named_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"
    with pytest.raises(ConfigError, match=f"cpsr.checkpoint.dir: cannot make {run_dir}: cannot make files in "
                                          f"{tmp_path / 'file'} as user root \\(uid 0\\): Not a directory"):
        build(tiny_config(run_dir, stages=1))


@as_root
def test_a_read_only_checkpoint_dir_stops_the_job_with_an_error_naming_the_key_and_the_path(reachable):
    """A job of user nobody given a directory only root may write."""
    run_dir = os.path.join(reachable, "run")
    os.mkdir(run_dir, 0o755)
    stopped = as_nobody(build, tiny_config(run_dir, stages=1))
    assert stopped == (f"cpsr_ds.config.ConfigError: cpsr.checkpoint.dir: cannot make files in {run_dir} as user "
                       f"nobody (uid 65534): Permission denied; make it writable or set checkpoint.dir to a directory "
                       "you can write"), stopped


def test_a_block_name_a_typo_away_is_warned_about_naming_the_key(caplog):
    for key in ("cspr", "CPSR", "cpsr_", "Cpsr", "cps"):
        caplog.clear()
        CPSRConfig.from_ds_config({key: {"checkpoint": {"dir": "x"}}, "train_batch_size": 8})
        assert f"top-level key {key!r}, close to \"cpsr\"" in caplog.text, key
    caplog.clear()
    CPSRConfig.from_ds_config({"cpsr": {}, "fp16": {}, "bf16": {}, "amp": {}, "aio": {}, "seed": 1, "gpt": {},
                               "pipeline": {}, "optimizer": {}, "scheduler": {}, "checkpoint": {}})
    assert "close to" not in caplog.text


@pytest.mark.parametrize("key", ["dir", "survivor_dir"])
def test_a_path_no_file_system_takes_is_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"cpsr\.checkpoint\.{key}: a path cannot contain a NUL byte"):
        CPSRConfig.parse_block({"checkpoint": {key: "/dev/shm/a\0b"}})
    with pytest.raises(ConfigError, match=rf"cpsr\.checkpoint\.{key}: a path of 5000 bytes is longer than 4095"):
        CPSRConfig.parse_block({"checkpoint": {key: "ab/" * 1666 + "cd"}})
