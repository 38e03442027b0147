"""A dp run's stored release: its DP output, event and audit statistics written under the run's
private folder BEFORE the ledger's commit, so that a retry republishes that one output under the one
charge and never makes a second (the first attempt to store wins: an atomic hard link)."""

from __future__ import annotations

import json
from pathlib import Path

from privacy import events as ev
from privacy.ledger import Ledger, UnknownRunError

from . import plots
from .errors import PrivPromptError
from .methods.base import Trained
from .prompts import load_prompt_file, save_prompt_file
from .state import make_private_dir, open_private, private_file


class ReleaseError(PrivPromptError):
    """A retried run whose DP output cannot be republished as it was: refused, because making a
    second DP output under the run's one charge would spend privacy the ledger never counted."""


def release_dir(private_run_dir: Path) -> Path:
    """Where a dp run stores its DP output and its release manifest before the commit (private
    side: the manifest carries the training's audit statistics; the published copies are made
    from it)."""
    return Path(private_run_dir) / "releases"


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def store_release(private_run_dir: Path, name: str, run_key: str, trained: Trained) -> bool:
    """Store the DP output of run ``run_key`` (method ``name``) and everything republishing it
    needs (event, steps, metrics, audit statistics, the output file's SHA-256) BEFORE the commit.

    The first attempt of a run to store wins: the manifest is written whole under an
    attempt-unique name and then hard-linked into place, which fails when it is already there. So
    when two attempts of one run are alive at once (a worker declared lost that is still running,
    and its retry), exactly one DP output is ever stored, and the other attempt's output is
    removed. Returns True when this attempt's output is the run's, False when another attempt
    stored first (republish that one: :func:`stored_release`)."""
    import os
    import secrets

    directory = make_private_dir(release_dir(private_run_dir))
    attempt = secrets.token_hex(8)  # the output file of each attempt has its own name: none overwrites another's
    prompt_path = prompt_file = digest = None
    if trained.prompt is not None:
        prompt_path = save_prompt_file(directory, f"{name}_dp_output.{attempt}", trained.prompt,
                                       {"method": name, "run_key": run_key})
        prompt_file, digest = private_file(prompt_path).name, _sha256(prompt_path)
    manifest = {"run_key": run_key, "method": name, "event": ev.event_to_json(trained.event),
                "prompt_file": prompt_file, "sha256": digest, "steps": int(trained.steps),
                "metrics": {k: float(v) for k, v in trained.metrics.items()},
                "audit_metrics": {k: float(v) for k, v in trained.audit_metrics.items()}}
    if trained.record_event is not None:  # a record-level run charged per person: its per-record event
        manifest["record_event"] = ev.event_to_json(trained.record_event)
    target = directory / f"{name}.json"
    tmp = directory / f"{name}.json.{attempt}.tmp"
    with open_private(tmp, "w") as handle:
        handle.write(json.dumps(manifest, indent=1, sort_keys=True))
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, target)  # atomic, and refused when another attempt's manifest is there
        return True
    except FileExistsError:
        if prompt_path is not None:
            prompt_path.unlink(missing_ok=True)  # this attempt's output is never released
        return False
    finally:
        tmp.unlink(missing_ok=True)


def stored_release(ledger: Ledger, run_key: str, private_run_dir: Path, name: str) -> Trained | None:
    """The DP output run ``run_key`` already made, as a :class:`Trained` to republish; None when
    it has made none that was stored (train then). Raises :class:`ReleaseError` when the ledger
    has committed the run's spend but its stored output is missing or changed, or when a stored
    output does not match the ledger: never a second DP output under one charge."""
    try:
        entry = ledger.entry(run_key)
    except UnknownRunError:
        entry = None
    committed = entry is not None and entry["kind"] == "dp" and entry["status"] == "committed"
    directory = release_dir(private_run_dir)
    manifest_path = directory / f"{name}.json"
    fresh_run = "start a new flow run (a new run id and a new charge) to train again"
    if not manifest_path.is_file():
        if committed:
            raise ReleaseError(
                f"run {run_key!r} already committed ε={entry['epsilon']:.4g} for its DP output, but the stored "
                f"output is missing ({manifest_path} does not exist): refusing to train again under the same "
                f"charge; restore the run's private state folder, or {fresh_run}")
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        event = ev.event_from_json(manifest["event"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ReleaseError(f"run {run_key!r}: the stored release manifest {manifest_path} is unreadable ({exc}); "
                           f"refusing to train again under the same charge: {fresh_run}") from None
    problem = None
    if manifest.get("run_key") != run_key or manifest.get("method") != name:
        problem = f"it belongs to run {manifest.get('run_key')!r} of method {manifest.get('method')!r}"
    elif entry is None or entry["kind"] != "dp":
        problem = "the ledger holds no dp reservation for this run"
    elif committed and entry["committed_event"] != json.loads(manifest["event"]):
        problem = "its event differs from the one the ledger committed"
    elif manifest.get("prompt_file"):
        path = directory / manifest["prompt_file"]
        if not path.is_file():
            problem = f"its output file {path} is missing"
        elif _sha256(path) != manifest.get("sha256"):
            problem = f"its output file {path} was changed after it was stored"
    if problem:
        raise ReleaseError(f"run {run_key!r} stored a DP output ({manifest_path}) that cannot be republished: "
                           f"{problem}; refusing to make a second DP output under the same charge: {fresh_run}")
    prompt = load_prompt_file(str(directory / manifest["prompt_file"])) if manifest.get("prompt_file") else None
    record_event = ev.event_from_json(manifest["record_event"]) if manifest.get("record_event") else None
    return Trained(prompt, event, int(manifest.get("steps", 0)), dict(manifest.get("metrics", {})),
                   [], dict(manifest.get("audit_metrics", {})), record_event=record_event)


def write_private_history(directory: Path, name: str, history: list[dict]) -> str | None:
    """Exact private statistics (per-step losses) stay local: a JSON file and a curve under private/."""
    if not history:
        return None
    path = directory / f"{name}_history.json"
    with open_private(path, "w") as handle:  # 0600: per-step losses, batch sizes, clip rates
        handle.write(json.dumps(history))
    fig = plots.training_curve(history, f"{name}: batch loss (PRIVATE: exact statistic of private data)")
    curve = directory / f"{name}_training_curve.png"
    with open_private(curve, "wb") as handle:
        fig.savefig(handle, format="png", dpi=120, bbox_inches="tight")
    plots.close(fig)
    return str(path)
