"""DP-ICL (Wu et al., "Privacy-Preserving In-Context Learning for Large Language Models", ICLR 2024)
as a served model: each query is answered by a DP vote of in-context prompts built from disjoint
private subsets (a secret keyed-hash partition, or a fresh Poisson sample per query), and every
answered batch is charged to the team ledger through the door's primitive (``Ledger.claim_read``:
reserve before the vote, mark the read, commit) — the first inference-time spend. An answered
query is ``GaussianEvent(σ)`` (one record moves one vote: L2 ≤ √2), subsampled
``PoissonSampledEvent(q, GaussianEvent(σ))`` with q from the RELEASED size; before its first answer
the server compares itself with zero-shot on H private holdout rows (one noisy difference) and
answers zero-shot when that says the demonstrations do worse. The private demonstrations never
leave :class:`DPICLServer`: only labels come out.

Served by ``privprompt predict --dp-icl CONFIG`` (:func:`open_server`, :func:`answer_all`); no
MLflow pyfunc on purpose (this model IS the private rows). ``privprompt plan`` prices
``dp_icl.expected_queries`` (:func:`plan_line`). The mechanism, its neighbouring relation and the
charging in full: docs/privacy-claims.md, "DP-ICL as a served model".
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from privacy.events import DpEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent, all_events
from privacy.validation import check_count, check_rate

from .no_prompt import CONCLUSIVE_Z  # the same 95 % band as every run's comparison with no prompt


@dataclass(frozen=True)
class DPICLSettings:
    subsets: int = 10             # M: disjoint private subsets voting on every query
    shots: int = 4                # N: at most this many demonstrations per subset's prompt
    noise_multiplier: float = 1.0  # σ relative to the histogram's L2 sensitivity √2
    instruction: str = ""
    template: str = "Input: {text}\n\nOutput:"
    sample_rate: float | None = None  # q: a fresh Poisson sample per query; None: one fixed keyed partition


def query_event(noise_multiplier: float, sample_rate: float | None = None) -> DpEvent:
    """What one answered query spends: a Gaussian vote, on a Poisson sample at ``sample_rate`` when set."""
    vote = GaussianEvent(noise_multiplier)
    if sample_rate is None or sample_rate >= 1.0:
        return vote
    check_rate(sample_rate, "sample_rate")
    return PoissonSampledEvent(sample_rate, vote)


def batch_event(noise_multiplier: float, answered: int, sample_rate: float | None = None) -> DpEvent:
    """What ``answered`` queries spend: one (subsampled) Gaussian vote each."""
    check_count(answered, "answered", minimum=1)
    return SelfComposedEvent(query_event(noise_multiplier, sample_rate), answered)


def noise_for_queries(epsilon: float, delta: float, queries: int, sample_rate: float | None = None) -> float:
    """σ such that ``queries`` answered queries spend ``epsilon`` at ``delta`` (alone)."""
    from privacy import accountant as acct

    return acct.calibrate_noise_multiplier(epsilon, delta, 1.0 if sample_rate is None else min(1.0, sample_rate),
                                           queries)


def poisson_subsets(n: int, sample_rate: float, subsets: int, shots: int, rng: np.random.Generator) -> list[list[int]]:
    """One query's subsets: each of the ``n`` rows sampled with probability ``sample_rate``, put in a
    uniformly random subset with a uniformly random priority, every draw the row's own (three
    independent arrays of n draws); each subset keeps its ``shots`` rows of lowest priority. Adding a
    row changes only its own subset's content."""
    return subsets_of_draws(rng.random(n), rng.integers(0, subsets, n), rng.random(n), sample_rate, subsets, shots)


def subsets_of_draws(inclusion: np.ndarray, subset: np.ndarray, priority: np.ndarray, sample_rate: float,
                     subsets: int, shots: int) -> list[list[int]]:
    """The subsets given each row's draws (row i: sampled iff inclusion[i] < q, in subset[i], ranked
    by priority[i]) — a function of each row's draws alone, so the neighbour tests can couple them."""
    picked = np.flatnonzero(inclusion < sample_rate)
    out: list[list[int]] = [[] for _ in range(subsets)]
    for i in picked[np.argsort(priority[picked], kind="stable")]:
        if len(out[subset[i]]) < shots:
            out[subset[i]].append(int(i))
    return out


def largest_fitting(fits, limit: int = 10**7) -> int:
    """The largest count b in [0, ``limit``] with ``fits(b)``, for a ``fits`` that is monotone (true up to
    some count, false after): doubling, then bisection."""
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


def queries_within(epsilon: float, delta: float, noise_multiplier: float, limit: int = 10**7,
                   sample_rate: float | None = None, size_event: DpEvent | None = None,
                   comparison: DpEvent | None = None) -> int:
    """The most queries answered at σ whose composed ε (alone, with the releases the first charge
    carries: :func:`first_batch_event`) stays within ``epsilon`` (0: not one)."""
    from privacy import accountant as acct

    return largest_fitting(lambda b: acct.spend(first_batch_event(noise_multiplier, b, sample_rate, size_event,
                                                                  comparison), delta).epsilon <= epsilon, limit)


