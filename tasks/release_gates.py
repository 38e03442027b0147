"""The release gate of a registered version (``privprompt promote``): four checks, each recorded on
the version as a tag ``gate.<name>`` = ``pass`` | ``fail`` | ``skipped`` with a short public reason
in ``gate.<name>.reason``.

* ``canary``: the canary audit's one-run ε lower bound (``audit.epsilon_lower_bound``, logged on the
  DP run by an in-flow ``audit:`` or ``privprompt audit RUN_ID``) is at most the version's ε. When
  none is logged, a ``runner`` (``privprompt promote``'s) runs the canary audit of the run's planted
  canaries now — one forward pass, recorded in the ledger as a non-private use; a run that planted
  none (or whose private partition is not on this machine) is ``skipped``, saying why.
* ``lira``: each LiRA AUC logged on the DP run (``mia.lira.auc``, ``mia.lira_offline.auc``) is at most
  what (ε, δ)-DP allows (:func:`privacy.tradeoff.dp_auc_bound`); the lower end of the AUC's bootstrap
  interval (``…auc_low``) is compared when logged, so sampling error alone does not fail a sound run.
* ``holdout``: the released (DP, noisy) comparison of the published prompt with no prompt on the
  holdout says it is not worse: every dp run's ``no_prompt.released_difference`` D̃ ≥ 0 (issue 41's
  accounted release), else the released scores of the pairs :data:`HOLDOUT_PAIRS` or any logged ``X`` beside
  ``no_prompt.X`` with ``holdout`` in its name; a retargeted version: its accuracy on the labelled
  public rows beside no prompt's (``retarget.public.*``). Exact holdout statistics are never logged,
  so none is read; without such a pair the gate is ``skipped``.
* ``adapter``: the version loads with ``mlflow.pyfunc``, its predictions on :data:`PROBE_TEXTS`
  (generic public sentences, never private data) equal PrivPrompt's own forward on the run's
  published prompt, they are finite and not constant, and a soft prompt's or prefix's PEFT
  adapter (the run's ``peft/`` artifact) loads with ``PeftModel.from_pretrained`` and scores the
  probes like PrivPrompt.

A retargeted version (``lineage.dp_run``) is judged on the DP run it came from for ``canary`` and
``lira`` (post-processing changes no ε) and on its own run for ``holdout`` and ``adapter``.
Every number in a reason is already public in the run record (audit statistics and released scores).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# the DP run's id → (its canary ε lower bound, or None and why no audit could run)
CanaryRunner = Callable[[str], "tuple[float | None, str]"]

PROBE_TEXTS = (
    "The weather was mild and the streets were quiet this morning.",
    "I absolutely loved it, one of the best things I have seen this year!",
    "This was a complete waste of time and money.",
    "The meeting has been moved to Thursday afternoon.",
    "What a wonderful, warm and funny story.",
    "Terrible service, cold food and a rude waiter.",
    "The new library opens at nine and closes at five.",
    "It was fine, nothing special.",
)
GATES = ("canary", "lira", "holdout", "adapter")
LIRA_METRICS = ("mia.lira.auc", "mia.lira_offline.auc")
# (the published prompt's released score, no prompt's): the selection's, and a run's released comparison
# and a retargeted version's accuracies on the labelled PUBLIC rows (its parent's scores are of another target)
HOLDOUT_PAIRS = (("selection.winner.holdout_score", "selection.no_prompt.holdout_score"),
                 ("prompt.released_holdout_score", "no_prompt.released_holdout_score"),
                 ("retarget.public.accuracy", "retarget.public.no_prompt.accuracy"))
SCORE_ATOL = 1e-4  # pyfunc vs PrivPrompt: the same forward; PEFT vs PrivPrompt: log-probs
PEFT_ATOL = 2e-5


class CanaryAuditFailed(RuntimeError):
    """A canary audit run by the gate measured more than the run's ε (its one-line message says so)."""


@dataclass(frozen=True)
class GateResult:
    name: str
    status: str  # pass | fail | skipped
    reason: str

    def line(self) -> str:
        return f"gate {self.name}: {self.status.upper()}: {self.reason}"


