"""The config blocks every flow shares (data, models, privacy budget, public data, MIA, audit).

Method blocks live next to their method (``tasks/methods/<name>.py``); ``tasks/config.py``
assembles the one schema from these blocks and the method registry. Unknown keys are errors.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .attacks import default_attacks, registered_attacks, unknown_attack_message


class Block(BaseModel):
    """Base of every config block: unknown keys are errors. A parsed config is frozen (read, never
    written: a changed value is a new config, ``model_copy(update=...)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(Block):
    name: str = Field(description="dataset name, also the folder under the data root")
    path: str | None = Field(None, description="folder with train/test files (default: <data_root>/<name>)")
    hub: str | None = Field(None, description="a hub dataset id for `datasets.load_dataset` instead of files")
    hub_config: str | None = Field(None, description="the hub dataset's configuration name, if it has several")
    hub_revision: str | None = Field(None, description="pin the hub dataset's revision (part of the ledger's key)")
    train_split: str = Field("train", description="file stem (train.csv / .jsonl / .parquet) or hub split of the "
                             "private source; training and holdout records are drawn from it")
    test_split: str = Field("test", description="file stem or hub split of the test records")
    text_field: str = Field("text", description="column / JSON key holding the input text")
    label_field: str = Field("label", description="column / JSON key holding the label")
    labels: list[str] = Field(min_length=2, description="the label names, in order; a raw label is kept when it is "
                              "one of them (or an integer index into them) after label_map")
    label_map: dict[str, str] = Field(default_factory=dict, description="raw label (as text, e.g. \"0\" or "
                                      "\"neg\") -> label name of `labels`")
    # Splits are by a keyed hash of each record (tasks/data.py): a record's split depends on that
    # record alone, so adding or removing one SOURCE record changes only its own assignment.
    holdout_fraction: float = Field(0.1, gt=0, lt=1, description="probability that a source record is held "
                                    "out (validation); expected holdout size holdout_fraction × records")
    train_fraction: float | None = Field(None, gt=0, le=1, description="probability that a source record is a "
                                         "training record (expected size train_fraction × records); default: "
                                         "every record not held out (1 − holdout_fraction)")
    test_fraction: float = Field(1.0, gt=0, le=1, description="probability that a record of the test split is "
                                 "kept (expected size test_fraction × test records)")
    canaries: int = Field(0, ge=0, description="random canary records, each planted with prob. 1/2 (with a user "
                          "unit: canary units of data.canary_records_per_unit records, each unit planted with prob. 1/2)")
    canary_records_per_unit: int = Field(1, ge=1, description="records of each canary unit (a user unit only): the "
                                         "canary audit then bounds ε per unit from units of several records")
    size_noise_sigma: float = Field(50.0, gt=0, le=1e6, description="σ (in records) of the Gaussian noise on the "
                                    "split sizes a dp run publishes and plans with (data.n_train, q = B/n_train, "
                                    "steps, δ): drawn once per partition from secret randomness, part of every dp "
                                    "run's ε (privacy.size_epsilon: 0.071 at δ = 1e-6 for σ = 50)")
    test_shareable: bool = Field(False, description="the test split may be sent to remote endpoints "
                                                    "(models.endpoints); training rows never are")
    privacy_unit: str = Field("record", min_length=1, description="what one ε protects: `record` (one record "
                              "added or removed), or the name of a field whose value identifies a person (all "
                              "records sharing a value are one unit, and every ε is stated for adding or removing "
                              "one such unit): splits then assign whole units by a keyed hash of the unit id, "
                              "sizes are released as unit counts and dp methods bound each unit's contribution; ids are "
                              "compared exactly (outer whitespace stripped): normalise case and Unicode form first")
    max_records_per_unit: int | None = Field(None, ge=1, description="contribution bound with a user unit: at "
                                             "most this many of a unit's records are kept in each split (train / "
                                             "holdout and test), chosen by a keyed hash of each record (never the "
                                             "seed); default: all of them (required with data.person_field and "
                                             "data.privacy_unit: record)")
    person_field: str | None = Field(None, min_length=1, description="the field whose value identifies a person, for a "
                                   "RECORD-level run on a dataset of people (data.privacy_unit: record): the run's "
                                   "mechanism stays per record, but its data are split as whole people (keyed hash of "
                                   "this field), at most data.max_records_per_unit = k records of each person are kept "
                                   "(required), and the ledger's dataset is stated per person: the run is charged the "
                                   "group-privacy bound for k records (privacy.unit is the field, privacy.epsilon the "
                                   "per-person ε charged, privacy.epsilon_per_record the mechanism's ε for one training "
                                   "record added or removed; at the source, a record added to a person who already has k "
                                   "may displace one of theirs under the cap: a replacement). So "
                                   "one ledger can hold runs of data.privacy_unit: record and data.privacy_unit: <field> "
                                   "(a sweep over the unit). With data.privacy_unit naming a field it may only repeat "
                                   "that field. Methods whose events have no group-privacy rule (argmax / limited-domain "
                                   "votes, random-stopping private selection) and local-DP methods are refused; "
                                   "selection.mode: every_candidate is charged its holdout counts at sensitivity k")

    @model_validator(mode="before")
    @classmethod
    def _no_fixed_sizes(cls, data):
        if isinstance(data, dict):
            for key, rate, example in (("train_size", "train_fraction", "2,000 of SST-2's 67,349 training records: 0.0297"),
                                       ("test_size", "test_fraction", "500 of SST-2's 1,821 test records: 0.2746")):
                if key in data:
                    raise ValueError(
                        f"data.{key} is no longer accepted: a subset of a fixed size depends on how many other "
                        f"records there are, so adding one source record would change which others are chosen. "
                        f"Use data.{rate}, the probability that each record is kept (by a keyed hash of the "
                        f"record alone); expected size = {rate} × the number of records (e.g. {example})")
        return data

    @model_validator(mode="after")
    def _fractions_fit(self):
        if self.train_fraction is not None and self.holdout_fraction + self.train_fraction > 1 + 1e-12:
            raise ValueError(f"data.holdout_fraction ({self.holdout_fraction:g}) + data.train_fraction "
                             f"({self.train_fraction:g}) exceed 1: each source record lands in at most one of "
                             "holdout and training; lower one of them")
        return self

    @model_validator(mode="after")
    def _unit_field(self):
        if self.privacy_unit != "record" and self.privacy_unit in (self.text_field, self.label_field):
            which = "data.text_field" if self.privacy_unit == self.text_field else "data.label_field"
            raise ValueError(f"data.privacy_unit names the field {self.privacy_unit!r}, which is {which}: name the "
                             "field whose value identifies a person (or `record`)")
        if self.privacy_unit == "record" and self.canary_records_per_unit != 1:
            raise ValueError("data.canary_records_per_unit makes canary units of several records: it needs a user "
                             "unit (data.privacy_unit naming a field)")
        if self.person_field is not None and self.person_field in (self.text_field, self.label_field):
            which = "data.text_field" if self.person_field == self.text_field else "data.label_field"
            raise ValueError(f"data.person_field names the field {self.person_field!r}, which is {which}: name the field "
                             "whose value identifies a person")
        if self.user_unit and self.person_field is not None and self.person_field != self.privacy_unit:
            raise ValueError(f"data.person_field ({self.person_field!r}) differs from data.privacy_unit "
                             f"({self.privacy_unit!r}): one field identifies a person; set them alike or remove "
                             "data.person_field")
        if self.privacy_unit == "record" and self.max_records_per_unit is not None and self.person_field is None:
            raise ValueError("data.max_records_per_unit bounds the records of a user unit: set data.privacy_unit to "
                             "the field that identifies a person (or, for a record-level run charged per person, "
                             "data.person_field), or remove it (with `record` each unit is one record)")
        if self.privacy_unit == "record" and self.person_field is not None and self.max_records_per_unit is None:
            raise ValueError(f"data.person_field: {self.person_field} with data.privacy_unit: record charges this record-level "
                             "run per person by group privacy, which is unbounded for a person with unboundedly many "
                             "records: set data.max_records_per_unit (k records kept per person; the charge is for k)")
        return self

    @property
    def user_unit(self) -> bool:
        """True when the privacy unit is a person (a field), not a record."""
        return self.privacy_unit != "record"

    @property
    def unit_field(self) -> str | None:
        """The field naming a person, by which the data are split into whole people and capped:
        ``privacy_unit`` when it names one, else ``person_field`` (None: every record its own unit)."""
        return self.privacy_unit if self.user_unit else self.person_field

    @property
    def group_size(self) -> int | None:
        """k of a record-level run on a dataset of people (``person_field`` with ``privacy_unit:
        record``): its record-level events are charged for a group of k records (None otherwise)."""
        return self.max_records_per_unit if not self.user_unit and self.person_field is not None else None

    @property
    def charge_unit(self) -> str:
        """The unit the ledger's dataset, the charge and ``privacy.unit`` are stated for."""
        return self.unit_field or "record"

    @property
    def train_rate(self) -> float:
        """Probability that a source record is a training record."""
        return 1.0 - self.holdout_fraction if self.train_fraction is None else self.train_fraction

    @field_validator("labels")
    @classmethod
    def _unique_labels(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"labels must be unique, got {v}")
        return v


class EndpointConfig(Block):
    """An OpenAI-compatible completions endpoint evaluated with the published (text) prompt."""

    alias: str = Field(description="name in the run record: test.accuracy.<alias>")
    base_url: str = Field(description="e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the model name the endpoint serves (its `model` request field)")
    api_key_env: str | None = Field(None, description="environment variable holding the API key (never logged)")
    top_logprobs: int = Field(5, ge=1, le=20, description="top log-probabilities asked per answer (OpenAI's "
                              "completions take at most 5; llama.cpp's server more)")
    label_token_ids: list[int] | None = Field(None, description="each label's first token id under the endpoint's "
                                              "tokenizer, in data.labels order: sent as logit_bias +100 (one token "
                                              "generated at temperature 0 is then the label with the largest "
                                              "log-probability, as the local target reads it); null: the label is "
                                              "read from the top log-probabilities or the generated text")

    @field_validator("base_url")
    @classmethod
    def _no_credentials(cls, v):
        from urllib.parse import urlsplit

        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL, got {v!r}")
        if parts.username or parts.password:  # the URL is logged (MLflow param, error lines): keys go in api_key_env
            raise ValueError("holds credentials (user:password@): put the key in an environment variable named by "
                             "api_key_env; the URL is logged")
        return v


class PlacementConfig(Block):
    """How a frozen backbone is loaded (``models.placement``): through Transformers / Accelerate /
    bitsandbytes; the prompt, its per-sample gradients, the clipping and the noise stay float32."""

    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = Field(
        "auto", description="weights' dtype: auto (Transformers' default), float32, bfloat16, float16")
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = Field(
        None, description="null: the whole model on the run's device; auto/balanced/balanced_low_0/sequential: "
        "Accelerate spreads its layers over the visible GPUs, then CPU memory (offload) — CUDA only")
    quantization: Literal["8bit", "4bit"] | None = Field(
        None, description="8-/4-bit frozen weights (bitsandbytes; 4bit: NF4, double quantisation, compute in "
        "bfloat16) — CUDA only; refused in one line elsewhere")

    def placement(self):
        from models.placement import Placement

        return Placement(self.dtype, self.device_map, self.quantization)


class ModelsConfig(Block):
    local: str = Field(description="model where private data is used (HF id, local path or alias)")
    target: str | None = Field(None, description="model the prompt is published for (default: local)")
    evaluate_on: list[str] = Field(default_factory=list, description="more models (HF id / path / alias) the "
                                   "published prompt is evaluated on: test.accuracy.<alias>")
    endpoints: list[EndpointConfig] = Field(default_factory=list, description="remote completions endpoints: "
                                            "they receive only the test split, which data.test_shareable must allow")
    label_descriptions: dict[str, str] = Field(default_factory=dict, description="label name -> what the model "
                                               "scores for it. Masked / causal LM (verbalizer): a label word whose "
                                               "FIRST token is scored (default \" <label>\"; first tokens must "
                                               "differ). Encoder (minilm): a sentence, cosine to the input "
                                               "(default: the label name)")
    template: str | None = Field(None, description="input template with {text} once; masked LMs also need {mask} "
                                 "after it. Default: causal \"{text} It was\", masked \"{text} It was {mask}.\", "
                                 "encoder \"{text}\"; text prompts (dp_opt and its baselines, endpoints) "
                                 "\"Input: {text}\\n\\nOutput:\"")
    max_length: int = Field(64, gt=4, description="tokens per input, template included (the text is truncated)")
    eval_batch_size: int = Field(64, gt=0, description="batch size of evaluation and scoring")
    physical_batch_size: int | None = Field(
        None, gt=0, description="examples per forward/backward pass of a training step (every DP path: soft "
        "prompt, prefix, per-unit, DPZero, POST's student, Privacy-Flat): one logical DP step — one clipped "
        "gradient per example or unit, one sum, one noise draw — computed over micro-batches of this size; "
        "memory only, the accounting and the released numbers are unchanged. null: chosen from the GPU's "
        "free memory by a measured probe (80%), 64 on CPU")

    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="how every backbone (local, "
                                       "target, student, evaluate_on) is loaded: dtype, device_map, quantization")
    placement_for: dict[str, PlacementConfig] = Field(
        default_factory=dict, description="model name -> its own placement, replacing `placement` for that model "
        "(e.g. a 70B target with device_map: auto and quantization: 4bit)")

    @property
    def target_name(self) -> str:
        return self.target or self.local

    def placement_of(self, name: str):
        """The :class:`models.placement.Placement` model ``name`` is loaded with."""
        return self.placement_for.get(name, self.placement).placement()


