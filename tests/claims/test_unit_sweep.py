"""A sweep over the privacy unit on ONE ledger (issue 28, "the nightly comparison can sweep the unit"):
the dataset is registered per person (data.privacy_unit: author); the record-level variant bounds each
person's records (data.person_field + data.max_records_per_unit = k) and is charged the group-privacy
bound for k records (privacy/group.py), so the ledger's composed per-person ε includes that charge;
a plain record-level run stays refused with a message saying how to be charged; `plan` and `run` agree."""

import json

import pytest

from tests.pipeline.test_flow import _config, _mlflow

K = 2
SIZES = [1, 2, 3, 5, 8, 1, 1, 4, 2, 6, 1, 3, 2, 1, 7, 2, 1, 1, 3, 2] * 3  # records per synthetic person (60 people)


@pytest.fixture(scope="module")
def people(tmp_path_factory):
    """A JSONL source whose records carry an `author` field (synthetic people, toy texts)."""
    folder = tmp_path_factory.mktemp("unit-sweep") / "data"
    folder.mkdir()
    words = ["good", "bad", "fine", "dull", "great", "awful", "warm", "cold"]
    train = []
    for u, k in enumerate(SIZES):
        for j in range(k):
            label = ["negative", "positive"][(u + j) % 2]
            train.append({"text": f"{words[(u + j) % 8]} film {u} part {j} {words[(3 * u + j) % 8]}", "label": label,
                          "author": f"person-{u}"})
    test = [{"text": f"{words[i % 8]} movie {i}", "label": ["negative", "positive"][i % 2], "author": f"t-{i}"}
            for i in range(40)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    return folder


def _cfg(people, state, **extra) -> dict:
    from tasks.state import SECRET_NAME

    (state / "secrets").mkdir(parents=True, exist_ok=True)  # a fixed key: the toy's keyed splits are reproducible
    (state / "secrets" / SECRET_NAME).write_bytes(bytes(range(32)))
    cfg = _config(people, state, **extra)
    cfg["data"].update({"name": "people", "labels": ["negative", "positive"], "holdout_fraction": 0.2,
                        "size_noise_sigma": 5.0})
    cfg["methods"]["zero_shot"]["enabled"] = False
    cfg["methods"]["prompt_sgd"]["enabled"] = False
    cfg["mia"]["enabled"] = False
    cfg["privacy"].update({"target_delta": 1e-4, "dataset_epsilon_cap": 500.0})
    return cfg


def _unit_sweep(people, state) -> dict:
    cfg = _cfg(people, state, grid={"data.privacy_unit": ["author", "record"]})
    cfg["data"].update({"person_field": "author", "max_records_per_unit": K})
    return cfg


def test_the_config_expresses_a_record_level_run_on_people():
    from tasks.config import DataConfig

    base = {"name": "x", "labels": ["a", "b"]}
    grouped = DataConfig(**base, person_field="author", max_records_per_unit=3)
    assert (grouped.unit_field, grouped.group_size, grouped.charge_unit) == ("author", 3, "author")
    assert not grouped.user_unit
    user = DataConfig(**base, privacy_unit="author", person_field="author", max_records_per_unit=3)
    assert (user.group_size, user.charge_unit) == (None, "author")
    assert DataConfig(**base).charge_unit == "record" and DataConfig(**base).group_size is None
    with pytest.raises(ValueError, match="set data.max_records_per_unit"):
        DataConfig(**base, person_field="author")
    with pytest.raises(ValueError, match="differs from data.privacy_unit"):
        DataConfig(**base, privacy_unit="author", person_field="email")
    with pytest.raises(ValueError, match="which is data.text_field"):
        DataConfig(**base, person_field="text", max_records_per_unit=2)


def test_a_grouped_partition_splits_whole_people_caps_them_and_counts_records(people, tmp_path):
    from tasks.config import DataConfig
    from tasks.data import partition_dataset, read_partition_split, read_partition_units
    from tasks.state import SECRET_NAME

    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / SECRET_NAME).write_bytes(bytes(range(32)))
    owner = {json.loads(l)["text"]: json.loads(l)["author"] for l in (people / "train.jsonl").open()}
    kw = {"name": "people", "path": str(people), "labels": ["negative", "positive"], "holdout_fraction": 0.2}
    grouped = partition_dataset(DataConfig(**kw, person_field="author", max_records_per_unit=K), 0,
                                tmp_path / "private", None)
    user = partition_dataset(DataConfig(**kw, privacy_unit="author", max_records_per_unit=K), 0,
                             tmp_path / "private", None)
    assert (grouped.unit, grouped.ledger_unit, grouped.group_size) == ("record", "author", K)
    assert read_partition_units(grouped.train_path) is None  # the mechanism is per record: rows carry no units
    assert grouped.sizes.unit == "record"  # released sizes count records (a person moves them by ≤ k)
    g_train, u_train = read_partition_split(grouped.train_path)[0], read_partition_split(user.train_path)[0]
    assert sorted(g_train) == sorted(u_train)  # the same people, split and capped alike by the field
    g_hold = read_partition_split(grouped.holdout_path)[0]
    people_train, people_hold = {owner[t] for t in g_train}, {owner[t] for t in g_hold}
    assert people_train and people_hold and not people_train & people_hold  # whole people per split
    per_person = {}
    for t in g_train + g_hold:
        per_person[owner[t]] = per_person.get(owner[t], 0) + 1
    assert max(per_person.values()) == K


