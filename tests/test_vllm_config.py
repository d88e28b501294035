"""The vLLM connector's settings are ``kvmesh head``'s options, from one declaration
(kvmesh/mesh/options.py): same names, defaults, help and checks; docs/vllm.md's
table is made from it. Runs in the main environment (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from kvmesh.cli import main
from kvmesh.errors import ConfigError
from kvmesh.mesh.options import EVENTS, NODE
from kvmesh.vllm.config import (
    ALIASES,
    CONNECTOR_ONLY,
    HEAD_KEYS,
    KEYS,
    parse_settings,
    settings_table,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm.md"


def _head_options() -> dict[str, click.Option]:
    params = main.commands["head"].params
    return {p.name: p for p in params if isinstance(p, click.Option) and p.name}


def _plain(opt: click.Option, value: object) -> object:
    """A click default as the connector holds it: a list for a repeatable option,
    False for an unset flag, None for no default."""
    unset = value is None or str(value) == "Sentinel.UNSET"  # click 8.3's "no default"
    if opt.multiple:
        return [] if unset else list(value)
    if opt.is_flag:
        return bool(value) and not unset
    return None if unset else value


def test_every_connector_key_is_a_head_option_with_its_default_and_help():
    head = _head_options()
    ctx = click.Context(main.commands["head"])
    values = parse_settings({}).values
    for key in HEAD_KEYS:
        opt = head[key]
        assert opt.help == KEYS[key].help == NODE[key].help, key
        assert opt.opts == [KEYS[key].flag], key
        assert values[key] == _plain(opt, opt.get_default(ctx)), key
    own = {o.name for o in CONNECTOR_ONLY}
    assert set(KEYS) == set(HEAD_KEYS) | own and not own & set(head)
    assert all(o.help for o in CONNECTOR_ONLY)
    # what the connector leaves out is what a vLLM process gets elsewhere
    assert set(NODE) - set(HEAD_KEYS) == set(EVENTS)


def test_an_unknown_key_lists_every_valid_one():
    with pytest.raises(ConfigError, match="unknown key 'sed'") as e:
        parse_settings({"seed": "a:1", "sed": "b:2"})
    valid = str(e.value).split("valid: ")[1].split(", ")
    assert sorted(valid) == sorted([*KEYS, *ALIASES])


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"budget": "lots"}, "budget = 'lots' is not valid: bad size"),
        ({"disk_admit": "sometimes"}, "disk_admit .* expected one of evicted, hit"),
        ({"fleet_key_file": "/nonexistent/fleet.key"}, "fleet_key_file = .* no such file"),
        ({"max_members": 0}, "max_members = 0 is not valid"),
        ({"max_members": 2.5}, "max_members = 2.5 is not valid: expected an integer"),
        ({"ttl": 0}, "ttl = 0 is not valid: expected a positive number"),
        ({"gossip_interval": "inf"}, "gossip_interval = 'inf' is not valid: expected a finite"),
        (
            {"data_port": 70000},
            "data_port = 70000 is not valid: expected an integer >= 0 and <= 65535",
        ),
        ({"lookup_timeout": "soon"}, "lookup_timeout"),
        ({"prefill_tps": -5}, "prefill_tps"),
        ({"no_bulk": "maybe"}, "no_bulk = 'maybe' is not valid: expected true or false"),
        ({"seed": 7}, "seed = 7"),
        ({"advertise": ["a:1", 2]}, "advertise"),
        ({"alias": True}, "alias = True"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_key(extra, says):
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config: {says}"):
        parse_settings(extra)


def test_values_are_parsed_as_declared():
    s = parse_settings(
        {"seed": "a:1, ,b:2", "budget": 4 << 30, "no-bulk": "1", "ttl": "2.5", "max_members": "9"}
    )
    assert s["seed"] == ["a:1", "b:2"] and s["budget"] == str(4 << 30)
    assert s["no_bulk"] is True and s["ttl"] == 2.5 and s["max_members"] == 9
    cfg = s.node_config()
    assert not cfg.bulk and cfg.ttl == 2.5 and cfg.max_members == 9 and cfg.seeds == ["a:1", "b:2"]


def test_a_fixed_port_is_rank_zeros():
    s = parse_settings(
        {"listen": "127.0.0.1:7100", "data_port": 7200, "advertise_data_port": 7300, "alias": "g"}
    )
    one = s.node_config(1, 2)
    assert (one.listen, one.data_port, one.advertise_data_port) == ("127.0.0.1:7101", 7201, 7301)
    assert one.alias == "g-tp1" and one.roles == ("head",)
    zero = s.node_config()
    assert (zero.listen, zero.data_port, zero.roles) == ("127.0.0.1:7100", 7200, ("head", "cache"))


def test_the_docs_table_is_the_declarations():
    text = DOC.read_text()
    begin = "<!-- settings table: kvmesh.vllm.config.settings_table() -->\n"
    table = text.split(begin)[1].split("<!-- end of settings table -->")[0]
    assert table == settings_table()
    for key in KEYS:
        assert f"| `{key}`" in table
