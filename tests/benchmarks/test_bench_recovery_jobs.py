"""bench_recovery --layouts (benchmarks/common/recovery_jobs.py): the failed job's run directory made from the reference's,
the copies each method restarts from, and the summary, on synthetic directories and cases."""

import argparse
import importlib
import json
import os
import shutil

import pytest

from support.checkpoints import make_checkpoint
from cpsr_ds.checkpoint.storage import catalog, records
from cpsr_ds.checkpoint.storage.filesystem import fs


@pytest.fixture(scope="module")
def jobs():
    return importlib.import_module("benchmarks.common.recovery_jobs")


@pytest.fixture
def layouts(jobs, tmp_path):
    """A pp2 reference after 35 iterations: checkpoints every 10, each rank's journal, measurements, summaries."""
    made = jobs.Layouts(argparse.Namespace(intervals_per_run=20, out_dir=str(tmp_path)), "pp2", 7, 10)
    ref = made.ref_dir
    for iteration in (10, 20, 30):
        make_checkpoint(ref, f"global_step{iteration}")
    fs.write_json_atomic(os.path.join(ref, "cpsr_attempt.json"), {"attempt": 1})
    for rank in (0, 1):
        os.makedirs(os.path.join(ref, "journal"), exist_ok=True)
        with open(os.path.join(ref, "journal", f"rank{rank:05d}.csv"), "w") as f:
            f.writelines(f"{i},{5 - i / 100},{1000 + i}\n" for i in range(1, 36))
        os.makedirs(os.path.join(ref, "measurements"), exist_ok=True)
        with open(os.path.join(ref, "measurements", f"rank{rank:05d}.jsonl"), "w") as f:
            f.writelines(json.dumps({"iteration": i, "kind": "state"}) + "\n" for i in (10, 20, 30))
        os.makedirs(os.path.join(ref, "predictor_summaries", f"rank{rank:05d}"))
        for i in (10, 20, 30):
            open(os.path.join(ref, "predictor_summaries", f"rank{rank:05d}", f"{i:09d}-1.pt"), "w").close()
    with open(os.path.join(ref, "validation.csv"), "w") as f:
        f.write("0,5.0\n20,4.0\n")
    yield made
    made.close()


def test_the_failed_job_starts_from_what_the_reference_had_right_after_c(layouts, tmp_path):
    run = str(tmp_path / "failed")
    layouts.as_after(20, run)
    assert sorted(d for d in os.listdir(run) if d.startswith("global_step")) == ["global_step10", "global_step20"]
    assert records.read_latest(run) == "global_step20"
    for rank in (0, 1):
        with open(os.path.join(run, "journal", f"rank{rank:05d}.csv")) as f:
            assert [int(line.split(",")[0]) for line in f][-1] == 20
        with open(os.path.join(run, "measurements", f"rank{rank:05d}.jsonl")) as f:
            assert [json.loads(line)["iteration"] for line in f] == [10, 20]
        assert sorted(os.listdir(os.path.join(run, "predictor_summaries", f"rank{rank:05d}"))) == \
            ["000000010-1.pt", "000000020-1.pt"]
    assert os.path.exists(os.path.join(run, "cpsr_attempt.json"))
    assert not os.path.exists(os.path.join(run, "validation.csv"))  # the restarted run's curve is its own
    assert [ck.tag for ck in catalog.list_checkpoints(run) if ck.valid] == ["global_step10", "global_step20"]


def test_each_method_s_copy_shares_the_checkpoint_files_but_not_what_a_job_appends_to(jobs, layouts, tmp_path):
    failed, copy = str(tmp_path / "failed"), str(tmp_path / "copy")
    layouts.as_after(20, failed)
    shutil.copytree(failed, copy, copy_function=jobs.link_or_copy)
    ckpt = os.path.join("global_step20", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert os.stat(os.path.join(failed, ckpt)).st_ino == os.stat(os.path.join(copy, ckpt)).st_ino
    journal = os.path.join("journal", "rank00000.csv")
    with open(os.path.join(copy, journal), "a") as f:
        f.write("21,4.79,1021\n")
    with open(os.path.join(failed, journal)) as f:
        assert f.read().splitlines()[-1].startswith("20,")


def test_the_summary_reports_each_method_and_checks_the_recovery_s_estimates(jobs):
    Case = jobs.Case

    def case(method, lag, estimate=None, lost=0):
        return Case(1, method, 50, 500, 25, lag, 1 - lag / 25, lag, 1 - lag / 25, 0.0, 0, 0.001, decision="",
                    cost_model={} if estimate is None else {"estimates": {"empirical": estimate}},
                    restart_s=8.0, bytes_read=110, checkpoint_bytes=100, lost=lost)

    cases = [case("sources", lag, est) for lag, est in ((1.0, 2.0), (2.0, 4.0), (4.0, 8.0))]
    cases.append(case("sources", 25.0, lost=25))  # recomputed: its lag is d, no estimate to check
    out = jobs.summarize(argparse.Namespace(quick=True), {"pp2": {"cases": cases, "references": {}, "layout": {}}})
    part = out["layouts"]["pp2"]
    assert part["max_lost"]["sources"] == 25 and part["median_read_over_checkpoint"]["sources"] == pytest.approx(1.1)
    assert part["median_reduction"]["sources"] == pytest.approx(1 - 3.0 / 25)
    check = part["cost_model"]["sources"]["empirical"]
    assert check["n"] == 3 and check["median_ratio"] == pytest.approx(2.0) and check["spearman"] == pytest.approx(1.0)