@pytest.mark.slow  # suite time: runs with -m slow
def test_plan_charges_the_record_level_variant_per_person_and_refuses_a_plain_one(people, tmp_path):
    """`privprompt plan` of the unit sweep on a ledger whose dataset is registered per person: the
    record-level variant's row shows its per-record ε and its (larger) per-person charge, the dataset's
    total composes the charge; a record-level config without a bound on each person's records is refused."""
    from privacy.ledger import UnitMismatchError
    from tasks.config import parse_config, sweep_variants
    from tasks.data import partition_dataset
    from tasks.charge import ensure_dataset
    from tasks.planning import format_plan, plan_runs
    from tasks.state import state_paths

    state = tmp_path / "state"
    variants = sweep_variants(parse_config(_unit_sweep(people, state)))
    paths = state_paths(str(state)).create()
    user_cfg = variants[0][1]
    part = partition_dataset(user_cfg.data, 0, paths.private, None)
    assert ensure_dataset(paths.open_ledger(), part, 500.0, 1e-4)["unit"] == "author"  # as a user-level run registers it
    planned = plan_runs(variants, paths)
    user_row, record_row = planned["runs"]
    assert record_row["epsilon_per_record"] <= 4.0 < record_row["epsilon"] and user_row["epsilon"] <= 4.0
    (d,) = planned["datasets"].values()
    # the dataset's total composes the per-person charge (the flow test checks it against the committed events)
    assert record_row["epsilon"] < d["total_epsilon"] < record_row["epsilon"] + user_row["epsilon"] and d["fits"]
    text = format_plan(planned)
    assert f"charged per person (≤ {K} author records, exact mixture of Gaussians)" in text
    # a user-level run's per-person ε beside the record-level run's (issue 37)
    assert record_row["user_level"]["epsilon"] <= 4.0 * (1 + 1e-6) < record_row["epsilon"]
    assert "beside it, a user-level run (data.privacy_unit: author) at the same target" in text
    plain = parse_config(_cfg(people, state, **{"privacy.target_epsilon": 1.0}))
    with pytest.raises(UnitMismatchError) as err:
        plan_runs([("plain", plain)], paths)
    msg = str(err.value)
    assert "data.max_records_per_unit" in msg and "data.person_field: author" in msg and "\n" not in msg


