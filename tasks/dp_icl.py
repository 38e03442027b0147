"""DP-ICL (Wu et al., "Privacy-Preserving In-Context Learning for Large Language Models", ICLR 2024)
as a served model: each query is answered by a DP vote of in-context prompts built from disjoint
private subsets, and every answered batch is charged to the team ledger — the first
inference-time spend.

Mechanism: a secret keyed-hash partition (``tasks/methodkit/keyed_partition.py``; the key from
the run's secret DP stream, never the logged seed) puts the private rows into M disjoint subsets of
at most N demonstrations each; for a query, each non-empty subset's prompt (instruction,
demonstrations, the query) predicts one label on the local causal LM, scored ALONE (a batch of
one: batching would let one subset's length move another's logits); the one-hot votes are summed,
the histogram gets N(0, (σ·√2)² I) and its argmax answers (Report-Noisy-Max with Gaussian noise:
``privacy.mechanisms.distribution_vote`` on one-hot rows).

Neighbouring relation: add/remove one record (text and label) of the source dataset. It lands in
one subset, so for every query one vote moves (or appears / vanishes): the histogram moves by L2
≤ √2, and an answered query is ``GaussianEvent(σ)``; a batch of b answered queries is
``SelfComposedEvent(GaussianEvent(σ), b)`` (:func:`batch_event`). The ledger composes the
batches with everything else the dataset spent; ε grows with the queries answered (one-time
methods such as dp_opt and dp_fewshot stay flat).

Charging (:meth:`DPICLServer.answer`): the batch's event is reserved BEFORE the vote (the ledger
refuses it at the cap: nothing is answered), the read is marked, the answers are computed, the
event is committed. The private demonstrations never leave this object: only labels come out.

Not yet done here: ``privprompt predict`` and the MLflow pyfunc wiring, a ``privprompt plan`` line
and the report's ε-after-N-queries figure (:func:`queries_within` is what they would read).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np

from privacy.events import DpEvent, GaussianEvent, SelfComposedEvent
from privacy.validation import check_count


@dataclass(frozen=True)
class DPICLSettings:
    subsets: int = 10             # M: disjoint private subsets voting on every query
    shots: int = 4                # N: at most this many demonstrations per subset's prompt
    noise_multiplier: float = 1.0  # σ relative to the histogram's L2 sensitivity √2
    instruction: str = ""
    template: str = "Input: {text}\n\nOutput:"


def batch_event(noise_multiplier: float, answered: int) -> DpEvent:
    """What ``answered`` queries spend: one Gaussian vote each."""
    check_count(answered, "answered", minimum=1)
    return SelfComposedEvent(GaussianEvent(noise_multiplier), answered)


def noise_for_queries(epsilon: float, delta: float, queries: int) -> float:
    """σ such that ``queries`` answered queries spend ``epsilon`` at ``delta`` (alone)."""
    from privacy import accountant as acct

    return acct.calibrate_noise_multiplier(epsilon, delta, 1.0, queries)


def queries_within(epsilon: float, delta: float, noise_multiplier: float, limit: int = 10**7) -> int:
    """The most queries answered at σ whose composed ε (alone) stays within ``epsilon`` (0: not one)."""
    from privacy import accountant as acct

    def fits(b: int) -> bool:
        return acct.spend(batch_event(noise_multiplier, b), delta).epsilon <= epsilon

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _clip_words(text: str, limit: int = 48) -> str:
    return " ".join(text.split()[:limit])


class DPICLServer:
    """Answers queries by the DP vote; charges ``ledger`` (dataset ``fingerprint``) per batch."""

    def __init__(self, engine, labels: list[str], rows, settings: DPICLSettings, ledger, fingerprint: str,
                 randomness, serve_id: str | None = None):
        from tasks.methodkit.keyed_partition import keyed_subsets

        self.engine, self.labels, self.settings = engine, list(labels), settings
        self.ledger, self.fingerprint = ledger, fingerprint
        unit = ledger.dataset(fingerprint)["unit"]
        if unit != "record" or getattr(rows, "units", None) is not None:
            # the partition is keyed by record: one person's records land in many subsets, moving
            # many votes — the √2 charged per query holds for one record only
            raise ValueError(f"dp_icl: the dataset's privacy unit is {unit!r}: its subsets are keyed by record, so "
                             "its per-query ε holds for one record, not one person; refused")
        self.serve_id = serve_id or f"dp_icl-{uuid.uuid4().hex[:12]}"
        self.noise = randomness.numpy(2)  # the votes' secret noise
        parts = keyed_subsets(rows.texts, rows.labels, None, randomness.numpy(1).bytes(32), settings.subsets,
                              settings.shots)
        self._prefixes = [engine.encode_prefix(self._demos([(rows.texts[i], rows.labels[i]) for i in part]))
                          for part in parts if part]
        self._label_ids = [engine.ids(" " + label)[0] for label in self.labels]

    def _demos(self, demos: list[tuple[str, str]]) -> str:
        head = f"Instruction: {self.settings.instruction}\n\n" if self.settings.instruction else ""
        return head + "".join(self.settings.template.replace("{text}", _clip_words(x)) + f" {y}\n\n"
                              for x, y in demos)

    def histogram(self, text: str) -> np.ndarray:
        """(|labels|,) the subsets' votes on one query (private: never released without noise)."""
        suffix = self.engine.ids(self.settings.template.replace("{text}", _clip_words(text)))
        votes = np.zeros(len(self.labels))
        for prefix in self._prefixes:  # one by one: see the module docstring
            logits = self.engine.last_logits([suffix], prefix)[0]
            votes[int(np.argmax(logits[self._label_ids].numpy()))] += 1
        return votes

    def _vote(self, text: str) -> str:
        from privacy.mechanisms import distribution_vote

        votes = self.histogram(text)
        onehot = np.repeat(np.eye(len(self.labels)), votes.astype(int), axis=0)  # one row per subset's vote
        return self.labels[distribution_vote(onehot.reshape(-1, len(self.labels)), self.settings.noise_multiplier,
                                             self.noise)]

    def answer(self, texts: list[str]) -> list[str]:
        """The DP answers of one batch, charged as one ledger entry: reserved before any vote (a
        ``BudgetExceededError`` at the cap: nothing answered), committed after."""
        if not texts:
            return []
        # a fresh id per batch: a counter reused across threads or restarts (a stable serve_id) met
        # the ledger's idempotent retry — the same entry returned, nothing charged, yet answered
        run_id = f"{self.serve_id}:batch-{uuid.uuid4().hex}"
        event = batch_event(self.settings.noise_multiplier, len(texts))
        reservation = self.ledger.reserve(self.fingerprint, run_id, event,
                                          description=f"dp_icl: {len(texts)} answered queries (inference-time spend)")
        if not reservation.new:
            raise RuntimeError(f"dp_icl: batch {run_id} was already charged: not answered again")
        self.ledger.mark_read(run_id)
        answers = [self._vote(t) for t in texts]
        self.ledger.commit(run_id, event)
        return answers