class PrivacyConfig(Block):
    """The budget only: what a DP method may spend, and the dataset's cap. Mechanism settings
    (clipping norm, noise) belong to the method blocks."""

    target_epsilon: float = Field(8.0, description="ε the DP method spends")
    target_delta: float | None = Field(None, description="δ; default: the method's, never above 1/(10 n_train) "
                                       "(most: min(1e-5, 1/(10 n_train))); δ ≥ 1/n_train is refused unless "
                                       "allow_delta_at_least_one_over_n")
    dataset_epsilon_cap: float = Field(10.0, description="total ε allowed on this dataset (ledger)")
    allow_delta_at_least_one_over_n: bool = Field(
        False, description="accept a target_delta ≥ 1/n_train, which (ε, δ)-DP lets a mechanism spend on "
        "publishing whole records (e.g. DP-OPT's paper setting δ = 1/n); recorded in the run record as "
        "privacy.delta_opt_in")

    @field_validator("target_epsilon", "dataset_epsilon_cap")
    @classmethod
    def _positive_eps(cls, v):
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v}: a non-private run is a method of its own "
                             "(e.g. prompt_sgd), not ε = inf")
        if not v > 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("target_delta")
    @classmethod
    def _delta_range(cls, v):
        if v is not None and not (0 < v < 1):
            raise ValueError(f"must lie in (0, 1), got {v}")
        return v

    @field_validator("allow_delta_at_least_one_over_n")
    @classmethod
    def _opt_in_names_its_delta(cls, v, info):
        if v and "target_delta" in info.data and info.data["target_delta"] is None:
            raise ValueError("true needs an explicit privacy.target_delta (the default δ is never ≥ 1/n): write "
                             "the δ you accept, or remove the opt-in")
        return v


