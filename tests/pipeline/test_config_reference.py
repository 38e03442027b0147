"""Issue 29, "your own data, documented": the config reference generated from the schema (and
committed as docs/config.md, kept in sync here), "did you mean" hints for unknown keys, and the
missing-field error naming the config key that selects the column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import PrivPromptConfig, parse_config
from tasks.config_reference import all_keys, did_you_mean, markdown
from tasks.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]


def _minimal(**extra) -> dict:
    raw = {"data": {"name": "tickets", "labels": ["a", "b"]}, "models": {"local": "tiny-bert"}}
    for block, values in extra.items():
        raw.setdefault(block, {}).update(values)
    return raw


def test_docs_config_md_is_the_generated_reference():
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == markdown(), ("docs/config.md is out of date with the schema: regenerate it with "
                                     "`.venv/bin/privprompt config --schema > docs/config.md`")


def test_cli_config_schema_prints_every_key(capsys):
    import privprompt_cli

    assert privprompt_cli.main(["config", "--schema"]) == 0
    out = capsys.readouterr().out
    assert out == markdown()
    rows = {line.split("`")[1] for line in out.splitlines() if line.startswith("| `")}
    assert set(all_keys()) == rows  # every key of the schema has its row, and nothing else
    for key in ("data.path", "data.text_field", "data.label_field", "data.label_map", "data.train_fraction",
                "data.test_fraction", "models.label_descriptions", "models.template", "privacy.target_epsilon",
                "privacy.dataset_epsilon_cap", "methods.prompt_dpsgd.max_grad_norm", "models.endpoints[].alias"):
        assert key in rows, key
    row = next(line for line in out.splitlines() if line.startswith("| `data.labels` |"))
    assert "**required**" in row and "at least 2 items" in row
    row = next(line for line in out.splitlines() if line.startswith("| `data.holdout_fraction` |"))
    assert "`0.1`" in row and "> 0, < 1" in row


def test_reference_defaults_are_the_schemas():
    """The defaults the reference states are what validation fills in."""
    cfg = PrivPromptConfig.model_validate(_minimal()).model_dump(mode="json")
    rows = {line.split("`")[1]: line.split(" | ") for line in markdown().splitlines() if line.startswith("| `")}
    checked = 0
    for key, cells in rows.items():
        default = cells[2].strip()
        if not default.startswith("`") or "[]" in key:
            continue
        node = cfg
        for part in key.split("."):
            node = node[part] if node is not None else None
        if node is None and key.split(".")[0] in ("public", "sweep_dask"):  # optional blocks, absent by default
            continue
        assert json.loads(default.strip("`")) == node, key
        checked += 1
    assert checked > 50


def test_user_facing_data_and_model_keys_are_described():
    rows = {line.split("`")[1]: line for line in markdown().splitlines() if line.startswith("| `")}
    for key in [k for k in rows if k.startswith(("data.", "models.", "privacy."))]:
        assert not rows[key].rstrip().endswith("|  |"), f"{key} has no description"
    assert "FIRST token" in rows["models.label_descriptions"] and "cosine" in rows["models.label_descriptions"]


@pytest.mark.parametrize("extra, message", [
    ({"data": {"text_feild": "body"}}, "data.text_feild: unknown config key (did you mean 'data.text_field'?)"),
    ({"models": {"templete": "{text}"}}, "models.templete: unknown config key (did you mean 'models.template'?)"),
    ({"data": {"label_descriptions": {"a": "x"}}},
     "data.label_descriptions: unknown config key (did you mean 'models.label_descriptions' (a key of another block)?)"),
    ({"methods": {"prompt_dpsgd": {"max_grad_nrom": 1.0}}},
     "did you mean 'methods.prompt_dpsgd.max_grad_norm'?"),
    ({"privacy": {"dataset_epsilon_caps": 5}}, "did you mean 'privacy.dataset_epsilon_cap'"),
])
def test_unknown_keys_get_a_did_you_mean_hint(extra, message):
    with pytest.raises(ConfigError) as err:
        parse_config(_minimal(**extra))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_no_hint_for_a_key_like_nothing():
    with pytest.raises(ConfigError) as err:
        parse_config(_minimal(data={"qqqqzz": 1}))
    assert str(err.value) == "invalid config: data.qqqqzz: unknown config key"
    assert did_you_mean(("models", "endpoints", 0, "alais")) == "did you mean 'models.endpoints.alias'?"


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_missing_field_names_the_config_key(tmp_path, fmt):
    from tasks.data import read_split

    from tasks.schema import DataConfig

    rows = [{"body": "printer is on fire", "category": "hardware"}, {"body": "cannot log in", "category": "account"}]
    folder = tmp_path / "tickets"
    folder.mkdir()
    if fmt == "csv":
        (folder / "train.csv").write_text("body,category\n" + "".join(f"{r['body']},{r['category']}\n" for r in rows))
    elif fmt == "jsonl":
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), folder / "train.parquet")
    cfg = DataConfig(name="tickets", path=str(folder), labels=["hardware", "account"])
    with pytest.raises(DataError) as err:
        read_split(cfg, None, "train")
    msg = str(err.value)
    assert "record 1: missing field 'text'" in msg and "set data.text_field" in msg
    assert "'body'" in msg and "'category'" in msg and "printer" not in msg  # names, never values
    cfg = DataConfig(name="tickets", path=str(folder), labels=["hardware", "account"], text_field="body")
    with pytest.raises(DataError) as err:
        read_split(cfg, None, "train")
    assert "missing field 'label'" in str(err.value) and "set data.label_field" in str(err.value)
    cfg = DataConfig(name="tickets", path=str(folder), labels=["hardware", "account"], text_field="body",
                     label_field="category")
    assert read_split(cfg, None, "train") == (["printer is on fire", "cannot log in"], ["hardware", "account"])