def first_batch_event(noise_multiplier: float, answered: int, sample_rate: float | None,
                      size_event: DpEvent | None, comparison: DpEvent | None = None) -> DpEvent:
    """A server's first charge as the ledger holds it: its votes and, when the config runs one, the
    comparison with zero-shot's count after them; the sizes' release in front (adaptive: q was
    computed from it) when the server samples by it."""
    from privacy.plan import with_release, with_size_release

    event = batch_event(noise_multiplier, answered, sample_rate)
    event = event if comparison is None else with_release(event, comparison)
    return event if size_event is None else with_size_release(event, size_event)


def noise_with_release(epsilon: float, delta: float, queries: int, sample_rate: float | None,
                       size_event: DpEvent | None, comparison: DpEvent | None = None) -> float:
    """σ such that ``queries`` answered queries AND the releases their first charge carries (the
    sizes' release, the comparison with zero-shot's count) spend at most ``epsilon`` at ``delta``,
    composed as the ledger composes them: the queries' own σ, raised by 2 % steps until it fits."""
    from privacy import accountant as acct
    from privacy.plan import with_size_release

    sigma = noise_for_queries(epsilon, delta, queries, sample_rate)
    alone = (comparison if size_event is None else size_event if comparison is None
             else with_size_release(comparison, size_event))  # the releases without the votes
    if alone is None:
        return sigma
    from .errors import ConfigError

    if acct.spend(alone, delta).epsilon >= epsilon:
        raise ConfigError(f"dp_icl: privacy.target_epsilon={epsilon:g} does not cover the release of the training "
                         "size q is computed from and the comparison with zero-shot; raise it, lower "
                         "fallback.epsilon_share, or give dp_icl.noise_multiplier")
    for _ in range(400):
        if acct.spend(first_batch_event(sigma, queries, sample_rate, size_event, comparison), delta).epsilon <= epsilon:
            return sigma
        sigma *= 1.02
    raise ConfigError(f"dp_icl: no noise multiplier below {sigma:.3g} lets {queries} queries and the releases "
                     f"they charge fit privacy.target_epsilon={epsilon:g}")


# ---- the comparison with zero-shot (never worse than no demonstration in silence) -------------

COMPARE_SENSITIVITY = 2.0  # a record moves D by ≤ 2: its own term, and the row it displaces from the H lowest hashes


def comparison_noise(cfg, delta: float) -> float | None:
    """σ of the noise on D (records), or None when the config runs no comparison
    (``dp_icl.compare_queries`` 0 or ``fallback.epsilon_share`` 0): the analytic Gaussian's σ at
    ``fallback.epsilon_share`` of the target and a tenth of δ (what every run's comparison with no
    prompt takes, ``privacy.plan.no_prompt_comparison``), times the sensitivity 2."""
    from privacy.mechanisms import analytic_gaussian_sigma
    from privacy.plan import NO_PROMPT_DELTA_SHARE

    share = cfg.fallback.epsilon_share
    if not cfg.dp_icl.compare_queries or share <= 0:
        return None
    return COMPARE_SENSITIVITY * analytic_gaussian_sigma(cfg.privacy.target_epsilon * share,
                                                         delta * NO_PROMPT_DELTA_SHARE)


def comparison_event(noise: float) -> DpEvent:
    """The released count D̃ = D + N(0, noise²), D of L2 sensitivity 2."""
    return GaussianEvent(noise / COMPARE_SENSITIVITY)


def comparison_queries(cfg, delta: float) -> int:
    """H: the held-out queries the comparison answers (0 without one)."""
    return cfg.dp_icl.compare_queries if comparison_noise(cfg, delta) is not None else 0


def lowest_keyed(texts: list[str], labels: list[str], key: bytes, count: int) -> list[int]:
    """The ``count`` rows of lowest keyed hash (HMAC-SHA256 of label and text under a secret key): which
    rows are compared is secret, and adding one record changes the set by at most one swap."""
    from tasks.methodkit.keyed_partition import _digest

    if len(key) < 16:
        raise ValueError("lowest_keyed: the key must have at least 128 secret bits")
    return sorted(sorted(range(len(texts)), key=lambda i: _digest(key, labels[i], texts[i]))[:count])


def compared_difference(votes: list[str], zero_shot: list[str], labels: list[str]) -> int:
    """D = Σ (vote right − zero-shot right): each row's term in {−1, 0, 1}."""
    return int(sum((v == y) - (z == y) for v, z, y in zip(votes, zero_shot, labels)))


def comparison_line(result: dict, fallback: bool) -> str:
    """What a user reads of a comparison (public numbers only: D̃, σ, H) and of what today's
    ``fallback.enabled`` made of it."""
    d, sigma, h = result["difference"], result["sigma"], result["queries"]
    head = (f"dp_icl: its released comparison with zero-shot (no demonstration) on {h} held-out private queries: "
            f"D̃={d:+.1f} right answers (σ={sigma:.1f}; gain {d / h:+.3f})")
    if d < 0:
        if fallback:
            return (head + ": WORSE than zero-shot — these queries were answered zero-shot (no demonstration, "
                    "nothing charged for them; fallback.enabled: false answers by the vote anyway)")
        return head + ": WARNING worse than zero-shot, answered by the vote anyway (fallback.enabled: false)"
    if d > CONCLUSIVE_Z * sigma:
        return head + ": better than zero-shot beyond its noise (a 95 % band)"
    return (head + f": WARNING within its noise (|D̃| ≤ {CONCLUSIVE_Z} σ): not shown better than zero-shot; a larger "
            "dp_icl.compare_queries or fallback.epsilon_share narrows it")


