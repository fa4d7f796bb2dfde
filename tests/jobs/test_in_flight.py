"""The in-flight source: a failure while checkpoint c' persists, after its layer files landed, resumes at c' with
c''s parameters and the last committed checkpoint's optimizer state, instead of recomputing from there."""

import json
import math
import os
import shutil

import pytest

from benchmarks.common.processes import tiny_config
from conftest import run_job
from cpsr_ds import runlog
from cpsr_ds.checkpoint.storage import ondisk, progress_record, records
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.checkpoint.storage.fileformat import read_snapshot
from cpsr_ds.checkpoint.engines.snapshot import HostBuffers, snapshot_file
from cpsr_ds.checkpoint.capture.journal import journal_path, read_journal
from cpsr_ds.recovery import read_reports
from cpsr_ds.runlog import CostRow, StateRow

INTERVAL, REACHED, C, IN_FLIGHT = 8, 19, 8, 16


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    """PP = 2, checkpoints every 8, the job's journals at 19: then checkpoint 16 made one cut short after its layer
    files landed, as a failure during its persist leaves it (each rank's progress record lists its layer files;
    no optimizer file, manifest or commit record), ``latest`` back on 8."""
    tmp = tmp_path_factory.mktemp("in_flight")
    run_job(tmp, tiny_config(tmp / "run", stages=2, checkpoint={"dir": str(tmp / "run"), "interval": INTERVAL}),
            "--train-iters", REACHED)
    tag_dir = tmp / "run" / f"global_step{IN_FLIGHT}"
    for rank, manifest in records.read_manifests(str(tag_dir)).items():
        layers = [rel for rel in manifest["files"] if rel.startswith("layer_")]
        assert layers, manifest
        for k, rel in enumerate(layers):
            progress_record.record_progress(str(tag_dir), rank, rel, manifest["files"][rel], manifest["attempt"],
                                  manifest["checksum"], first=k == 0)
        for rel in manifest["files"]:
            if not rel.startswith("layer_"):
                os.unlink(tag_dir / rel)
        os.unlink(tag_dir / ondisk.manifest_name(rank))
    os.unlink(tag_dir / ondisk.COMMIT)
    (tmp / "run" / ondisk.LATEST).write_text(f"global_step{C}")
    return tmp


def restarted(failed, tmp_path, name: str, mode: str = "auto", damage: bool = False, train_iters: int = REACHED + 5,
              interval=INTERVAL, prepare=None):
    """A copy of the failed run restarted with ``recovery.mode`` ``mode`` (``damage``: a byte of one rank's
    landed layer file flipped first; ``prepare``: called with the copy's directory first) at checkpoint
    ``interval`` and trained to ``train_iters``; (its recovery report, its directory, the job's output)."""
    run = tmp_path / name
    shutil.copytree(failed / "run", run)
    if prepare is not None:
        prepare(run)
    if damage:
        path = sorted((run / f"global_step{IN_FLIGHT}").glob("layer_*"))[-1]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    # damped needs three checkpoints, the run has one committed: recovery recomputes, from the newest state it may.
    config = tiny_config(run, stages=2, checkpoint={"dir": str(run), "interval": interval}, recovery={"mode": mode},
                         predictor={"name": "damped"})
    result = run_job(tmp_path, config, "--train-iters", train_iters)
    return read_reports(str(run))[-1], run, result.stdout + result.stderr


def losses(run, rank: int) -> tuple[dict[int, float], dict[int, float]]:
    """(the failed job's losses, the restarted job's) by iteration, from the rank's journal."""
    entries = read_journal(journal_path(str(run), rank))
    return ({e.iteration: e.loss for e in entries[:REACHED]},
            {e.iteration: e.loss for e in entries[REACHED:]})


def test_a_checkpoint_cut_short_after_its_layer_files_landed_gives_recomputing_its_parameters(failed, tmp_path):
    report, run, _ = restarted(failed, tmp_path, "auto")
    assert (report.method, report.reached) == ("recompute", REACHED), report
    assert report.checkpoint == report.resume_iteration == IN_FLIGHT, report
    assert report.sources == {"0": "in flight", "1": "in flight"}, report
    assert "parameters of the checkpoint in flight at iteration 16" in report.describe()
    for rank in (0, 1):
        first, again = losses(run, rank)
        assert min(again) == IN_FLIGHT + 1
        # Iteration 17's loss is the forward pass of the parameters of 16: exactly the failed job's.
        assert again[IN_FLIGHT + 1] == first[IN_FLIGHT + 1]