@pytest.mark.slow  # two method flows of a sweep and a refused one (≈ 50 s on 2 cores)
def test_a_unit_sweep_on_one_ledger_charges_the_record_level_run_per_person(prefect_harness, people, tmp_path):
    from flows.method_flow import method_flow
    from flows.sweep import sweep_flow
    from privacy import events as ev
    from privacy.accountant import spend
    from privacy.group import group_event
    from privacy.ledger import Ledger, UnitMismatchError
    from tasks.config import parse_config, sweep_variants
    from tasks.planning import format_plan, plan_runs
    from tasks.state import state_paths

    state = tmp_path / "state"
    cfg = _unit_sweep(people, state)
    variants = sweep_variants(parse_config(cfg))
    assert [label for label, _ in variants] == ["data.privacy_unit=author", "data.privacy_unit=record"]
    planned = plan_runs(variants, state_paths(str(state)))  # `privprompt plan`, before anything ran
    user_row, record_row = planned["runs"]
    assert "epsilon_per_record" not in user_row and user_row["epsilon"] <= 4.0
    assert record_row["epsilon_per_record"] <= 4.0 < record_row["epsilon"]  # the per-person charge is larger
    assert f"charged per person (≤ {K} author records, exact mixture of Gaussians)" in format_plan(planned)

    out = sweep_flow(cfg)
    rows = {r["variant"]: r for r in out["variants"]}
    user, record = rows["data.privacy_unit=author"], rows["data.privacy_unit=record"]
    client = _mlflow(state)
    rec_run = client.get_run(record["mlflow_run_id"])
    assert rec_run.data.params["privacy.unit"] == "author"  # every ε of the run is stated per person
    assert rec_run.data.params["privacy.mechanism_unit"] == "record"
    assert rec_run.data.params["data.person_field"] == "author"
    assert rec_run.data.params["data.max_records_per_unit"] == str(K)
    per_person, per_record = rec_run.data.metrics["privacy.epsilon"], rec_run.data.metrics["privacy.epsilon_per_record"]
    assert per_record <= 4.0 * (1 + 1e-6) < per_person
    assert record["privacy.epsilon_per_record"] == pytest.approx(per_record)
    # plan and run agree (the worst case was spent: no early stop)
    assert per_person == pytest.approx(record_row["epsilon"], rel=1e-6)
    assert per_record == pytest.approx(record_row["epsilon_per_record"], rel=1e-6)
    assert client.get_run(user["mlflow_run_id"]).data.params["privacy.unit"] == "author"

    ledger = Ledger(state / "ledger.sqlite")
    (dataset,) = ledger.datasets()
    assert dataset["unit"] == "author" and dataset["committed_runs"] == 2 and dataset["reserved_runs"] == 0
    entries = [e for e in ledger.entries() if e["kind"] == "dp"]
    by_run = {e["run_id"].split(":")[0]: e for e in entries}
    rec_flow = rec_run.data.tags["prefect.flow_run_id"]
    charged = ev.event_from_dict(by_run[rec_flow]["committed_event"])
    # the committed event IS the group transform of the run's per-record event, whose ε is privacy.epsilon_per_record
    assert "per author" in by_run[rec_flow]["description"]
    manifest = json.loads(next((state / "private" / "runs").glob(f"{rec_flow}*/releases/prompt_dpsgd.json")).read_text())
    per_record_event = ev.event_from_json(manifest["record_event"])
    assert group_event(per_record_event, K) == charged
    assert spend(per_record_event, 1e-4).epsilon == pytest.approx(per_record)
    # the ledger's composed per-person ε includes the grouped charge: it is the composition of the two
    # committed events, above either alone and above what the per-record statement would have composed to
    events = [ev.event_from_dict(e["committed_event"]) for e in entries]
    spent = dataset["spent_epsilon"]
    assert spent == pytest.approx(spend(ev.ComposedEvent(tuple(events)), 1e-4).epsilon, rel=1e-9)
    others = [e for e in events if e != charged]
    undercount = spend(ev.ComposedEvent(tuple(others + [per_record_event])), 1e-4).epsilon
    assert spent > per_person and spent > undercount

    # a record-level run WITHOUT a bound on each person's records: refused by plan and by run, one line saying how
    plain = parse_config(_cfg(people, state, **{"privacy.target_epsilon": 1.0}))
    with pytest.raises(UnitMismatchError) as err:
        plan_runs([("plain", plain)], state_paths(str(state)))
    msg = str(err.value)
    assert "data.max_records_per_unit" in msg and "data.person_field: author" in msg and "\n" not in msg
    with pytest.raises(Exception, match="data.max_records_per_unit"):
        method_flow(plain.model_dump(mode="json"))
    assert len(ledger.entries()) == len(Ledger(state / "ledger.sqlite").entries())
    assert Ledger(state / "ledger.sqlite").dataset(dataset["fingerprint"])["spent_epsilon"] == pytest.approx(spent)