def settings_digest(settings: "DPICLSettings", fingerprint: str, model: dict, labels: list[str], noise: float,
                    queries: int) -> str:
    """What a stored comparison holds for: ``fingerprint`` (the ledger dataset's and the partition's
    keyed training fingerprint: another split or source is compared anew), the model
    and its placement, the labels and every setting of the vote and the comparison (a changed σ or
    template is compared anew)."""
    import hashlib
    import json
    from dataclasses import asdict

    blob = json.dumps({"settings": asdict(settings), "dataset": fingerprint, "model": model, "labels": labels,
                       "noise": noise, "queries": queries}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def model_identity(cfg) -> dict:
    """The local model as loaded: its name, its own placement (``models.placement_of``, keyed by the
    model's name), and for a local folder its files' sizes and times (changed weights
    are compared anew)."""
    from dataclasses import asdict
    from pathlib import Path

    name = str(cfg.models.local)
    # the seed: a tiny test model is built from it
    out = {"local": name, "placement": asdict(cfg.models.placement_of(name)), "seed": cfg.seed}
    folder = Path(name).expanduser()
    try:
        if folder.is_dir():
            out["files"] = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                                  if f.is_file())
    except OSError:  # an unreadable listing: the name and placement alone
        pass
    return out


def kept_comparison(root, digest: str, ledger, fingerprint: str) -> dict | None:
    """The stored comparison of ``digest``, when its ledger entry is committed under this dataset in THIS
    ledger (a comparison whose charge the ledger does not hold — a replaced ledger — is run anew)."""
    result = stored_comparison(root, digest)
    if result is None or not result.get("run_id"):
        return None
    try:
        entry = ledger.entry(result["run_id"])
    except Exception:  # noqa: BLE001 - an unknown entry: not this ledger's
        return None
    if not entry or entry.get("status") != "committed" or entry.get("fingerprint") != fingerprint:
        return None
    return result


COMPARISONS_FILE = "dp_icl_comparisons.json"


def stored_comparison(root, digest: str) -> dict | None:
    import json
    from pathlib import Path

    path = Path(root) / COMPARISONS_FILE
    if not path.exists():
        return None
    return _read_comparisons(path).get(digest)


def _read_comparisons(path) -> dict:
    import json

    from .errors import ConfigError

    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as e:
        raise ConfigError(f"dp_icl: the kept comparisons {path} cannot be read ({e}): move it away and the comparison "
                          "with zero-shot runs again (charged)") from None


def store_comparison(root, digest: str, result: dict) -> None:
    """Kept in the state folder (0600, written whole or not at all): public numbers only."""
    import json
    import os
    from pathlib import Path

    path = Path(root) / COMPARISONS_FILE
    data = _read_comparisons(path) if path.exists() else {}
    data[digest] = result
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


QUERY_TOKENS = 128  # room kept for the query (its template and text) after the demonstrations


def _demo_head(instruction: str) -> str:
    return f"Instruction: {instruction}\n\n" if instruction else ""


def _demo_tail(label: str) -> str:
    return f" {label}\n\n"


def _demo_token_budget(engine, settings, labels: list[str]) -> int | None:
    """Tokens each demonstration's text may take (public: the model's context, the settings, the
    labels), or None for a model without a bounded context: the head (with the tokenizer's BOS),
    ``shots`` demonstrations in their template with their label and its seam, and ``QUERY_TOKENS``
    for the query always fit — whatever a record's length (the labels' tokens were
    left out, and a 10-token label let one long record crash a query its neighbour answered).
    Settings that leave no room are refused with one line (:func:`text_budget`)."""
    from tasks.methodkit.token_budget import JUNCTION, SEAM, model_context, template_tokens, text_budget

    context = model_context(engine.model, unbounded_above=None)
    if context is None:
        return None
    head = len(engine.tok(_demo_head(settings.instruction) or " ", add_special_tokens=True, verbose=False)["input_ids"])
    overhead = template_tokens(engine, settings.template, [_demo_tail(y) for y in labels]) + SEAM
    return text_budget(context, head + QUERY_TOKENS + JUNCTION, settings.shots, overhead,
                       f"dp_icl: shots={settings.shots}, the labels, the template and the instruction")


def label_token_ids(engine, labels: list[str]) -> list[int]:
    """The token each label is voted by (its first, after a space); labels that share it are refused
    with one line: the later one could never win a vote."""
    from .errors import ConfigError

    ids = [engine.ids(" " + label)[0] for label in labels]
    for j, i in enumerate(ids):
        if ids.index(i) != j:
            raise ConfigError(f"dp_icl: labels {labels[ids.index(i)]!r} and {labels[j]!r} begin with the same token, "
                              "and dp_icl votes on each label's first token: rename one (data.labels)")
    return ids


def _person_unit(cfg) -> bool:
    return cfg.data.privacy_unit != "record" or bool(cfg.data.person_field)


def check_unit(cfg) -> None:
    """dp_icl's subsets are keyed by record: a person unit is refused with one line, before anything is read."""
    from .errors import ConfigError

    if _person_unit(cfg):
        raise ConfigError(f"dp_icl: the dataset's privacy unit is a person (data.privacy_unit="
                          f"{cfg.data.privacy_unit!r}, data.person_field={cfg.data.person_field!r}): its subsets are "
                          "keyed by record, so its per-query ε holds for one record, not one person; refused")