def test_a_job_that_fails_again_before_a_new_commit_may_still_predict(failed, tmp_path):
    # Resumed at 16 from the checkpoint in flight, the job journals 17..22 and ends before its next checkpoint (24):
    # 8 is still the newest committed one, and the journal covers 17..22 in one run, not 9..22.
    report, run, _ = restarted(failed, tmp_path, "again", train_iters=REACHED + 3)
    assert (report.checkpoint, report.sources) == (IN_FLIGHT, {"0": "in flight", "1": "in flight"}), report
    config = tiny_config(run, stages=2, checkpoint={"dir": str(run), "interval": INTERVAL},
                         recovery={"mode": "predict"}, predictor={"name": "skip"})
    run_job(tmp_path, config, "--train-iters", REACHED + 5)
    again = read_reports(str(run))[-1]
    assert (again.method, again.reached, again.resume_iteration) == ("predict", REACHED + 3, REACHED + 3), again


def test_a_restart_from_the_checkpoint_in_flight_plans_with_the_predictor_it_restored(failed, tmp_path):
    # The restarted predictor holds checkpoint 8, not 16 (in flight, never committed): recovery's next decision
    # weighs its held-out error, and so must the interval planned at the restart.
    def measured(run):
        for rank in (0, 1):  # each rank is its stage's measuring rank
            path = runlog.measurements_path(str(run), rank)
            for iteration in (2, 4, 6):
                runlog.append(path, CostRow(iteration, rank, rank, 0, 0.05, 0.001, 0.01, 0.2, 1000))
            for iteration, r in ((C, 2.0), (IN_FLIGHT, 0.5)):
                runlog.append(path, StateRow(iteration, rank, rank, 0, "damped", 1000, xi=1e-6, held_out_error=1e-5,
                                             relative_error=r))

    report, run, _ = restarted(failed, tmp_path, "planned", interval="auto", prepare=measured)
    assert report.resume_iteration == IN_FLIGHT, report
    plans, problems = runlog.read_plans(str(run))
    assert not problems
    restart = [p for p in plans if p.reason == "restart"]
    assert len(restart) == 1 and restart[0].iteration == IN_FLIGHT, plans
    assert restart[0].inputs["relative_error"] == [2.0, 2.0], restart[0].inputs


def test_a_damaged_landed_layer_file_is_not_used(failed, tmp_path):
    report, _, output = restarted(failed, tmp_path, "damaged", damage=True)
    assert report.resume_iteration == C and report.sources is None, report
    assert "checksum mismatch" in output and "global_step16" in output


def rewritten_layer_file(change):
    """A ``prepare`` of :func:`restarted`: the last landed layer file's state dict changed by ``change`` and
    written again in the checkpoint format, its progress line made to vouch for it (size and digest, no note of
    non-finite values): a file whose only fault is what it holds."""

    def prepare(run):
        tag_dir = run / f"global_step{IN_FLIGHT}"
        path = sorted(tag_dir.glob("layer_*"))[-1]
        state = read_snapshot(str(path))
        change(state)
        snap = snapshot_file(path.name, state, HostBuffers(pin=False), None)
        snap.copy(None)
        for record in tag_dir.glob("cpsr_progress.rank*.jsonl"):
            lines = [json.loads(line) for line in record.read_text().splitlines()]
            for line in lines:
                if line["file"] == path.name:
                    size, digest = fs.write_atomic(str(path), snap.chunks(), line["checksum"])
                    line.update(size=size, digest=digest)
                    line.pop("nonfinite", None)
            record.write_text("".join(json.dumps(line) + "\n" for line in lines))

    return prepare


def first_tensor(state: dict) -> str:
    return next(k for k, v in sorted(state.items()) if hasattr(v, "is_floating_point") and v.is_floating_point())


def nan_in_first_tensor(state: dict) -> None:
    state[first_tensor(state)].view(-1)[0] = math.nan


def first_tensor_a_row_short(state: dict) -> None:
    key = first_tensor(state)
    state[key] = state[key][:-1].clone()


@pytest.mark.parametrize("change, said", [(nan_in_first_tensor, "non-finite values in"),
                                          (first_tensor_a_row_short, "where the engine holds")])