class PublicDataConfig(Block):
    """Public (non-private) text for distillation, prompt transfer and comparisons: never the
    private data (refused when it is, or overlaps, the private source)."""

    name: str = Field(description="dataset folder under the data root, e.g. tweet_sentiment")
    path: str | None = None
    split: str = "validation"
    text_field: str = "text"
    size: int | None = Field(None, gt=0)


class MiaConfig(Block):
    enabled: bool = True
    max_examples: int = Field(1000, gt=0, description="members and non-members scored, each: at most the "
                              "released data.n_train / data.n_holdout, never the exact sizes (a split with fewer "
                              "rows than its released size is scored with copies of its rows)")


class DPICLConfig(Block):
    """DP-ICL (Wu et al., ICLR 2024) served by `privprompt predict --dp-icl CONFIG`: every query is answered
    by a DP vote of in-context prompts from disjoint private subsets of the training split, and every
    answered batch is charged to the ledger (inference-time spend; tasks/dp_icl.py)."""

    subsets: int = Field(10, ge=2, description="M: disjoint private subsets voting on every query")
    shots: int = Field(4, ge=1, description="N: at most this many demonstrations in each subset's prompt")
    noise_multiplier: float | None = Field(None, gt=0, description="σ of each vote (relative to its L2 sensitivity "
                                           "√2); null: calibrated so that `expected_queries` answered queries spend "
                                           "privacy.target_epsilon")
    expected_queries: int = Field(1000, ge=1, description="queries the team expects to answer: what `plan` prices "
                                  "and what σ is calibrated for when noise_multiplier is null")
    instruction: str = Field("", description="a public instruction above the demonstrations")
    template: str = Field("Input: {text}\n\nOutput:", description="each demonstration and the query ({text} once)")
    sampling: Literal["partition", "poisson"] = Field(
        "partition", description="partition: one fixed secret keyed partition into the M subsets, every query; "
        "poisson: the paper's amplification — a fresh Poisson sample per query at rate q = subsets·shots / the "
        "released training size, each sampled row in a random subset (a query spends PoissonSampled(q, Gaussian))")
    compare_queries: int = Field(
        100, ge=0, description="before the first query is served, H private HOLDOUT rows (never demonstrations) are "
        "answered by the vote — charged as H answered queries — and compared with zero-shot (no demonstration): "
        "D = Σ (vote right − zero-shot right), released once with Gaussian noise at fallback.epsilon_share of "
        "privacy.target_epsilon (a record moves D by ≤ 2). When D̃ < 0 and fallback.enabled, queries are answered "
        "zero-shot, nothing charged. Kept per dataset and settings in the state folder; σ is calibrated for "
        "expected_queries plus these. 0 (or fallback.epsilon_share 0): no comparison, a warning with every answer")

    @field_validator("template")
    @classmethod
    def _one_text(cls, v):
        if v.count("{text}") != 1:
            raise ValueError(f"must contain {{text}} exactly once, got {v!r}")
        return v