@contextmanager
def _interrupts_held():
    """SIGINT and SIGTERM held until the block ends, then handled as they would have been (in the main
    thread: Python runs its handlers there; elsewhere nothing is held). Recorded by a handler of its own,
    not masked: a process's signal reaches any thread that does not mask it (torch's, MLflow's)."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)  # Python's SIGINT handler raises KeyboardInterrupt here
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


def noisy_vote(votes: np.ndarray, labels: list[str], noise_multiplier: float, rng: np.random.Generator) -> str:
    """The label Gaussian Report-Noisy-Max picks from the subsets' vote counts ``votes`` (one one-hot
    row per subset's vote: ``privacy.mechanisms.distribution_vote``, L2 sensitivity √2)."""
    from privacy.mechanisms import distribution_vote

    onehot = np.repeat(np.eye(len(labels)), votes.astype(int), axis=0)
    return labels[distribution_vote(onehot.reshape(-1, len(labels)), noise_multiplier, rng)]


def answered_queries(event: DpEvent) -> int:
    """The queries a dp_icl ledger entry answered: its batch's vote count (a first batch also holds
    the sizes' release)."""
    return sum(e.count for e in all_events(event) if isinstance(e, SelfComposedEvent))


class DPICLServer:
    """Answers queries by the DP vote; charges ``ledger`` (dataset ``fingerprint``) per batch, the
    first one with ``size_event`` (the released sizes q was computed from) when given."""

    def __init__(self, engine, labels: list[str], rows, settings: DPICLSettings, ledger, fingerprint: str,
                 randomness, serve_id: str | None = None, size_event: DpEvent | None = None,
                 allow_delta_at_least_one_over_n: bool = False):
        import threading

        from tasks.methodkit.keyed_partition import keyed_subsets

        self._size_event, self._size_lock = size_event, threading.Lock()
        self._allow_delta = allow_delta_at_least_one_over_n  # the config's opt-in, passed to every reservation
        self.engine, self.labels, self.settings = engine, list(labels), settings
        self.ledger, self.fingerprint = ledger, fingerprint
        unit = ledger.dataset(fingerprint)["unit"]
        if unit != "record" or getattr(rows, "units", None) is not None:
            # the partition is keyed by record: one person's records land in many subsets, moving
            # many votes — the √2 charged per query holds for one record only
            from .errors import ConfigError

            raise ConfigError(f"dp_icl: the dataset's privacy unit is {unit!r}: its subsets are keyed by record, so "
                              "its per-query ε holds for one record, not one person; refused")
        self.serve_id = serve_id or f"dp_icl-{uuid.uuid4().hex[:12]}"
        self.noise = randomness.numpy(2)  # the votes' secret noise
        self._demo_tokens = _demo_token_budget(engine, settings, self.labels)
        self._label_ids = label_token_ids(engine, self.labels)
        self._context = engine.max_positions
        self._rows = rows
        self._zero_prefix = None
        self.open_charge: str | None = None  # the entry reserved and not yet committed (spent, unanswered)
        if settings.sample_rate is not None:  # a fresh Poisson sample per query (its secret draws)
            check_rate(settings.sample_rate, "dp_icl sample_rate")
            self._sampler = randomness.numpy(3)
            return
        parts = keyed_subsets(rows.texts, rows.labels, None, randomness.numpy(1).bytes(32), settings.subsets,
                              settings.shots)
        self._prefixes = [p for p in (self._prefix(part) for part in parts if part) if p is not None]

    def _prefix(self, part: list[int]):
        """The subset's encoded demonstrations, or None — the subset casts no vote — when they with the
        longest query would outgrow the model's context: measured on the tokens BEFORE the model runs
        (checked after ``encode_prefix``, a prefix over the context had already crashed).
        Never with the budget above on the tokenizers tested; the subset is the only one a record's
        length changes, so abstaining stays within the √2 charged."""
        text = self._demos([(self._rows.texts[i], self._rows.labels[i]) for i in part])
        if self._context is not None:
            ids = self.engine.tok(text, add_special_tokens=True, verbose=False)["input_ids"]
            if len(ids) + QUERY_TOKENS > self._context:
                return None
        return self.engine.encode_prefix(text)

    def _query_prefixes(self):
        """The prompts' encoded demonstrations for one query: the fixed partition's, or a fresh Poisson
        sample's (:func:`poisson_subsets`; an empty subset does not vote)."""
        if self.settings.sample_rate is None:
            return self._prefixes
        s = self.settings
        parts = poisson_subsets(len(self._rows.texts), s.sample_rate, s.subsets, s.shots, self._sampler)
        return [p for p in (self._prefix(part) for part in parts if part) if p is not None]

    def _demos(self, demos: list[tuple[str, str]]) -> str:
        return _demo_head(self.settings.instruction) + "".join(
            self.settings.template.replace("{text}", self._clip(x)) + _demo_tail(y) for x, y in demos)

    def _clip(self, text: str) -> str:
        """A demonstration's text within 48 words and the public per-demonstration token budget (a
        subset's prompt never outgrows the model's context, whatever its private rows' lengths)."""
        from tasks.methodkit.token_budget import clip_text

        return clip_text(self.engine, text, self._demo_tokens)

    def histogram(self, text: str) -> np.ndarray:
        """(|labels|,) the subsets' votes on one query (private: never released without noise)."""
        suffix = self._query_ids(text)
        votes = np.zeros(len(self.labels))
        for prefix in self._query_prefixes():  # one by one: see the module docstring
            logits = self.engine.last_logits([suffix], prefix)[0]
            votes[int(np.argmax(logits[self._label_ids].numpy()))] += 1
        return votes

    def _query_ids(self, text: str) -> list[int]:
        """The query in its template within ``QUERY_TOKENS`` — the room the demonstrations' budget left
        it, so that no prefix plus query outgrows the model's context: a query that overflowed it on
        one dataset and not on its neighbour (a longer private demonstration) would crash for one and
        answer for the other, a noiseless test of a record. Clipped by public things only (the query,
        the template), the template's tail kept."""
        from tasks.methodkit.token_budget import clip_tokens, clip_words

        ids = self.engine.ids(self.settings.template.replace("{text}", clip_words(text)))
        if self._demo_tokens is None or len(ids) <= QUERY_TOKENS:
            return ids
        head, tail = self.settings.template.split("{text}")
        room = max(1, QUERY_TOKENS - len(self.engine.ids(head)) - len(self.engine.ids(tail)) - 4)
        clipped = clip_tokens(self.engine, clip_words(text), room)
        return self.engine.ids(head + clipped + tail)[-QUERY_TOKENS:]

    def _vote(self, text: str) -> str:
        return noisy_vote(self.histogram(text), self.labels, self.settings.noise_multiplier, self.noise)

    def answer(self, texts: list[str], keep=None) -> list[str]:
        """The DP answers of one batch, charged as one ledger entry: reserved before any vote (a
        ``BudgetExceededError`` at the cap: nothing answered), committed after. ``keep(answers)``: called
        with the commit, Ctrl-C and SIGTERM held until both are done — a committed batch's answers are
        kept, never lost to an interrupt between the two."""
        if not texts:
            return []
        # a fresh id per batch: a counter reused across threads or restarts (a stable serve_id) met
        # the ledger's idempotent retry — the same entry returned, nothing charged, yet answered
        run_id = f"{self.serve_id}:batch-{uuid.uuid4().hex}"
        with self._size_lock:  # the sizes' release rides on the first batch reserved, once per server
            (event,) = self.events([len(texts)])
            self._reserve(run_id, event, f"dp_icl: {len(texts)} answered queries (inference-time spend)")
        answers = [self._vote(t) for t in texts]
        self._commit(run_id, event, keep, answers)
        return answers

    def _reserve(self, run_id: str, event: DpEvent, description: str) -> None:
        """Reserve ``event`` as ``run_id`` (refused at the cap: ``BudgetExceededError``), recorded as the
        open charge under held interrupts, the sizes' release then counted as charged,
        and the read marked. Called under ``_size_lock``."""
        with _interrupts_held():  # the reservation and its record together
            reservation = self.ledger.reserve(self.fingerprint, run_id, event, description=description,
                                              allow_delta_at_least_one_over_n=self._allow_delta)
            if reservation.new:  # from here on it stays spent, whatever stops it
                self.open_charge = run_id
        if not reservation.new:
            raise RuntimeError(f"dp_icl: {run_id} was already charged: not run again")
        self._size_event = None
        self.ledger.claim_read(run_id)  # the door's primitive: one attempt reads under a reservation

    def _commit(self, run_id: str, event: DpEvent, keep, result) -> None:
        """Commit ``run_id`` and hand ``result`` to ``keep`` with it, Ctrl-C and SIGTERM held until both
        are done."""
        with _interrupts_held():
            self.ledger.commit(run_id, event)
            self.open_charge = None
            if keep is not None:
                keep(result)

    def zero_shot(self, texts: list[str]) -> list[str]:
        """The label each query gets with no demonstration (the instruction, if any, and the query in
        its template): a function of the query alone and the public model, scored alone; no private
        row is read, nothing is charged."""
        if self._zero_prefix is None:
            self._zero_prefix = self.engine.encode_prefix(_demo_head(self.settings.instruction))
        out = []
        for text in texts:
            logits = self.engine.last_logits([self._query_ids(text)], self._zero_prefix)[0]
            out.append(self.labels[int(np.argmax(logits[self._label_ids].numpy()))])
        return out

    def comparison_events(self, queries: int, noise: float) -> DpEvent:
        """What the comparison charges: ``queries`` answered queries (with the sizes' release while this
        server has not charged it) and the released count."""
        from privacy.plan import with_release

        (event,) = self.events([queries])
        return with_release(event, comparison_event(noise))

    def compare(self, texts: list[str], labels: list[str], queries: int, noise: float, key: bytes,
                keep=None, progress=None) -> dict:
        """The comparison with zero-shot: the ``queries`` held-out rows of lowest keyed hash (``key``
        secret; empty public queries fill the rest, answered and counted 0, so the charge and the number
        of passes never tell how many there were) answered by the vote and zero-shot, D = Σ (vote right −
        zero-shot right) released with N(0, ``noise``²) from the secret stream. Charged as one ledger
        entry — reserved before any vote, committed after — ``keep(result)`` called with the commit,
        interrupts held (as :meth:`answer`). Returns the public numbers only.

        Privacy (add/remove one source record, which lies in the training split or in the holdout,
        by the partition's keyed hash): in the training split, each answer is one vote of sensitivity
        √2 charged as an answered query, and D is post-processing of the answers given the holdout; in
        the holdout, the H rows of lowest hash change by at most one swap — D moves by ≤ 2 (a padding
        row counts 0) — and the count is charged as a Gaussian of sensitivity 2. Zero-shot answers are
        functions of their own row. The rows run in a secret order; their wall time follows their
        lengths (as every query's does), which only the operator sees."""
        check_count(queries, "compare_queries", minimum=1)
        chosen = lowest_keyed(texts, labels, key, queries)
        rows = [(texts[i], labels[i]) for i in chosen] + [("", None)] * (queries - len(chosen))
        rows = [rows[i] for i in self.noise.permutation(len(rows))]  # padding at secret places
        run_id = f"{self.serve_id}:compare-{uuid.uuid4().hex}"
        with self._size_lock:
            event = self.comparison_events(queries, noise)
            self._reserve(run_id, event, f"dp_icl: comparison with zero-shot, {queries} answered held-out queries "
                                         "and one released count (inference-time spend)")
        votes, zero, truth = [], [], []
        for j, (text, label) in enumerate(rows):
            votes.append(self._vote(text))
            zero.append(self.zero_shot([text])[0])
            truth.append(label)
            if progress is not None:
                progress(j + 1, queries)
        released = compared_difference(votes, zero, truth) + noise * float(self.noise.standard_normal())
        result = {"difference": float(released), "sigma": float(noise), "queries": int(queries), "run_id": run_id}
        self._commit(run_id, event, keep, result)
        return result

    def events(self, batch_sizes: list[int]) -> list[DpEvent]:
        """The ledger events of the next batches of these sizes: the first also charges the sizes'
        release while this server has not charged it."""
        from privacy.plan import with_size_release

        s = self.settings
        events = [batch_event(s.noise_multiplier, b, s.sample_rate) for b in batch_sizes]
        if events and self._size_event is not None:
            events[0] = with_size_release(events[0], self._size_event)
        return events


