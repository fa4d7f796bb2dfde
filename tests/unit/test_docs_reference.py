"""The reference pages are generated from the code (docs/hooks/reference.py): every config key, CLI option and
record field is in them, and a key without a description stops the docs build."""

import importlib.util
import json
import os
import re

import pytest
from mkdocs.exceptions import PluginError
from pydantic import BaseModel, Field

from conftest import ROOT
from cpsr_ds import runlog
from cpsr_ds.cli import WHAT_IF_INPUTS, WHAT_IF_OPTIONS
from cpsr_ds.config import CPSRConfig
from cpsr_ds.recovery.report import RecoveryReport, append_report

spec = importlib.util.spec_from_file_location("reference", os.path.join(ROOT, "docs", "hooks", "reference.py"))
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)


def leaf_keys(model, prefix=""):
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaf_keys(field.annotation, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_config_key_has_a_row_with_its_default():
    page = reference.generate("config")
    keys = list(leaf_keys(CPSRConfig))
    assert len(keys) > 40
    for key in keys:
        assert f"| `{key}` |" in page, key
    assert '| `checkpoint.interval` | int or `"auto"` | `"auto"` |' in page
    assert "| `predictor.history` | int | `4` | >= 2 |" in page


def test_the_config_reference_documents_every_key_and_no_other():
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", reference.generate("config"), flags=re.M))
    assert set(leaf_keys(CPSRConfig)) == documented


def test_a_config_key_without_a_description_stops_the_build():
    class Block(BaseModel):
        described: int = Field(1, description="A key.")
        bare: int = 2

    class Outer(BaseModel):
        inner: Block = Field(default_factory=Block)

    with pytest.raises(PluginError, match=r"cpsr\.inner\.bare has no description"):
        reference.config_reference(Outer)


def test_every_field_a_run_writes_is_in_the_record_schemas(tmp_path):
    report = RecoveryReport("predict", 78, 70, 78, predictor="trend", sources={"0": "survivor", "1": "trend"})
    append_report(str(tmp_path), report)
    written = json.loads((tmp_path / "recovery.jsonl").read_text())
    schema = reference.generate("recovery.jsonl")
    assert set(written) - {"description"} == {row.split("`")[1] for row in schema.splitlines()
                                              if row.startswith("| `")}
    runlog.append(runlog.plans_path(str(tmp_path)), runlog.PlanRow(0, 1, 2.0, "warm-up", 0, "empirical",
                                                                   "recompute", 50))
    plan = json.loads(open(runlog.plans_path(str(tmp_path))).read())
    schema = reference.generate("plans.jsonl")
    for key in plan:
        assert f"| `{key}` |" in schema, key
    assert "| `sources` | object or null |" in reference.generate("recovery.jsonl")
    assert "| `xi` | float or null |" in reference.generate("measurements")


def test_the_cli_page_shows_every_option_of_every_command():
    page = reference.generate("cli")
    flags = [flag for flag, *_ in WHAT_IF_INPUTS + WHAT_IF_OPTIONS] + ["--plot", "--json", "--no-checksums"]
    for flag in flags:
        assert f"  {flag}" in page, flag
    assert "usage: python -m cpsr_ds inspect" in page and "usage: python -m cpsr_ds plan" in page


def test_an_unknown_marker_stops_the_build():
    with pytest.raises(PluginError, match="unknown reference marker 'confg'"):
        reference.generate("confg")