class DaskConfig(Block):
    address: str | None = Field(None, description="scheduler of an existing Dask cluster (default: local)")
    n_workers: int = Field(2, gt=0)
    threads_per_worker: int = Field(1, gt=0)
    devices: list[str] | None = Field(None, description="a local cluster's worker i runs on devices[i mod len] "
                                      "(e.g. [cuda:0, cuda:1]); null: one visible GPU per worker in turn, the CPU "
                                      "where there is none (tasks/dask_devices.py). Not used with `address`")


class AuditConfig(Block):
    enabled: bool = False
    shadows: int = Field(8, ge=2, description="shadow prompts for LiRA (each example in half of them)")
    attacks: list[str] = Field(default_factory=default_attacks, description="membership attacks on the audit "
                               "pool, by the names they are registered under (tasks/attacks/: one module each)")
    pool_size: int | None = Field(None, gt=3, description="audit pool (members + non-members); at most twice "
                                  "the smaller released size (data.n_train without its canaries, data.n_holdout), "
                                  "never the exact sizes (copies of rows where a split holds fewer)")
    fprs: list[float] = Field(default_factory=lambda: [0.01, 0.001])
    min_k: float = Field(0.2, gt=0, le=1)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    dask: DaskConfig = Field(default_factory=DaskConfig)

    @field_validator("fprs")
    @classmethod
    def _fprs(cls, v):
        if not v or any(not (0 < f < 1) for f in v):
            raise ValueError(f"every FPR must lie in (0, 1), got {v}")
        return v

    @field_validator("attacks")
    @classmethod
    def _registered(cls, v):
        known = registered_attacks()
        for name in v:
            if name not in known:
                raise ValueError(unknown_attack_message(name))
        return v

    @field_validator("shadows")
    @classmethod
    def _even(cls, v):
        if v % 2:
            raise ValueError(f"must be even (each example is in exactly half of the shadows), got {v}")
        return v