# ---- served from a config (privprompt predict --dp-icl) ------------------------------------------

@dataclass
class Served:
    server: DPICLServer
    delta: float
    dataset: str
    cap: float
    comparison: dict | None = None  # the stored comparison with zero-shot of these settings (public numbers)
    compare_queries: int = 0        # H, when a comparison is due before the first answer (0: none due)
    compare_noise: float | None = None
    compare_digest: str | None = None
    state_root: object = None
    fallback: bool = True
    holdout: object = field(default=None, repr=False)  # the holdout's (texts, labels) while a comparison is due (private)


def sample_rate_of(block, n_released: int) -> float | None:
    """q of ``sampling: poisson``: M·N rows expected per query out of the RELEASED training size (an
    exact size would carry one record's presence into the published rate); None for a partition."""
    if block.sampling != "poisson":
        return None
    return min(1.0, block.subsets * block.shots / max(1, int(n_released)))


def settings_of(cfg, delta: float, sizes) -> DPICLSettings:
    """The config's ``dp_icl`` block on a dataset with released ``sizes`` (``tasks.data.ReleasedSizes``);
    σ calibrated, when not given, so that ``expected_queries`` answered queries — with the sizes'
    release their first batch charges under ``sampling: poisson`` — spend ``privacy.target_epsilon``."""
    block = cfg.dp_icl
    q = sample_rate_of(block, sizes.n_train)
    sigma = block.noise_multiplier or noise_with_release(
        cfg.privacy.target_epsilon, delta, block.expected_queries + comparison_queries(cfg, delta), q,
        *extra_events_of(cfg, delta, sizes))
    return DPICLSettings(block.subsets, block.shots, float(sigma), block.instruction, block.template, q)