@dataclass
class Candidate:
    """A registered version under the gate: its tags, and the metrics of the DP run that made its
    release (``dp_metrics``) and of the run it points at (``own_metrics``; the same run unless retargeted)."""

    name: str
    version: str
    run_id: str
    tags: dict
    dp_metrics: dict
    own_metrics: dict

    @property
    def epsilon(self) -> float | None:
        return _number(self.tags.get("privacy.epsilon"))

    @property
    def record_epsilon(self) -> float | None:
        """The ε a single-record audit (canaries, LiRA) is held to: the per-record ε of a record-level
        run charged per person (``privacy.epsilon_per_record``), else the version's ε."""
        if self.epsilon is not None and self.dp_metrics.get("privacy.epsilon_per_record") is not None:
            return _number(self.dp_metrics["privacy.epsilon_per_record"])
        return self.epsilon

    @property
    def delta(self) -> float | None:
        return _number(self.tags.get("privacy.delta"))

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def _number(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def candidate(client, version) -> Candidate:
    """The gate's view of ``version`` (an MLflow ModelVersion)."""
    tags = dict(version.tags or {})
    own = client.get_run(version.run_id).data.metrics if version.run_id else {}
    dp_run = tags.get("lineage.dp_run") or version.run_id
    dp = own if dp_run == version.run_id else client.get_run(dp_run).data.metrics
    return Candidate(version.name, str(version.version), version.run_id, tags, dict(dp), dict(own))


def canary_gate(c: Candidate, runner: CanaryRunner | None = None) -> GateResult:
    """``runner``: runs the canary audit of the DP run when none is logged (the CLI's, which can
    read the run's private partition); returns the bound, or None and a reason it cannot run, or
    raises :class:`CanaryAuditFailed` when the bound exceeds the run's ε."""
    bound, eps, ran = c.dp_metrics.get("audit.epsilon_lower_bound"), c.record_epsilon, ""
    if eps is None:
        return GateResult("canary", "skipped", f"no (ε, δ) claim to audit (guarantee {c.tags.get('privacy.guarantee')})")
    if bound is None and runner is not None:
        dp_run = c.tags.get("lineage.dp_run") or c.run_id
        try:
            bound, why = runner(dp_run)
        except CanaryAuditFailed as err:
            return GateResult("canary", "fail", f"canary audit run now: {str(err).splitlines()[0]}"[:300])
        if bound is None:
            return GateResult("canary", "skipped", f"no canary audit logged on the DP run, and none ran now: {why}")
        ran = " (audit run now by promote)"
    if bound is None:
        return GateResult("canary", "skipped", "no canary audit logged on the DP run (plant canaries with "
                                               "data.canaries and run privprompt audit RUN_ID, or audit: in the flow)")
    if bound <= eps:
        return GateResult("canary", "pass", f"canary audit ε lower bound {bound:.3f} ≤ ε {eps:.3f}{ran}")
    return GateResult("canary", "fail", f"canary audit ε lower bound {bound:.3f} > ε {eps:.3f}: the DP "
                                        "implementation or its accounting is broken")


def lira_gate(c: Candidate) -> GateResult:
    from privacy.tradeoff import dp_auc_bound

    logged, eps = [k for k in LIRA_METRICS if k in c.dp_metrics], c.record_epsilon
    if eps is None or c.delta is None:
        return GateResult("lira", "skipped", "no (ε, δ) claim to hold a LiRA AUC to")
    if not logged:
        return GateResult("lira", "skipped", "no LiRA audit logged on the DP run")
    bound = dp_auc_bound(eps, c.delta)  # the attack targets single records
    over = []
    for key in logged:
        low = c.dp_metrics.get(key + "_low", c.dp_metrics[key])  # the interval's lower end, when logged
        if low > bound:
            over.append(f"{key} {c.dp_metrics[key]:.3f} (interval low {low:.3f})")
    shown = ", ".join(f"{k} {c.dp_metrics[k]:.3f}" for k in logged)
    per = " per record" if eps != c.epsilon else ""
    if over:
        return GateResult("lira", "fail", f"{', '.join(over)} above the AUC bound {bound:.3f} of (ε, δ)")
    return GateResult("lira", "pass", f"{shown} ≤ the AUC bound {bound:.3f} of (ε {eps:.3f}{per}, δ {c.delta:.3g})")


def holdout_pairs(metrics: dict) -> list[tuple[str, str]]:
    """(prompt's, no prompt's) released holdout scores logged in ``metrics``."""
    pairs = [(a, b) for a, b in HOLDOUT_PAIRS if a in metrics and b in metrics]
    pairs += [(k[len("no_prompt."):], k) for k in sorted(metrics)
              if k.startswith("no_prompt.") and "holdout" in k and k[len("no_prompt."):] in metrics
              and (k[len("no_prompt."):], k) not in pairs]
    return pairs


def holdout_gate(c: Candidate) -> GateResult:
    from .no_prompt import DIFFERENCE, SIGMA

    m = c.own_metrics
    if DIFFERENCE in m:  # every dp run's released comparison with no prompt (issue 41): D̃ = Σ (with − without) + noise
        shown = f"released difference with no prompt D̃ = {m[DIFFERENCE]:.2f} (noise σ {m.get(SIGMA, float('nan')):.2f})"
        if m[DIFFERENCE] < 0:
            return GateResult("holdout", "fail", f"below no prompt: {shown}")
        return GateResult("holdout", "pass", f"at least no prompt: {shown}")
    pairs = holdout_pairs(m)
    if not pairs:
        why = ("a retargeted version without labelled public rows to score (its parent's released scores are of "
               "another target)" if "lineage.parent" in c.tags
               else "the run logged no released holdout score beside no prompt's")
        return GateResult("holdout", "skipped", why)
    worse = [(a, b) for a, b in pairs if c.own_metrics[a] < c.own_metrics[b]]
    shown = "; ".join(f"{a} {c.own_metrics[a]:.4f} vs {b} {c.own_metrics[b]:.4f}" for a, b in (worse or pairs))
    if worse:
        return GateResult("holdout", "fail", f"below no prompt: {shown}")
    return GateResult("holdout", "pass", f"at least no prompt: {shown}")


def adapter_gate(client, c: Candidate) -> GateResult:
    """The version loads and predicts like PrivPrompt on the probes; PEFT too for a soft prompt or prefix."""
    with tempfile.TemporaryDirectory(prefix="privprompt-gate-") as tmp:
        try:
            return _adapter_checks(client, c, Path(tmp))
        except Exception as exc:  # noqa: BLE001 - a version that does not load fails the gate, in one line
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return GateResult("adapter", "fail", f"{type(exc).__name__}: {text}"[:300])


def _adapter_checks(client, c: Candidate, tmp: Path) -> GateResult:
    import json

    import mlflow.pyfunc
    import numpy as np
    import pandas as pd

    from .registry_model import SPEC_FILE, Predictor, download_model

    folder = download_model(client, c.uri, tmp / "model")
    model = mlflow.pyfunc.load_model(str(folder))
    served = model.predict(pd.DataFrame({"text": list(PROBE_TEXTS)}))
    spec = json.loads((folder / "artifacts" / SPEC_FILE).read_text())
    prompt_path = _published_prompt(client, c, folder, tmp)
    own = Predictor.build(spec, prompt_path)
    ours = own.predict(list(PROBE_TEXTS))
    columns = [f"score.{label}" for label in spec["labels"]]
    theirs, mine = served[columns].to_numpy(dtype=float), ours[columns].to_numpy(dtype=float)
    if not np.all(np.isfinite(theirs)):
        return GateResult("adapter", "fail", "the loaded version's scores on the probe texts are not finite")
    if served["label"].tolist() != ours["label"].tolist() or not np.allclose(theirs, mine, atol=SCORE_ATOL):
        return GateResult("adapter", "fail", "the loaded version's predictions on the probe texts differ from "
                                             "PrivPrompt's own forward on the published prompt")
    if float(np.ptp(theirs, axis=0).max()) <= 1e-6:
        return GateResult("adapter", "fail", f"constant predictions on the {len(PROBE_TEXTS)} probe texts")
    peft = _peft_check(client, c, own, tmp)
    distinct = len(set(served["label"]))
    if distinct == 1 and len(spec["labels"]) > 1:
        return GateResult("adapter", "fail", f"one label ({served['label'].iloc[0]!r}) for every one of the "
                                             f"{len(PROBE_TEXTS)} probe texts: a classifier that does not tell them "
                                             f"apart; {peft}")
    return GateResult("adapter", "pass", f"mlflow.pyfunc loads; {len(PROBE_TEXTS)} public probe texts predicted as "
                                         f"PrivPrompt predicts ({distinct} distinct labels, scores vary); {peft}")


def _published_prompt(client, c: Candidate, folder: Path, tmp: Path) -> Path:
    """The prompt the version's run published (its ``prompt/`` artifact) when it holds one file of
    the registered copy's name; else the registered copy itself."""
    copies = [p for p in (folder / "artifacts").iterdir() if p.name != "spec.json"]
    if len(copies) != 1:
        raise ValueError(f"the registered model holds {len(copies)} prompt files, not one")
    names = {Path(a.path).name for a in client.list_artifacts(c.run_id, "prompt")}
    if copies[0].name in names:
        return Path(client.download_artifacts(c.run_id, f"prompt/{copies[0].name}", str(tmp)))
    return copies[0]


def _adapter_folder(client, c: Candidate, tmp: Path) -> Path | None:
    """The PEFT adapter published with the version: on the training run that registered it (tag
    ``registry.model``) or on the version's own run (a retarget)."""
    run = client.get_run(c.run_id)
    runs = [c.run_id]
    found = client.search_runs([run.info.experiment_id], f"tags.`registry.model` = '{c.uri}'", max_results=5)
    runs = [r.info.run_id for r in found] + runs
    for run_id in runs:
        if any(a.path == "peft/adapter_config.json" for a in client.list_artifacts(run_id, "peft")):
            return Path(client.download_artifacts(run_id, "peft", str(tmp / f"peft-{run_id}")))
    return None


def _peft_check(client, c: Candidate, own, tmp: Path) -> str:
    """PEFT's forward on the published adapter against PrivPrompt's label scores (raises on a mismatch)."""
    if own.prompt is None:
        return "a text prompt (a template, no PEFT adapter)"
    folder = _adapter_folder(client, c, tmp)
    if folder is None:
        raise ValueError("a soft prompt or prefix without a published PEFT adapter (peft/)")
    from models.scoring import peft_label_scores

    import torch

    clf = own.classifier
    enc = clf.encode(list(PROBE_TEXTS), max_length=own.max_length)
    with torch.no_grad():
        ours = clf(enc, own.prompt).float().cpu()
    theirs = peft_label_scores(clf, folder, enc, own.prompt)
    if theirs is None:
        return f"PEFT adapter loads (scores not compared: {type(clf).__name__} reads no label words)"
    if not torch.allclose(theirs, ours, atol=PEFT_ATOL, rtol=1e-4):
        raise ValueError(f"the PEFT adapter's scores differ from PrivPrompt's (max |Δ| "
                         f"{float((theirs - ours).abs().max()):.2e})")
    return "the PEFT adapter loads and scores the probes as PrivPrompt does"


def run_gates(client, version, canary_runner: CanaryRunner | None = None) -> list[GateResult]:
    c = candidate(client, version)
    if c.tags.get("prompt.source") == "none":
        return [*no_prompt_gates(c), adapter_gate(client, c)]
    return [canary_gate(c, canary_runner), lira_gate(c), holdout_gate(c), adapter_gate(client, c)]


def no_prompt_gates(c: Candidate) -> list[GateResult]:
    """A version without a prompt (``prompt.source = none``): nothing in it was trained on the
    private data, so there is nothing for a membership audit to find, and it is no prompt by
    definition: the holdout gate passes on what the run released (its prompt did not beat it)."""
    from .no_prompt import DIFFERENCE

    nothing = "no prompt: nothing in this version was trained on the private data"
    released = c.own_metrics.get(DIFFERENCE)
    why = ("it is the model without a prompt" + ("" if released is None else
                                                  f"; the run's prompt did not beat it (released D̃ = {released:.2f})"))
    return [GateResult("canary", "skipped", nothing), GateResult("lira", "skipped", nothing),
            GateResult("holdout", "pass", why)]