class PromptTuningConfig(Block):
    """Soft-prompt training settings shared by the soft-prompt methods."""

    enabled: bool = Field(False, description="run as a baseline beside the published method")
    n_tokens: int = Field(10, gt=0)
    lr: float = Field(0.05, gt=0)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(32, gt=0, description="(expected) batch size")
    init: str | None = Field(None, description="words to initialise the prompt from")


class DPSGDConfig(PromptTuningConfig):
    """DP-SGD soft-prompt training: the clipping norm is the mechanism's, so it lives here."""

    max_grad_norm: float = Field(1.0, gt=0, description="per-example clipping norm C (noise std σ·C)")


class FallbackConfig(Block):
    """Never worse than nothing (issue 41): every dp run (but those whose own mechanism already chooses
    against no prompt: a private selection, DP-OPT) compares its output with no prompt on the private
    HOLDOUT through one released, accounted number: D = Σ over holdout records of (right with the
    prompt − right without), plus Gaussian noise (one record, or one person whose n rows weigh 1/n
    each, moves D by ≤ 1). Its ε is ``epsilon_share`` of privacy.target_epsilon, taken out of the run's
    budget (`privprompt plan` shows it); the method gets the rest. The decision is post-processing."""

    enabled: bool = Field(True, description="when the released difference D̃ is below 0 (the prompt loses to no "
                          "prompt), publish no prompt: no prompt file, no registered model; the run summary, MLflow "
                          "(tag result.fallback_to_no_prompt) and the report say so. false: publish the prompt and "
                          "warn in the same three places. Either way the comparison's ε is spent and committed")
    epsilon_share: float = Field(0.1, ge=0.0, lt=0.5, description="the share of privacy.target_epsilon spent on the "
                                 "comparison (at a tenth of the run's δ); 0: no comparison and no fallback, the whole "
                                 "budget to the method. A larger share buys less noise: the run says 'inconclusive' "
                                 "when |D̃| is within 1.96 σ of 0 (a small holdout)")


