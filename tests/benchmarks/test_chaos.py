"""The fault campaign's machinery: every fault can be chosen by name, its JSON counts trials, violations and
skipped trials per fault and is written as trials end, and a campaign cut short resumes from it."""

import importlib
import json

import pytest


NEW_FAULTS = ("planted_root", "planted_tag", "modes", "foreign_lock", "copied_run", "invalid_state", "crash_loop",
              "clean_end", "rbr_exact", "config")


@pytest.fixture(scope="module")
def chaos():
    return importlib.import_module("benchmarks.chaos")


def test_every_fault_is_a_trial_kind_and_an_unknown_name_is_refused_naming_it(chaos, capsys):
    assert set(NEW_FAULTS) <= set(chaos.FAULTS)
    assert all(callable(getattr(chaos, f"fault_{name}")) for name in chaos.FAULTS)
    with pytest.raises(SystemExit):
        chaos.main(["--faults", "planted_root,cspr"])
    assert "'cspr'" in capsys.readouterr().err


def test_a_campaign_cut_short_keeps_its_trials_and_resumes_with_the_rest(chaos, tmp_path):
    result = tmp_path / "chaos.json"
    common = ["--faults", "rank_write", "--json", str(result), "--out-dir", str(tmp_path / "trials")]
    chaos.main(["--trials", "1", *common])
    first = json.loads(result.read_text())
    assert {k: first["faults"]["rank_write"][k] for k in ("trials", "skipped", "skip_reason")} == \
        {"trials": 1, "skipped": 0, "skip_reason": None}
    assert first["faults"]["rank_write"]["violations"] == first["total_violations"]

    chaos.main(["--trials", "2", "--resume", *common])
    second = json.loads(result.read_text())
    cases = second["cases"]["rank_write"]
    assert [c["trial"] for c in cases] == [0, 1]
    assert cases[0] == first["cases"]["rank_write"][0]  # kept, not run again
    assert (second["total_trials"], second["faults"]["rank_write"]["trials"]) == (2, 2)
    assert second["faults"]["rank_write"]["mean_cpu_seconds"] > 0