def extra_events_of(cfg, delta: float, sizes) -> tuple[DpEvent | None, DpEvent | None]:
    """What rides on the first charge besides its queries: (the sizes' release (poisson), the
    comparison with zero-shot's count (when the config runs one))."""
    noise = comparison_noise(cfg, delta)
    return size_event_of(cfg.dp_icl, sizes), None if noise is None else comparison_event(noise)


def size_event_of(block, sizes) -> DpEvent | None:
    """The sizes' release a server's first batch charges: under ``sampling: poisson`` (q is computed from
    them), none for a partition (nothing it answers depends on the sizes)."""
    return sizes.event if block.sampling == "poisson" else None


def dataset_delta(cfg, ledger, key: str, n_released: int) -> float:
    """δ of the spend: the registered dataset's own; for a dataset not registered yet,
    ``privacy.target_delta`` (required: the default δ depends on the dataset's size, a statistic no
    charge of this command covers)."""
    from privacy.ledger import UnknownDatasetError

    from .errors import ConfigError

    try:
        return float(ledger.dataset(key)["delta"])
    except UnknownDatasetError:
        if not cfg.privacy.target_delta:
            raise ConfigError("dp_icl on a dataset the ledger has not seen needs privacy.target_delta: the default δ "
                              "depends on the dataset's size, which nothing charged here may reveal") from None
        from privacy.validation import check_delta

        try:  # the rule every run's δ meets (tasks.run_plan.resolve_delta), on the released size
            return check_delta(cfg.privacy.target_delta, "privacy.target_delta", n=n_released,
                               allow_at_least_one_over_n=cfg.privacy.allow_delta_at_least_one_over_n)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def open_server(cfg, paths) -> Served:
    """The DP-ICL server of ``cfg``'s dataset: its keyed partition (as the flows make it), the
    dataset registered in (or matched against) the ledger under the config's cap, the training
    split's rows split into secret keyed subsets, the local causal LM. Reads private rows; charges
    nothing until a batch is answered."""
    from tasks.methodkit.causal_engine import causal_engine_for
    from tasks.methodkit.classifiers import read_split
    from tasks.methods import PrivateRows
    from tasks.randomness import DpRandomness

    from .data import partition_dataset
    from .charge import ensure_dataset, source_dataset, _records_of
    from .state import default_data_root

    # public checks first, before any private read or ledger write: the unit, the model,
    # the labels' tokens and the demonstrations' token budget
    check_unit(cfg)
    engine = causal_engine_for(cfg)
    label_token_ids(engine, list(cfg.data.labels))
    _demo_token_budget(engine, cfg.dp_icl, list(cfg.data.labels))
    part = partition_dataset(cfg.data, cfg.seed, paths.private, default_data_root(cfg.data_root))
    ledger = paths.open_ledger()
    records = _records_of(part)
    match = source_dataset(ledger, records, part.dataset) if records is not None else None
    key = match["fingerprint"] if match else (records.key if records is not None else part.dataset_key)
    delta = dataset_delta(cfg, ledger, key, part.sizes.n_for_delta)
    row = ensure_dataset(ledger, part, cfg.privacy.dataset_epsilon_cap, delta)
    texts, labels = read_split(part.train_path)
    rows = PrivateRows(texts, labels)
    settings = settings_of(cfg, delta, part.sizes)
    # q is computed from the released sizes: their release is charged with the first batch
    size_event = size_event_of(cfg.dp_icl, part.sizes)
    server = DPICLServer(engine, list(cfg.data.labels), rows, settings, ledger, row["fingerprint"], DpRandomness(),
                         size_event=size_event,
                         allow_delta_at_least_one_over_n=cfg.privacy.allow_delta_at_least_one_over_n)
    served = Served(server, delta, row["name"], float(row["epsilon_cap"]), state_root=paths.root,
                    fallback=cfg.fallback.enabled)
    noise = comparison_noise(cfg, delta)
    if noise is not None:
        served.compare_noise = noise
        model = model_identity(cfg)
        served.compare_digest = settings_digest(settings, f"{row['fingerprint']}:{part.fingerprint}", model,
                                                list(cfg.data.labels), noise, cfg.dp_icl.compare_queries)
        served.comparison = kept_comparison(paths.root, served.compare_digest, ledger, row["fingerprint"])
        if served.comparison is None:  # due: the holdout (never demonstrations) is read for it
            served.compare_queries = cfg.dp_icl.compare_queries
            served.holdout = read_split(part.holdout_path)
    return served


