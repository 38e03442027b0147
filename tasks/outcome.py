"""What one method's pass through the door produced (a Prefect task result)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunOutcome:
    """What one method's pass through the lifecycle produced: paths and numbers, no tensor (a
    Prefect task result: plain fields, so it pickles into result storage).

    ``guarantee``: the plan's (``dp`` | ``ldp`` | ``none``); ``prompt_path``: the output after
    post-processing (``outputs/`` when ``published``, else ``private/``; None when the method
    makes no prompt); ``source_prompt_path``: the prompt as trained (the same file without
    post-processing); ``spend`` / ``event``: the committed (ε, δ) and event (dp only);
    ``compute``: seconds of model work per stage (``train``, ``post_process``);
    ``train_metrics``: the training's metrics as logged on its child run (audit statistics
    included), ``audit_metrics``: those of them that are audit statistics of private data;
    ``republished``: a retry that republished the stored DP output; ``reserved_new``: whether
    this call made the run's reservation (None: no reservation)."""

    method: str
    guarantee: str
    private: bool
    params: dict = field(default_factory=dict)
    steps: int = 0
    compute: dict = field(default_factory=dict)
    prompt_path: str | None = None
    source_prompt_path: str | None = None
    spend: dict | None = None
    event: dict | None = None
    republished: bool = False
    reserved_new: bool | None = None
    train_metrics: dict = field(default_factory=dict)
    audit_metrics: dict = field(default_factory=dict)
    published: bool = False
    registered_model: str | None = None  # models:/NAME/VERSION of the published output, when registered

    @property
    def epsilon(self) -> float | None:
        """The committed ε (None: no dp spend)."""
        return (self.spend or {}).get("epsilon")
