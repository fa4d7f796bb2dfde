"""Damaged checkpoints and metadata: each is named, never crashes inspect or selection, and the older one is used."""

import builtins
import errno
import json
import logging
import os

import pytest
import torch

from cpsr_ds.cli import main
from cpsr_ds.checkpoint.storage import fileformat, store
from cpsr_ds.checkpoint.storage.fileformat import read_snapshot
from test_checkpoint_store import make_checkpoint, two_checkpoints, write_snapshot  # noqa: F401 (a fixture)

NEW = "global_step20"
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def run_inspect(ckpt_dir, capsys, *flags):
    """``python -m cpsr_ds inspect`` as a table, then as JSON; returns the JSON report, rows by tag."""
    assert main(["inspect", ckpt_dir, *flags]) == 0
    table = capsys.readouterr().out
    assert main(["inspect", ckpt_dir, "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    report["rows"] = {r["tag"]: r for r in report["checkpoints"]}
    report["table"] = table
    return report


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    write(path, json.dumps(obj).encode())


def unreadable(path, monkeypatch):
    """Reading ``path`` fails with EACCES (chmod alone does not stop root)."""
    real_open = builtins.open

    def open_(file, *args, **kw):
        if isinstance(file, str) and os.path.abspath(file) == os.path.abspath(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), file)
        return real_open(file, *args, **kw)

    monkeypatch.setattr(builtins, "open", open_)


def replace_by_directory(path):
    os.unlink(path)
    os.makedirs(path)


MANIFEST = os.path.join(NEW, store.manifest_name(1))
COMMIT = os.path.join(NEW, store.COMMIT)

# name: (file damaged, how, what the problem says)
DAMAGED_CHECKPOINT = {
    "manifest cut short": (MANIFEST, lambda p, mp: write(p, b'{"tag": "glob'), "Invalid JSON"),
    "manifest a list": (MANIFEST, lambda p, mp: write(p, b"[]"), "Input should be an object"),
    "manifest without files": (MANIFEST, lambda p, mp: edit_json(p, lambda m: m.pop("files")),
                               "files: Field required"),
    "manifest size a string": (MANIFEST, lambda p, mp: edit_json(p, lambda m: m["files"][RANK1].update(size="9")),
                               f"files.{RANK1}.size: Input should be a valid integer"),
    "manifest files a list": (MANIFEST, lambda p, mp: edit_json(p, lambda m: m.update(files=[])),
                              "files: Input should be an object"),
    "manifest binary": (MANIFEST, lambda p, mp: write(p, b"\xff\xfe\x00\x81"), "Invalid JSON"),
    "manifest a directory": (MANIFEST, lambda p, mp: replace_by_directory(p), "Is a directory"),
    "manifest unreadable": (MANIFEST, unreadable, "EACCES Permission denied"),
    "commit record cut short": (COMMIT, lambda p, mp: write(p, b'{"tag": "global_st'), "Invalid JSON"),
    "commit record not an object": (COMMIT, lambda p, mp: write(p, b'"global_step20"'),
                                    "Input should be an object"),
    "commit record without world_size": (COMMIT, lambda p, mp: edit_json(p, lambda c: c.pop("world_size")),
                                         "world_size: Field required"),
    "commit record a directory": (COMMIT, lambda p, mp: replace_by_directory(p), "Is a directory"),
    "commit record unreadable": (COMMIT, unreadable, "EACCES Permission denied"),
}


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINT)
def test_damaged_metadata_is_named_and_the_older_checkpoint_used(two_checkpoints, monkeypatch, caplog, capsys, case):
    rel, damage, what = DAMAGED_CHECKPOINT[case]
    path = os.path.join(two_checkpoints, rel)
    damage(path, monkeypatch)
    with caplog.at_level(logging.ERROR):
        assert store.select_checkpoint(two_checkpoints) == "global_step10"
    assert path in caplog.text and what in caplog.text
    assert [c.tag for c in store.loadable_checkpoints(two_checkpoints, read_data=False)] == ["global_step10"]
    report = run_inspect(two_checkpoints, capsys)
    bad = report["rows"][NEW]
    assert bad["status"] == "invalid" and not bad["valid"]
    assert any(path in p and what in p for p in bad["problems"]), bad["problems"]
    assert report["rows"]["global_step10"]["status"] == "valid" and report["usable"] == "global_step10"
    assert "invalid" in report["table"] and what in report["table"]