def check_fits(served: Served, n_queries: int, batch_size: int) -> dict:
    """Every batch of ``n_queries`` composed with the dataset's spend, before any is answered: over
    the cap, a ``BudgetExceededError`` and nothing answered."""
    from privacy.ledger.errors import BudgetExceededError

    sizes = [min(batch_size, n_queries - i) for i in range(0, n_queries, batch_size)]
    if served.compare_queries:  # the comparison due before the first answer is charged first
        events = [served.server.comparison_events(served.compare_queries, served.compare_noise)]
        events += [batch_event(served.server.settings.noise_multiplier, b, served.server.settings.sample_rate)
                   for b in sizes]
    else:
        events = served.server.events(sizes)
    ledger, key = served.server.ledger, served.server.fingerprint
    preview = ledger.preview(key, events, served.delta, cap=served.cap, name=served.dataset)
    if preview["total_epsilon"] > preview["cap"] + 1e-12:
        from privacy import accountant as acct
        from privacy.events import ComposedEvent

        raise BudgetExceededError(
            f"dp_icl: answering {n_queries} queries would bring dataset {served.dataset!r} to ε="
            f"{preview['total_epsilon']:.4f} per record at δ={served.delta:g}, over its cap ε={preview['cap']:.4f} "
            f"(spent ε={preview['spent_epsilon']:.4f}); {queries_left(served, preview)} more fit; nothing answered",
            fingerprint=key, name=served.dataset, needed=acct.spend(ComposedEvent(tuple(events)), served.delta).epsilon,
            spent=preview["spent_epsilon"],
            total=preview["total_epsilon"], cap=preview["cap"], delta=served.delta)
    return preview


def queries_left(served: Served, preview: dict) -> int:
    """How many more queries (one batch) fit under the cap, composed with the dataset's spend (the
    ledger's preview)."""
    ledger, key, server = served.server.ledger, served.server.fingerprint, served.server
    if served.compare_queries:  # the comparison still due comes first
        first = [server.comparison_events(served.compare_queries, served.compare_noise)]
        s = server.settings
        return largest_fitting(lambda b: ledger.preview(key, first + [batch_event(s.noise_multiplier, b, s.sample_rate)],
                                                        served.delta, cap=served.cap)["total_epsilon"]
                               <= preview["cap"] + 1e-12)
    return largest_fitting(lambda b: ledger.preview(key, server.events([b]), served.delta, cap=served.cap)
                           ["total_epsilon"] <= preview["cap"] + 1e-12)