def test_methods_without_a_group_rule_are_refused_before_anything_runs(people, tmp_path):
    """DP-OPT's limited-domain / argmax events and RAPT's local DP have no per-person charge here: a
    one-line ConfigError naming the method and the event, from the plan (before any reservation)."""
    from tasks.config import parse_config
    from tasks.data import ReleasedSizes
    from tasks.errors import ConfigError
    from tasks.run_plan import plan_for

    cfg = _cfg(people, tmp_path / "state")
    cfg["data"].update({"person_field": "author", "max_records_per_unit": K})
    cfg["models"]["local"] = "tiny-gpt2"
    cfg["method"] = "dp_opt"
    cfg["methods"] = {"dp_opt": {"meta_prompts": 4, "demos": 2, "max_new_tokens": 4, "candidates": 2}}
    sizes = ReleasedSizes(n_train=400, n_holdout=80, n_test=40, sigma=5.0)
    with pytest.raises(ConfigError) as err:
        plan_for(parse_config(cfg), "dp_opt", sizes, 1e-4)
    assert "dp_opt:" in str(err.value) and "LimitedDomainEvent" in str(err.value) and "\n" not in str(err.value)
    cfg["method"], cfg["methods"] = "rapt", {}
    cfg["public"] = {"name": "tweet_sentiment", "split": "validation", "size": 20}
    with pytest.raises(ConfigError, match="methods.rapt is local DP"):
        parse_config(cfg)


@pytest.mark.slow  # σ calibrations of the candidate and the selection (≈ 11 s)
def test_a_private_selection_is_charged_per_person_or_refused_by_its_mode(people, tmp_path):
    """Every candidate once (composed; DP-SGD trainings and Gaussian holdout counts, each of L2
    sensitivity 1 per record) has a group rule: charged per person. Random stopping (repeat and
    select) has none: refused at config time in one line naming the event (issue 35)."""
    from privacy.accountant import spend
    from privacy.group import group_event
    from tasks.config import parse_config
    from tasks.data import ReleasedSizes
    from tasks.errors import ConfigError
    from tasks.run_plan import planned_epsilon
    from tasks.run_plan import plan_for

    cfg = _cfg(people, tmp_path / "state")
    cfg["data"].update({"person_field": "author", "max_records_per_unit": K})
    cfg["selection"] = {"enabled": True, "candidates": [{"lr": 0.05}]}
    sizes = ReleasedSizes(n_train=400, n_holdout=80, n_test=40, sigma=5.0)
    parsed = parse_config(cfg)
    plan = plan_for(parsed, "prompt_dpsgd", sizes, 1e-4)
    assert plan.event == group_event(plan.record_event, K)
    assert planned_epsilon(parsed, "prompt_dpsgd", plan, 1e-4) <= 4.0 * (1 + 1e-6) < spend(plan.event, 1e-4).epsilon
    assert plan.params["selection.score_counts"] == f"rows, at most {K} per author (charged at sensitivity {K} per author)"
    cfg["selection"]["mode"] = "random_stopping"
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    msg = str(err.value)
    assert "selection.mode: random_stopping" in msg and "RepeatAndSelectEvent" in msg and "\n" not in msg


@pytest.mark.slow  # ~30 s: two plans with the exact group charge
def test_the_plans_user_level_line_releases_nothing_of_its_own(people, tmp_path):
    """Planning a record-level run charged per person shows a user-level run's per-person ε beside
    it only from sizes a user-level variant released; it never draws them itself (a draw no run
    would charge: review F6), and `privprompt run`'s budget check plans the same way."""
    from tasks.config import parse_config, sweep_variants
    from tasks.planning import plan_runs
    from tasks.state import state_paths

    state = tmp_path / "state"
    raw = _cfg(people, state)
    raw["data"].update({"person_field": "author", "max_records_per_unit": K})
    paths = state_paths(str(state)).create()
    planned = plan_runs([("", parse_config(raw))], paths, checks=False)
    (row,) = planned["runs"]
    assert "plan a variant with data.privacy_unit: author" in row["user_level"]["refused"]
    assert len(list((paths.private / "released-sizes").iterdir())) == 1  # the run's own draw only
    # once a user-level variant is planned (it releases its sizes, for its run), the number shows
    planned = plan_runs(sweep_variants(parse_config(_unit_sweep(people, state))), paths, checks=False)
    record_row = next(r for r in planned["runs"] if r.get("group"))
    assert record_row["user_level"]["epsilon"] > 0
    assert len(list((paths.private / "released-sizes").iterdir())) == 2
