"""Zero-shot: the model with no prompt. Reads no private training data; evaluated like any method."""

from __future__ import annotations

from pydantic import Field

from ...schema import Block
from .. import register_method
from ..base import Extras, Mechanism, MethodPlan, MethodSpec, ReferenceAccuracy, Report, ReportMetric, Trained, Traits


class ZeroShotConfig(Block):
    enabled: bool = Field(False, description="evaluate the model without a prompt beside the published method")


def target_model(cfg, prepared) -> str:
    return cfg.models.target_name


class ZeroShot(Mechanism):
    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        return MethodPlan(self.spec.name, "none", n_train, delta,
                          note="no training: nothing learnt from private data")

    def train(self, mctx, plan, rows, progress=None):
        return Trained(prompt=None, event=None)


ZERO_SHOT = register_method(MethodSpec(
    name="zero_shot", config_class=ZeroShotConfig, mechanism=ZeroShot(), prompt_kind="none", label="zero-shot",
    traits=Traits(reads_private=False),
    # the zero-shot baseline on each run's own test split (the report's zero-shot column and line): the
    # runs it ran beside log it as test.accuracy.zero_shot; a zero-shot run's own is its accuracy
    report=Report(metrics=(ReportMetric("zero_shot", ("test.accuracy.zero_shot",), every_run=True),
                           ReportMetric("zero_shot", ("test.accuracy",))),
                  sections=(ReferenceAccuracy("zero_shot", "zero-shot"),)),
    extras=Extras(published_model=target_model)))
