"""mkdocs hook: the reference pages' tables, written from the code at build time so that they cannot drift.

A page holds a marker (an HTML comment, ``<!-- reference: NAME -->``) where a generated part goes:
``config`` (every key of the ``"cpsr"`` block, from the pydantic field descriptions in cpsr_ds/config.py),
``cli`` (the help of ``python -m cpsr_ds`` and each command), ``recovery.jsonl``, ``plans.jsonl`` and
``measurements`` (the records' fields, from their dataclasses). A key without a description, or an unknown
marker, stops the build. ``benchmarks/RESULTS.md`` becomes the page ``benchmarks/results.md``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import sys
import types
import typing

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

MARKER = re.compile(r"<!-- reference: ([\w.]+) -->")
RESULTS = os.path.join("benchmarks", "RESULTS.md")
RESULTS_PAGE = "benchmarks/results.md"
# A markdown link to a relative path (not a URL, not an anchor).
RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?![a-z]+:|#)([^)\s]+)\)")


def _repository(config) -> str:
    return os.path.dirname(os.path.abspath(config.config_file_path))


def on_config(config):
    """Document the checkout being built, not an installed copy of the package."""
    root = _repository(config)
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return config


def on_files(files, config):
    """Add the page that carries benchmarks/RESULTS.md, its links to the repository's files as paths."""
    path = os.path.join(_repository(config), RESULTS)
    if not os.path.isfile(path):
        raise PluginError(f"{RESULTS} is missing: the benchmarks page shows it")
    with open(path) as f:
        text = f.read()
    text = RELATIVE_LINK.sub(lambda m: f"{m.group(1)} (`{os.path.normpath(os.path.join('benchmarks', m.group(2)))}`)",
                             text)
    files.append(File.generated(config, RESULTS_PAGE, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: generate(m.group(1)), markdown)


def generate(name: str) -> str:
    """The markdown that the marker ``name`` stands for."""
    from cpsr_ds.config import CPSRConfig
    from cpsr_ds.recovery.report import RecoveryReport
    from cpsr_ds.runlog import CostRow, MemoryPlanRow, PlanRow, StateRow

    parts = {"config": lambda: config_reference(CPSRConfig), "cli": cli_reference,
             "recovery.jsonl": lambda: record_reference(RecoveryReport),
             "plans.jsonl": lambda: record_reference(PlanRow) + "\n" + record_reference(MemoryPlanRow),
             "measurements": lambda: record_reference(StateRow) + "\n" + record_reference(CostRow)}
    if name not in parts:
        raise PluginError(f"unknown reference marker {name!r} (known: {', '.join(parts)})")
    return parts[name]()


def config_reference(model, prefix: str = "") -> str:
    """One table per section of the block: key, type, default, allowed values, description."""
    rows, sections = [], []
    for key, field in model.model_fields.items():
        path = f"{prefix}{key}"
        if _is_model(field.annotation):
            sections.append(f"## `{path}`\n\n" + config_reference(field.annotation, f"{path}."))
            continue
        if not field.description:
            raise PluginError(f"cpsr.{path} has no description in cpsr_ds/config.py: the reference needs one")
        rows.append(f"| `{path}` | {type_name(field.annotation)} | {_default(field)} | {_bounds(field)} | "
                    f"{_cell(field.description)} |")
    table = "| key | type | default | allowed | meaning |\n| --- | --- | --- | --- | --- |\n" + "\n".join(rows)
    return "\n\n".join(([table] if rows else []) + sections) + "\n"


def _is_model(annotation) -> bool:
    return inspect.isclass(annotation) and hasattr(annotation, "model_fields")


def type_name(annotation) -> str:
    """A type as a reader of JSON sees it: ``int``, ``"a" or "b"``, ``float or null``, ``list of int``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(f'`"{a}"`' for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named + (["`null`"] if type(None) in args else []))
    if origin is list:
        return f"list of {type_name(args[0])}"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(annotation, f"`{annotation}`")


def _default(field) -> str:
    value = field.get_default(call_default_factory=True)
    return f"`{json.dumps(value)}`"


BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="))


def _bounds(field) -> str:
    found = [f"{sign} {getattr(m, name)}" for m in field.metadata for name, sign in BOUNDS
             if getattr(m, name, None) is not None]
    return ", ".join(found)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def record_reference(cls) -> str:
    """A record's fields (name, JSON type) with the comment beside each, under the class's docstring. Every
    field is in every line (the writers dump the whole dataclass); ``kind`` names the record's class."""
    comments = field_comments(cls)
    doc = ast.get_docstring(ast.parse(inspect.getsource(cls)).body[0])
    rows = [f"| `{f.name}` | {_json_type(f)} | {_cell(comments.get(f.name, ''))} |" for f in dataclasses.fields(cls)]
    head = f"### `{cls.__name__}`\n\n" + (f"{doc}\n\n" if doc else "")
    return head + "| field | type | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"


JSON_TYPES = {"str": "string", "int": "int", "float": "float", "dict": "object", "list": "list", "None": "null"}


def _json_type(field) -> str:
    """A field's annotation (a string: the modules postpone their annotations) as JSON types."""
    if field.name == "kind":
        return f"`{json.dumps(field.default)}`"
    written = re.sub(r"Optional\[(.+)\]", r"\1 | None", str(field.type))
    return " or ".join(_json_name(part.strip()) for part in written.split("|"))


def _json_name(python: str) -> str:
    if python.startswith("dict"):
        return "object"
    item = re.fullmatch(r"list\[(.+)\]", python)
    return f"list of {_json_name(item.group(1))}" if item else JSON_TYPES.get(python, python)


def field_comments(cls) -> dict[str, str]:
    """Each dataclass field's comment: the ``#`` lines just above it and the one beside it."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign):
            continue
        above = []
        for line in reversed(lines[:node.lineno - 1]):
            if not line.strip().startswith("#"):
                break
            above.insert(0, line.strip().lstrip("#").strip())
        beside = lines[node.lineno - 1].partition("  #")[2].strip()
        comments[node.target.id] = " ".join(above + [beside]).strip()
    return comments


def cli_reference() -> str:
    """The help of ``python -m cpsr_ds`` and of each command, as the command line prints it."""
    from cpsr_ds.cli import main

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    parts = []
    for command in ([], ["inspect"], ["plan"]):
        out = io.StringIO()
        with contextlib.suppress(SystemExit):
            main([*command, "--help"], out=out)
        title = " ".join(["python -m cpsr_ds", *command])
        parts.append(f"### `{title}`\n\n```text\n{out.getvalue().rstrip()}\n```\n")
    return "\n".join(parts)
