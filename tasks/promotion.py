"""From candidate to production in the MLflow registry (``privprompt promote``), and which version
of each dataset is in production (``privprompt ledger``, ``privprompt report``).

:func:`promote` runs the release gates (:mod:`tasks.release_gates`) on a version, records each
result as the version's tags ``gate.<name>`` / ``gate.<name>.reason``, and moves the alias
``production`` to it only when no gate failed (``skipped``: the check does not apply or its input
was not logged, said why) — or with ``force``, which records what failed in ``gate.forced``. The
model card (:mod:`tasks.model_card`) is rewritten with the results either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .release_gates import CanaryRunner, GateResult

PREFIX = "privprompt."
PRODUCTION = "production"  # the alias (tasks.registry_model.CANDIDATE is the other one)
# imports of MLflow (through tasks.registry_model) stay inside promote(): `privprompt ledger` reads
# the production versions of a local store without them (production_versions_local)


@dataclass
class Promotion:
    name: str
    version: str
    gates: list["GateResult"] = field(default_factory=list)
    promoted: bool = False
    forced: bool = False

    @property
    def failed(self) -> list["GateResult"]:
        return [g for g in self.gates if g.status == "fail"]


def promote(client, model_uri: str, force: bool = False, canary_runner: "CanaryRunner | None" = None) -> Promotion:
    """Gate the version ``model_uri`` names and, when every gate passed or was skipped (or with
    ``force``), move ``production`` to it. ``canary_runner``: runs a canary audit the DP run lacks
    (:func:`tasks.release_gates.canary_gate`)."""
    from .model_card import write_card
    from .registry_model import PROMPT_TAG, resolve_version
    from .release_gates import run_gates

    version = resolve_version(client, model_uri)
    name, number = version.name, str(version.version)
    if not name.startswith(PREFIX):
        raise ValueError(f"{name!r} is not a PrivPrompt registered model (privprompt.<dataset>.<method>)")
    gates = run_gates(client, version, canary_runner)
    for gate in gates:
        client.set_model_version_tag(name, number, f"gate.{gate.name}", gate.status)
        client.set_model_version_tag(name, number, f"gate.{gate.name}.reason", gate.reason)
    client.set_model_version_tag(name, number, "gate.checked_at",
                                 datetime.now(timezone.utc).isoformat(timespec="seconds"))
    out = Promotion(name, number, gates)
    if out.failed and force:
        client.set_model_version_tag(name, number, "gate.forced",
                                     "promoted with --force despite: " + ", ".join(g.name for g in out.failed))
        out.forced = True
    if not out.failed or force:
        client.set_registered_model_alias(name, PRODUCTION, number)
        prompt = (version.tags or {}).get(PROMPT_TAG)
        if prompt:  # its text prompt in the Prompt Registry moves with it
            prompt_id, prompt_version = prompt[len("prompts:/"):].rsplit("/", 1)
            client.set_prompt_alias(prompt_id, PRODUCTION, int(prompt_version))
        out.promoted = True
    write_card(client, version)
    return out


def dataset_of(model_name: str, tags: dict) -> str:
    """The dataset a registered model serves: ``privprompt.<dataset>.<method>`` (dataset names may hold dots)."""
    return model_name[len(PREFIX):].rpartition(".")[0]


def _row(name: str, version: str, tags: dict) -> dict:
    return {"dataset": dataset_of(name, tags), "model": name, "version": version, "uri": f"models:/{name}/{version}",
            "epsilon": tags.get("privacy.epsilon"), "unit": tags.get("privacy.unit", "record"),
            "fingerprint": tags.get("dataset.fingerprint", ""), "forced": bool(tags.get("gate.forced")),
            "parent": tags.get("lineage.parent")}


def _kept(rows: list[dict], datasets: set[str] | None) -> list[dict]:
    rows = [r for r in rows if datasets is None or r["dataset"] in datasets]
    return sorted(rows, key=lambda r: (r["dataset"], r["model"]))


def production_versions(client, datasets: set[str] | None = None) -> list[dict]:
    """Every PrivPrompt registered model's ``production`` version (one row each: dataset, model,
    version, ε, unit, fingerprint, forced, parent), sorted by dataset; ``datasets`` keeps those only."""
    from mlflow.exceptions import MlflowException

    rows = []
    for model in client.search_registered_models(max_results=1000):
        if not model.name.startswith(PREFIX) or PRODUCTION not in (model.aliases or {}):
            continue
        try:
            version = client.get_model_version_by_alias(model.name, PRODUCTION)
        except MlflowException:
            continue
        rows.append(_row(model.name, str(version.version), dict(version.tags or {})))
    return _kept(rows, datasets)


def production_versions_local(db_path, datasets: set[str] | None = None) -> list[dict] | None:
    """:func:`production_versions` read straight from a local SQLite MLflow store, read-only and
    without importing MLflow (seconds of ``privprompt ledger``); None when the file's tables are not
    the ones this reads (another MLflow schema): the caller then asks the MLflow client."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        found = con.execute("SELECT name, version FROM registered_model_aliases WHERE alias = ?", (PRODUCTION,))
        rows = []
        for name, version in found.fetchall():
            if name.startswith(PREFIX):
                tags = dict(con.execute('SELECT "key", value FROM model_version_tags WHERE name = ? AND version = ?',
                                        (name, version)).fetchall())
                rows.append(_row(name, str(version), tags))
        return _kept(rows, datasets)
    except sqlite3.Error:
        return None
    finally:
        con.close()


def production_table(rows: list[dict]) -> str:
    """Plain text: one line per dataset × registered model in production."""
    if not rows:
        return "in production: none (privprompt promote MODEL_URI moves the alias 'production')\n"
    lines = ["in production (MLflow registry, alias 'production'):"]
    for r in rows:
        extra = " [promoted with --force]" if r["forced"] else ""
        extra += f" [retargeted from {r['parent']}]" if r["parent"] else ""
        try:
            eps = f"{float(r['epsilon']):.4f}"
        except (TypeError, ValueError):  # an ldp version states none
            eps = str(r["epsilon"])
        lines.append(f"  {r['dataset']}: {r['uri']} (ε = {eps}, unit {r['unit']}, "
                     f"fingerprint {r['fingerprint'][:12]}){extra}")
    return "\n".join(lines) + "\n"