def test_a_landed_layer_file_whose_progress_line_vouches_for_a_wrong_state_is_not_used(failed, tmp_path, change,
                                                                                        said):
    """A NaN, or a tensor of another shape (which the layer's load_state_dict would raise on at every restart), in
    a layer file whose progress line was made to match it: recomputing starts from the committed checkpoint."""
    report, run, output = restarted(failed, tmp_path, change.__name__, prepare=rewritten_layer_file(change))
    assert (report.method, report.resume_iteration, report.sources) == ("recompute", C, None), report
    assert f"global_step{IN_FLIGHT}" in output and said in output, output[-3000:]
    _, again = losses(run, 0)
    assert all(math.isfinite(loss) for loss in again.values())


def test_recovery_mode_recompute_takes_only_exact_states(failed, tmp_path):
    report, run, _ = restarted(failed, tmp_path, "recompute", mode="recompute")
    assert (report.method, report.resume_iteration, report.sources) == ("recompute", C, None), report
    first, again = losses(run, 0)
    assert all(again[i] == first[i] for i in range(C + 1, REACHED + 1))  # RB-R: the failed job's own iterations


def test_progress_records_keep_their_newest_attempt_and_stop_at_a_damaged_line(tmp_path):
    entry = {"size": 3, "digest": "ab"}
    progress_record.record_progress(str(tmp_path), 0, "a.pt", entry, 1, "xxh3_64", first=True)
    progress_record.record_progress(str(tmp_path), 0, "b.pt", entry, 1, "xxh3_64", first=False)
    progress_record.record_progress(str(tmp_path), 1, "c.pt", entry, 1, "xxh3_64", first=True)
    assert set(progress_record.read_progress(str(tmp_path))) == {"a.pt", "b.pt", "c.pt"}
    # A later attempt writes rank 0's part again: its first file starts the record anew.
    progress_record.record_progress(str(tmp_path), 0, "b.pt", {"size": 4, "digest": "cd"}, 2, "xxh3_64", first=True)
    landed = progress_record.read_progress(str(tmp_path))
    assert set(landed) == {"b.pt", "c.pt"} and landed["b.pt"] == progress_record.Landed({"size": 4, "digest": "cd"}, "xxh3_64", 2)
    with open(tmp_path / ondisk.progress_name(1), "a") as f:
        f.write('{"attempt": 1, "file": "d.pt", "si')  # a write cut short
        f.write("\n" + json.dumps({"attempt": 1, "checksum": "xxh3_64", "file": "e.pt", **entry}) + "\n")
    assert set(progress_record.read_progress(str(tmp_path))) == {"b.pt", "c.pt"}
    progress_record.forget_progress(str(tmp_path), 0)
    assert set(progress_record.read_progress(str(tmp_path))) == {"c.pt"}


def test_a_rank_that_finished_its_part_has_its_files_landed_by_its_manifest(tmp_path):
    entry = {"size": 3, "digest": "ab"}
    progress_record.record_progress(str(tmp_path), 0, "layer_00-model_states.pt", entry, 2, "xxh3_64", first=True)
    manifest = {"tag": "global_step16", "rank": 1, "world_size": 2, "attempt": 2, "started_ns": 0, "iteration": 16,
                "checksum": "xxh3_64", "files": {"layer_01-model_states.pt": entry}, "failed": None}
    fs.write_json_atomic(str(tmp_path / ondisk.manifest_name(1)), manifest)
    landed = progress_record.landed_files(str(tmp_path))
    assert set(landed) == {"layer_00-model_states.pt", "layer_01-model_states.pt"}
    found = landed["layer_01-model_states.pt"]
    assert (found.entry["size"], found.entry["digest"], found.algorithm, found.attempt) == (3, "ab", "xxh3_64", 2)


def test_a_progress_line_naming_a_file_outside_the_checkpoint_ends_its_record(tmp_path):
    entry = {"size": 3, "digest": "ab"}
    progress_record.record_progress(str(tmp_path), 0, "a.pt", entry, 1, "xxh3_64", first=True)
    progress_record.record_progress(str(tmp_path), 0, "../b.pt", entry, 1, "xxh3_64", first=False)
    progress_record.record_progress(str(tmp_path), 0, "c.pt", {"size": -1, "digest": "ab"}, 1, "xxh3_64", first=False)
    assert set(progress_record.read_progress(str(tmp_path))) == {"a.pt"}