def test_commit_record_without_started_ns_is_fine(two_checkpoints):
    edit_json(os.path.join(two_checkpoints, COMMIT), lambda c: c.pop("started_ns"))
    assert store.select_checkpoint(two_checkpoints) == NEW


DAMAGED_LATEST = {
    "binary": (lambda p, mp: write(p, b"\x80\xff global\x00"), "not text"),
    "a directory": (lambda p, mp: replace_by_directory(p), "Is a directory"),
    "unreadable": (unreadable, "EACCES Permission denied"),
    "a path": (lambda p, mp: write(p, b"../elsewhere"), "not a checkpoint tag"),
}


@pytest.mark.parametrize("case", DAMAGED_LATEST)
def test_damaged_latest_is_named_and_counts_as_none(two_checkpoints, monkeypatch, caplog, capsys, case):
    damage, what = DAMAGED_LATEST[case]
    path = os.path.join(two_checkpoints, store.LATEST)
    damage(path, monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert store.read_latest(two_checkpoints) is None
        assert store.select_checkpoint(two_checkpoints) == NEW
    assert path in caplog.text and what in caplog.text
    report = run_inspect(two_checkpoints, capsys)
    assert report["latest"] is None and report["usable"] == NEW


@pytest.mark.parametrize("damage", ["binary", "directory"])
def test_damaged_latest_is_replaced_by_the_next_commit(two_checkpoints, damage):
    path = os.path.join(two_checkpoints, store.LATEST)
    if damage == "binary":
        write(path, b"\xff\xfe")
    else:
        os.unlink(path)
        os.makedirs(os.path.join(path, "inside"))
    make_checkpoint(two_checkpoints, "global_step15")
    assert store.read_latest(two_checkpoints) == "global_step15"
    make_checkpoint(two_checkpoints, "global_step30")
    assert store.read_latest(two_checkpoints) == "global_step30"


def test_latest_naming_a_damaged_checkpoint_moves_to_an_older_commit(two_checkpoints):
    write(os.path.join(two_checkpoints, MANIFEST), b"[]")
    make_checkpoint(two_checkpoints, "global_step15")
    assert store.read_latest(two_checkpoints) == "global_step15"


# ---------------------------------------------------------------- checkpoints without a verifiable manifest

def test_snapshot_files_without_metadata_are_ours_and_partial(two_checkpoints, capsys):
    tag_dir = os.path.join(two_checkpoints, NEW)
    for name in (store.manifest_name(0), store.manifest_name(1), store.COMMIT):
        os.unlink(os.path.join(tag_dir, name))
    os.truncate(os.path.join(tag_dir, RANK1), 0)  # one file without our header
    assert store.select_checkpoint(two_checkpoints) == "global_step10"
    row = run_inspect(two_checkpoints, capsys)["rows"][NEW]
    assert row["kind"] == "cpsr" and row["status"] == "not committed" and not row["valid"]
    assert "partial checkpoint" in row["problems"][0]


def deepspeed_checkpoint(ckpt_dir, tag, state):
    os.makedirs(os.path.join(ckpt_dir, tag))
    torch.save(state, os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt"))
    write(os.path.join(ckpt_dir, store.LATEST), tag.encode())


@pytest.mark.parametrize("damage,what", [
    (lambda p: os.truncate(p, os.path.getsize(p) // 2), "does not load"),
    (lambda p: torch.save({"module": {"3.weight": torch.tensor([1.0, float("inf")])}}, p),
     "non-finite values in module.3.weight"),
])
def test_deepspeed_checkpoint_is_opened_before_it_is_chosen(tmp_path, caplog, capsys, damage, what):
    d = str(tmp_path)
    deepspeed_checkpoint(d, "global_step1", {"module": {"3.weight": torch.ones(3)}})
    deepspeed_checkpoint(d, "global_step2", {"module": {"3.weight": torch.ones(3)}})
    deepspeed_checkpoint(d, "global_step3", {"module": {"3.weight": torch.ones(3)}})
    write(os.path.join(d, store.LATEST), b"global_step2")
    bad = os.path.join(d, "global_step2", "mp_rank_00_model_states.pt")
    damage(bad)
    for read_data in (True, False):
        with caplog.at_level(logging.ERROR):
            assert store.select_checkpoint(d, read_data) == "global_step1"
        assert bad in caplog.text and what in caplog.text
    rows = run_inspect(d, capsys)["rows"]
    assert [rows[t]["status"] for t in ("global_step1", "global_step2", "global_step3")] == [
        "unverified", "invalid", "not committed"]
    assert rows["global_step1"]["kind"] == "deepspeed" and what in rows["global_step2"]["problems"][0]
    assert run_inspect(d, capsys, "--no-checksums")["rows"]["global_step2"]["status"] == "unverified"


def test_manifest_listing_no_files_or_not_every_file_is_invalid(tmp_path, capsys):
    d = str(tmp_path)
    make_checkpoint(d, "global_step10", world_size=1)
    make_checkpoint(d, "global_step20", world_size=1)
    make_checkpoint(d, "global_step30", world_size=1)
    write(os.path.join(d, "global_step30", "stray.pt"), b"x")
    edit_json(os.path.join(d, "global_step20", store.manifest_name(0)), lambda m: m.update(files={}))
    assert store.select_checkpoint(d) == "global_step10"
    rows = run_inspect(d, capsys)["rows"]
    assert any("stray.pt: listed in no rank manifest" in p for p in rows["global_step30"]["problems"])
    assert any("listed in no rank manifest" in p for p in rows["global_step20"]["problems"])
    os.unlink(os.path.join(d, "global_step20", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert any("no files" in p for p in store.list_checkpoints(d)[1].problems)


# ---------------------------------------------------------------- non-finite state

def rewrite(ckpt_dir, tag, rank, state):
    """Replace rank ``rank``'s file with ``state``, re-checksummed, its manifest updated so that it verifies."""
    name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    size, digest = write_snapshot(os.path.join(ckpt_dir, tag, name), state)
    edit_json(os.path.join(ckpt_dir, tag, store.manifest_name(rank)),
              lambda m: m["files"][name].update(size=size, digest=digest))
    return os.path.join(ckpt_dir, tag, name)


def test_nan_in_a_rechecksummed_file_is_named_and_the_older_checkpoint_used(two_checkpoints, monkeypatch, capsys,
                                                                             caplog):
    # Small read chunks: the NaN sits in a later chunk of a tensor spanning several.
    monkeypatch.setattr(fileformat, "_READ_CHUNK", 4096)
    weight = torch.randn(5000)
    weight[4321] = float("nan")
    state = {"module": {"3.weight": weight, "3.bias": torch.zeros(4, dtype=torch.bfloat16)},
             "optimizer_state_dict": {"state": {0: {"exp_avg": torch.ones(3), "step": 5}}}}
    path = rewrite(two_checkpoints, NEW, 1, state)
    assert torch.isnan(read_snapshot(path)["module"]["3.weight"]).any()
    with caplog.at_level(logging.ERROR):
        assert store.select_checkpoint(two_checkpoints) == "global_step10"
    assert f"{path}: non-finite values in module.3.weight" in caplog.text
    rows = run_inspect(two_checkpoints, capsys)["rows"]
    assert rows[NEW]["status"] == "invalid"
    assert rows[NEW]["problems"] == [f"{path}: non-finite values in module.3.weight"]
    state["module"]["3.weight"][4321] = 0.0
    state["optimizer_state_dict"]["state"][0]["exp_avg"][1] = float("-inf")
    state["module"]["3.bias"][0] = float("inf")
    rewrite(two_checkpoints, NEW, 1, state)
    assert store.list_checkpoints(two_checkpoints)[1].problems == [
        f"{path}: non-finite values in module.3.bias",
        f"{path}: non-finite values in optimizer_state_dict.state.0.exp_avg"]


def test_manifest_listing_nonfinite_tensors_is_invalid_without_reading_data(two_checkpoints):
    edit_json(os.path.join(two_checkpoints, MANIFEST), lambda m: m["files"][RANK1].update(nonfinite=["x"]))
    assert store.select_checkpoint(two_checkpoints, read_data=False) == "global_step10"
    path = os.path.join(two_checkpoints, NEW, RANK1)
    assert store.list_checkpoints(two_checkpoints, read_data=False)[1].problems == [
        f"{path}: non-finite values in x"]


def test_retention_never_counts_a_damaged_checkpoint(two_checkpoints):
    d = two_checkpoints
    make_checkpoint(d, "global_step30")
    edit_json(os.path.join(d, "global_step30", store.manifest_name(0)),
              lambda m: m["files"]["zero_pp_rank_0_mp_rank_00_optim_states.pt"].update(nonfinite=["x"]))
    assert store.apply_retention(d, keep_last=1, protected=lambda tag: False) == ["global_step10"]
    assert store.select_checkpoint(d) == NEW
