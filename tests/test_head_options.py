"""Every row of ``kvmesh head`` (its own, kvmesh/api/head_options.py, and the mesh
node's, kvmesh/mesh/options.py) is a flag in ``--help``, a key the config file
accepts and a line of ``kvmesh config show``; ``HeadOptions`` is built from the
same rows, with the same defaults."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.testing import CliRunner

from kvmesh.api.head_options import HEAD_ROWS, HeadOptions
from kvmesh.cli import main
from kvmesh.mesh.options import NODE, Option
from kvmesh.units import parse_size

ROWS = {**HEAD_ROWS, **NODE}


def _sample(row: Option, tmp: Path) -> object:
    """A value the row accepts, as a TOML config file would give it."""
    if row.multiple:
        return ["127.0.0.1:1"]
    if row.kind == "flag":
        return True
    if row.kind == "choice":
        return row.choices[-1]
    if row.kind == "size":
        return "3MiB"
    if row.kind in ("int", "float", "positive"):
        return row.default if row.default is not None else int(row.low or 1)
    if row.kind in ("file", "path"):
        path = tmp / row.name
        path.write_text("x\n")
        return str(path)
    return f"{row.name}-value"


def _toml(value: object) -> str:
    return json.dumps(value)  # what these values need of TOML is JSON's spelling


def test_every_head_option_is_a_row():
    params = {p.name for p in main.commands["head"].params if isinstance(p, click.Option)}
    assert params - {"help", "verbose"} == set(ROWS)


def test_every_row_is_in_help():
    text = "".join(CliRunner().invoke(main, ["head", "--help"]).output.split())
    for name, row in ROWS.items():  # compared without spaces: --help wraps long words
        assert row.flag in text and "".join(row.help.split()) in text, name


def test_every_row_is_a_config_key_shown_by_config_show(tmp_path):
    lines = ["[head]"]
    want = {}
    for name, row in ROWS.items():
        want[name] = _sample(row, tmp_path)
        lines.append(f"{name} = {_toml(want[name])}")
    cfg = tmp_path / "kvmesh.toml"
    cfg.write_text("\n".join(lines) + "\n")
    out = CliRunner().invoke(main, ["--config", str(cfg), "config", "show", "--json"], env={})
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)["head"]
    for name in ROWS:
        assert shown[name] == {"value": want[name], "source": "file"}, name


def test_config_show_defaults_are_the_rows_and_head_options():
    out = CliRunner().invoke(main, ["config", "show", "--json"], env={})
    assert out.exit_code == 0, out.output
    shown = json.loads(out.output)["head"]
    defaults = HeadOptions()
    for name, row in HEAD_ROWS.items():
        assert shown[name] == {"value": row.initial, "source": "default"}, name
        held = getattr(defaults, name)
        if name == "deterministic_grid":  # held as 0 while deterministic is off
            assert held == 0 and HeadOptions(deterministic=True).deterministic_grid == row.default
        elif row.kind == "size" and row.default is not None:
            assert held == parse_size(str(row.default)), name
        else:
            assert held == (() if row.multiple else row.initial), name


def test_head_options_from_values_is_the_rows_parse():
    opts = HeadOptions.from_values(
        {"kv_budget": "1GiB", "shared_tenant": ("a", "b"), "no_publish": True, "seed": ["x"]}
    )
    assert (opts.kv_budget_bytes, opts.shared_tenants, opts.publish) == (1 << 30, ("a", "b"), False)
    assert HeadOptions.from_values({}) == HeadOptions()
    try:
        HeadOptions.from_values({"max_batch": 0})
    except ValueError as e:
        assert "--max-batch" in str(e)
    else:
        raise AssertionError("max_batch 0 accepted")
