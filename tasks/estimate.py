"""``privprompt plan``'s size of each run before it runs: its training steps (the plan's, which the
run takes exactly) and a wall-time estimate from a short measured probe of the model on this
machine (a forward + backward pass of a synthetic batch at ``models.max_length``, and a forward
pass alone), scaled by the plan's steps and expected batch, and by the released test size that
the run evaluates on. Public inputs only: the plan (released sizes) and synthetic token ids.

After a run, its measured seconds per example take the probe's place for the same method and model
on this machine (:func:`record_observed`): a probe at ``models.max_length`` counts every example at
full length, which real texts (and the length groups that skip their padding) are not. They are
the run's published times (its model work, in its record) over its planned steps, expected batch and
released test size: nothing the run record does not already say."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PROBE_BATCH = 8


@dataclass(frozen=True)
class Probe:
    """Seconds per example on this machine: training (forward + backward) and evaluation (forward)."""

    model: str
    train_s: float
    eval_s: float
    measured_at: str | None = None  # when a probe read from the cache was measured (None: now)
    observed: bool = False  # seconds a run of the method took on this machine, not a synthetic probe


_PROBES: dict[tuple, Probe] = {}
CACHE_ENV = "PRIVPROMPT_PROBE_CACHE"  # a JSON file of probes measured on this machine (the state folder's cache/)
REFRESH_ENV = "PRIVPROMPT_PROBE_REFRESH"  # "1": measure again and replace the cached probe (plan --probe)


def state_cache(state_root) -> Path:
    return Path(state_root) / "cache" / "probe.json"


def enable_cache(state_root) -> None:
    """Keep probes in ``<state_root>/cache/probe.json`` unless ``$PRIVPROMPT_PROBE_CACHE`` says otherwise."""
    os.environ.setdefault(CACHE_ENV, str(state_cache(state_root)))


def _machine() -> str:
    """What a probe's seconds depend on besides the model: the host, its cores and threads, torch and
    the accelerator."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return f"{platform.node()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{','.join(gpus)}"


def _cache_path():
    target = os.environ.get(CACHE_ENV)
    return Path(target) if target else None


def _cached(key: str) -> Probe | None:
    path = _cache_path()
    if path is None or os.environ.get(REFRESH_ENV) == "1":
        return None
    try:
        hit = json.loads(path.read_text()).get(key)
        return Probe(hit["model"], float(hit["train_s"]), float(hit["eval_s"]), hit.get("measured_at"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def read_cache(path: Path) -> dict:
    """A JSON cache file of this machine's state folder as a dict ({} where it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_cache(path: Path, key: str, entry) -> None:
    """Set ``key`` to ``entry`` in the JSON cache file ``path`` (atomic replace, 0600; a cache that
    cannot be written is skipped: it only saves time)."""
    try:
        data = read_cache(path)
        data[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def _store(key: str, measured: Probe, path: Path | None = None) -> None:
    """Add a probe to the cache file."""
    path = path or _cache_path()
    if path is not None:
        update_cache(path, key, {"model": measured.model, "train_s": measured.train_s, "eval_s": measured.eval_s,
                                 "measured_at": measured.measured_at or time.strftime("%Y-%m-%d %H:%M")})


def probe(model_name: str, max_length: int, train_batch: int = PROBE_BATCH, eval_batch: int = 64, seed: int = 0,
          repeats: int = 2, placement=None) -> Probe:
    """The model's per-example seconds at the run's batch sizes (a small model's time is mostly
    per call), measured on synthetic ids (the best of ``repeats`` after a warm-up pass) once per
    process, and kept per machine in the probe cache (:func:`enable_cache`) until asked to measure
    again (``$PRIVPROMPT_PROBE_REFRESH``: ``privprompt plan --probe``)."""
    train_batch, eval_batch = max(1, min(int(train_batch), 64)), max(1, min(int(eval_batch), 128))
    key = (model_name, max_length, train_batch, eval_batch, placement.key() if placement else None)
    if key in _PROBES:
        return _PROBES[key]
    disk_key = json.dumps([*map(str, key), _machine()])
    hit = _cached(disk_key)
    if hit is not None:
        _PROBES[key] = hit
        return hit
    import torch

    from models.backbones import load_backbone

    bb = load_backbone(model_name, seed=seed, placement=placement)
    model = bb.model
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)
    ids = {b: torch.randint(0, vocab, (b, max_length), generator=generator).to(device)
           for b in {train_batch, eval_batch}}

    def train_pass() -> None:
        emb = model.get_input_embeddings()(ids[train_batch]).detach().requires_grad_(True)
        out = model(inputs_embeds=emb, attention_mask=torch.ones_like(ids[train_batch]))
        out[0].float().sum().backward()

    def eval_pass() -> None:
        with torch.no_grad():
            model(input_ids=ids[eval_batch], attention_mask=torch.ones_like(ids[eval_batch]))

    def best(fn, batch: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times) / batch

    _PROBES[key] = Probe(model_name, best(train_pass, train_batch), best(eval_pass, eval_batch))
    _store(disk_key, _PROBES[key])
    return _PROBES[key]


def _observed_key(method: str, model_name: str, max_length: int, train_batch: int, eval_batch: int, placement) -> str:
    train_batch, eval_batch = max(1, min(int(train_batch), 64)), max(1, min(int(eval_batch), 128))
    return json.dumps(["observed", method, model_name, str(max_length), str(train_batch), str(eval_batch),
                       str(placement.key() if placement else None), _machine()])


def observed(method: str, model_name: str, max_length: int, train_batch: int, eval_batch: int,
             placement=None) -> Probe | None:
    """The seconds per example the last run of ``method`` on ``model_name`` took on this machine
    (:func:`record_observed`); a field it did not measure is None. None while a probe is measured
    again (``privprompt plan --probe``)."""
    path = _cache_path()
    if path is None or os.environ.get(REFRESH_ENV) == "1":
        return None
    try:
        hit = json.loads(path.read_text()).get(_observed_key(method, model_name, max_length, train_batch,
                                                             eval_batch, placement))
        train_s, eval_s = hit.get("train_s"), hit.get("eval_s")
        return Probe(model_name, None if train_s is None else float(train_s), None if eval_s is None else float(eval_s),
                     hit.get("measured_at"), observed=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def record_observed(method: str, model_name: str, max_length: int, train_batch: int, eval_batch: int, placement,
                    train_s: float | None, eval_s: float | None, path: Path | None = None) -> None:
    """Keep a run's seconds per example (training: per planned step × expected batch; evaluation:
    per released test example; per record under a person unit) for the next plans of ``method``, in
    ``path`` (default: the probe cache)."""
    if train_s is None and eval_s is None:
        return
    _store(_observed_key(method, model_name, max_length, train_batch, eval_batch, placement),
           Probe(model_name, train_s, eval_s), path)


def with_observed(measured: Probe | None, seen: Probe | None) -> Probe | None:
    """The probe with what a run observed in its place (a field the run did not measure: the probe's)."""
    if seen is None:
        return measured
    train_s = seen.train_s if seen.train_s is not None else (measured.train_s if measured else None)
    eval_s = seen.eval_s if seen.eval_s is not None else (measured.eval_s if measured else None)
    if eval_s is None:
        return measured
    return Probe(seen.model, train_s, eval_s, seen.measured_at, observed=True)  # train_s None: a run that trains none


def trains(plan) -> bool:
    """Whether the estimate of ``plan`` counts training: its steps × expected batch, or one pass
    over the training data for a private method without a step count."""
    settings = plan.settings
    return (settings.get("steps") is not None and settings.get("expected_batch") is not None) or plan.reads_private


def run_estimate(plan, sizes, measured: Probe | None, records_per_unit: int | None = None) -> dict:
    """``steps`` (the plan's training steps; None for a run without its own step count, or a
    selection, whose trials have their own) and ``seconds`` (None without a probe, or for a
    selection): steps × expected batch × training seconds per example, plus the evaluation of the
    released test split and, with a comparison with no prompt (the plan's ``no_prompt`` release),
    the holdout scored twice; a private method without a step count: one pass over its training data.

    Under a person unit the released sizes and the expected batch count PEOPLE, and the model's work
    is per record: each person is counted as ``records_per_unit`` records (``data.max_records_per_unit``,
    public: the estimate is then an upper bound, ``bound``); without a cap the records per person are a
    private statistic, and no time is estimated (``seconds`` None, ``why`` says so)."""
    settings = plan.settings
    if "selection" in settings:  # a selection's trials: estimated from their own plans (selection_estimate)
        return {"steps": None, "seconds": None}
    steps, batch = settings.get("steps"), settings.get("expected_batch")
    out = {"steps": None if steps is None else int(steps), "seconds": None}
    per_person = getattr(sizes, "unit", "record") != "record"
    if per_person and not records_per_unit:
        if measured is not None:
            out["why"] = "records per person are private: set data.max_records_per_unit for an upper bound"
        return out
    if measured is None:
        return out
    rows = float(records_per_unit) if per_person else 1.0  # records per counted unit
    seconds = sizes.n_test * rows * measured.eval_s
    if getattr(plan, "no_prompt", None) is not None:
        seconds += 2 * getattr(sizes, "n_holdout", 0) * rows * measured.eval_s
    if trains(plan) and measured.train_s is None:  # seen only evaluating, never probed: no estimate
        return out
    if steps is not None and batch is not None:
        seconds += float(steps) * float(batch) * rows * measured.train_s
    elif plan.reads_private:
        seconds += sizes.n_train * rows * measured.train_s
    out["seconds"] = seconds
    if per_person:
        out["bound"] = True
    return out


def selection_estimate(work: dict, sizes, measured: Probe | None, records_per_unit: int | None = None) -> dict:
    """A selection's estimate from :func:`tasks.selection.trial_work`: its trainings (steps × expected
    batch each, weighted by the expected number of times each is trained), its holdout scores (each
    row its own: one per pass on a CPU, row-own batches on an accelerator; counted at the probe's
    evaluation rate: a lower bound there) and the test
    split. ``steps``: the expected training steps in all."""
    weight = float(work.get("weight", 1.0))
    trained = [(s, b) for s, b in work["trainings"] if s is not None and b is not None]
    steps = weight * sum(float(s) for s, _ in trained)
    out = {"steps": int(round(steps)) if trained else None, "seconds": None}
    per_person = getattr(sizes, "unit", "record") != "record"
    if measured is None or (per_person and not records_per_unit):
        if measured is not None:
            out["why"] = "records per person are private: set data.max_records_per_unit for an upper bound"
        return out
    rows = float(records_per_unit) if per_person else 1.0
    seconds = weight * sum(float(s) * float(b) for s, b in trained) * measured.train_s
    seconds += (work["scores"] * getattr(sizes, "n_holdout", 0) + sizes.n_test) * measured.eval_s
    out["seconds"] = seconds * rows
    if per_person:
        out["bound"] = True
    return out


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"≈{seconds:.0f} s"
    return f"≈{seconds / 60:.1f} min"