def answer_all(served: Served, texts: list[str], batch_size: int, progress=None):
    """The DP answers of ``texts`` in batches of ``batch_size``, each charged (:meth:`DPICLServer.answer`),
    after :func:`check_fits` found room for all of them. Returns (answers, refusal): another spend on
    the dataset between the check and a later batch can still refuse that batch (the ledger's cap
    holds) — the answers already charged are returned with the refusal, never thrown away."""
    from privacy.ledger.errors import BudgetExceededError

    check_count(batch_size, "batch_size", minimum=1)
    if served.comparison is None or served.comparison["difference"] >= 0 or not served.fallback:
        check_fits(served, len(texts), batch_size)
    if served.compare_queries:
        try:
            compare(served, progress)
        except (Exception, KeyboardInterrupt) as failure:  # noqa: BLE001 - nothing answered yet
            return [], failure
    if served.comparison is not None and served.comparison["difference"] < 0 and served.fallback:
        return zero_shot_all(served, texts, batch_size, progress)
    answers: list[str] = []
    for i in range(0, len(texts), batch_size):
        try:
            served.server.answer(texts[i:i + batch_size], keep=answers.extend)
            if progress is not None:  # inside: a Ctrl-C / SIGTERM while it prints keeps the answers too
                progress(len(answers), len(texts))
        except BudgetExceededError as refusal:
            return answers, refusal
        except (Exception, KeyboardInterrupt) as failure:  # noqa: BLE001 - the answers already charged are kept,
            return answers, failure                          # whatever stopped the rest (Ctrl-C too)
    return answers, None


def compare(served: Served, progress=None) -> dict:
    """The comparison with zero-shot due before the first answer (:meth:`DPICLServer.compare`), charged,
    kept in the state folder with the commit; the holdout's rows dropped after."""
    import secrets

    texts, labels = served.holdout

    def keep(result: dict) -> None:
        store_comparison(served.state_root, served.compare_digest, result)
        served.comparison, served.compare_queries, served.holdout = result, 0, None

    report = None if progress is None else (lambda done, total: progress(done, total, stage="comparison"))
    served.server.compare(texts, labels, served.compare_queries, served.compare_noise, secrets.token_bytes(32),
                          keep=keep, progress=report)
    return served.comparison


def zero_shot_all(served: Served, texts: list[str], batch_size: int, progress=None):
    """The fallback: every query answered zero-shot (no demonstration, no private row used, nothing charged)."""
    answers: list[str] = []
    for i in range(0, len(texts), batch_size):
        try:
            answers.extend(served.server.zero_shot(texts[i:i + batch_size]))
            if progress is not None:
                progress(len(answers), len(texts))
        except (Exception, KeyboardInterrupt) as failure:  # noqa: BLE001 - the answers so far are kept
            return answers, failure
    return answers, None


def plan_line(cfg, delta: float, sizes) -> str:
    """What ``dp_icl.expected_queries`` answered queries would spend on their own (with the sizes'
    release a poisson server's first batch charges), and how many answered queries the dataset's cap
    affords alone (``privprompt plan``): a team expecting N queries sees whether per-query DP-ICL
    fits, where a one-time method's ε stays flat."""
    from privacy import accountant as acct

    if _person_unit(cfg):
        return ("dp_icl (served, per query): refused on this dataset — its unit is a person, and dp_icl's subsets are "
                "keyed by record (its per-query ε holds for one record only)")
    settings, extra = settings_of(cfg, delta, sizes), extra_events_of(cfg, delta, sizes)
    n, cap, q = cfg.dp_icl.expected_queries, cfg.privacy.dataset_epsilon_cap, settings.sample_rate
    h = comparison_queries(cfg, delta)
    eps = acct.spend(first_batch_event(settings.noise_multiplier, n + h, q, *extra), delta).epsilon
    most = queries_within(cap, delta, settings.noise_multiplier, limit=10**6, sample_rate=q, size_event=extra[0],
                          comparison=extra[1])
    most = max(0, most - h)
    sampled = "" if q is None else f", each on a Poisson sample at q={q:.3g} (with the training size's release),"
    compared = ("" if not h else f" with the comparison with zero-shot first ({h} held-out queries and its released "
                f"count of noise σ={comparison_noise(cfg, delta):.1f} rows, once per settings: an accuracy gain below "
                f"{CONCLUSIVE_Z * comparison_noise(cfg, delta) / h:.2f} is not shown),")
    fits = "fit" if eps <= cap else "do NOT fit"
    return (f"dp_icl (served, per query): {n} answered queries at σ={settings.noise_multiplier:.3g}{sampled}{compared} "
            f"spend ε={eps:.4f} per record at δ={delta:g} on their own and {fits} the dataset's cap ε={cap:g}, which "
            f"affords {'at least ' if most >= 10**6 - h else ''}{most:,} of them alone — an inference-time spend that "
            "grows with every answer (one-time methods such as dp_opt and dp_fewshot stay flat)"
            + ("" if h else "; no comparison with zero-shot (dp_icl.compare_queries or fallback.epsilon_share is 0)"))