class SelectionConfig(Block):
    """Private selection of the published method's settings (issue 30): candidates (the method's
    grid, or random draws from ranges) plus "no prompt", each trial trained on the training split
    and scored with noise on the private HOLDOUT; one winner published. The whole procedure is one
    DP mechanism (every candidate once, composed; or Papernot & Steinke's random number of trials:
    ``privacy/selection.py``) whose ε is privacy.target_epsilon; every trial's training is
    calibrated so that the selection meets it."""

    enabled: bool = Field(False, description="select the published method's settings privately on the holdout "
                          "(needs a dp method; data.holdout_fraction sets the holdout)")
    candidates: list[dict[str, Any]] = Field(
        default_factory=list, description="settings to choose from, each a mapping of keys of methods.<method> "
        "(dotted for nested blocks, e.g. tuning.lr) to values; default: the method's own grid. The \"no prompt\" "
        "candidate is always added")
    ranges: dict[str, list[float]] = Field(
        default_factory=dict, description="instead of candidates: key of methods.<method> -> [low, high]; `draws` "
        "candidates drawn at random (log-uniform for positive floats, uniform for integers) from the config's seed "
        "(public: they depend on no data)")
    draws: int = Field(0, ge=0, description="candidates drawn from `ranges`")
    mode: Literal["every_candidate", "random_stopping"] = Field(
        "every_candidate", description="every_candidate: train and score each candidate once, the trainings "
        "composed (cheaper and exact for small grids, e.g. a method's own grid; every candidate's noisy score is "
        "published); random_stopping: a secret random number of trials K, each a candidate drawn at random "
        "(Papernot & Steinke; pays off for large grids or draws: its cost does not grow with the number of "
        "candidates). `privprompt plan` shows the ε of both")
    metric: Literal["balanced_accuracy", "accuracy"] = Field(
        "balanced_accuracy", description="the holdout score that ranks the candidates: balanced_accuracy (the mean "
        "over classes of each class's accuracy: a prompt that always says the majority class scores 1/classes, "
        "whatever the holdout's class mix) or accuracy. Released from noisy counts (per class (right, wrong), or "
        "(right, wrong)): one holdout record is one count, sensitivity 1 either way; with data.privacy_unit naming a "
        "person, each person is one vote (each of their n holdout rows counts 1/n), sensitivity 1 per person")
    distribution: Literal["truncated_negative_binomial", "poisson"] = Field(
        "truncated_negative_binomial", description="random_stopping: law of the secret number of trials K "
        "(Papernot & Steinke): truncated negative binomial D_{eta,gamma} (eta = 1: geometric) or Poisson")
    eta: float = Field(1.0, gt=-1, description="random_stopping: eta of the truncated negative binomial (smaller: "
                       "cheaper in ε, more mass on K = 1)")
    expected_trials: float = Field(10.0, gt=1, description="random_stopping: E[K], the expected number of trials "
                                   "(each trains one candidate drawn uniformly at random)")
    score_noise_multiplier: float | None = Field(
        None, gt=0, description="σ (in records) of the Gaussian noise on each released holdout count (each "
        "candidate's, and random_stopping's no-prompt reference); default: every_candidate: the smallest σ at which "
        "the scores cost no more ε than the trainings (the holdout and the training rows are disjoint, so the "
        "mechanism costs the larger of the two: more noise buys no privacy); random_stopping: 5")
    accept_timing_channel: bool = Field(
        False, description="random_stopping: its ε assumes the number of trials K stays secret, but the run's "
        "duration grows with K and shows in the run timestamps of MLflow and Prefect (start and end of the run and "
        "of its tasks) to anyone who can read those servers; knowing K, the best of K trials can cost up to K "
        "trials composed. Refused unless true: set it only where those servers are as closed as the private side "
        "(the run is tagged selection.timing_channel). every_candidate has no such channel (its number of "
        "trainings is public)")
    fallback_to_no_prompt: bool = Field(True, description="random_stopping: publish no prompt when the best trial's "
                                        "released holdout score is below the released no-prompt reference "
                                        "(post-processing: no extra ε); false: publish the best trial and warn. "
                                        "every_candidate scores no prompt as one of the candidates")

    @field_validator("ranges")
    @classmethod
    def _ranges(cls, v):
        for key, bounds in v.items():
            if len(bounds) != 2 or not all(math.isfinite(b) for b in bounds) or not bounds[0] < bounds[1]:
                raise ValueError(f"ranges.{key} must be [low, high] with low < high, got {bounds!r}")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        if self.candidates and self.ranges:
            raise ValueError("give candidates or ranges, not both")
        if bool(self.ranges) != bool(self.draws):
            raise ValueError("ranges and draws go together: draws candidates from ranges "
                             f"(ranges: {sorted(self.ranges)}, draws: {self.draws})")
        return self
