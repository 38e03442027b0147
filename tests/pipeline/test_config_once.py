"""The config is parsed once per flow and its schema never changes at run time: a method
registered late is validated against its own block when a config is parsed (no rebuild), and a
flow parses its config once and hands the parsed, frozen object to every task."""

from contextlib import contextmanager

import pytest
from pydantic import Field
from tests.pipeline.test_flow import _config, _toy_dataset

TOY = "toy_late_block"


@contextmanager
def late_method():
    """A method registered by the test, after the config schema was imported and compiled."""
    from pydantic import field_validator
    from pydantic_core import PydanticCustomError

    from tasks.methods import register_method, unregister_method
    from tasks.methods import Method
    from tasks.methods.base import MethodPlan, Traits
    from tasks.schema import Block

    class LateConfig(Block):
        enabled: bool = False
        steps: int = Field(3, gt=0)
        scale: float = 1.0

        @field_validator("scale")
        @classmethod
        def _small(cls, v):
            if v > 10:
                raise PydanticCustomError("toy_scale", "scale {scale} is over 10", {"scale": v})
            return v

    class LateMethod(Method):
        name = TOY
        config_class = LateConfig

        def guarantee(self, cfg):
            return "none"

        traits = Traits(reads_private=False)

        def plan(self, cfg, n_train, delta, epsilon=None):
            return MethodPlan(self.name, "none", n_train, delta, reads_private=False)

    register_method(LateMethod)
    try:
        yield LateConfig
    finally:
        unregister_method(TOY)


def _raw(**methods) -> dict:
    return {"data": {"name": "sst2", "labels": ["negative", "positive"]}, "models": {"local": "tiny-gpt2"},
            "methods": methods}


def test_a_method_registered_late_is_validated_without_a_schema_rebuild():
    from tasks.config import MethodsConfig, PrivPromptConfig, config_to_yaml, parse_config
    from tasks.config_reference import all_keys
    from tasks.errors import ConfigError

    fields, methods_field = PrivPromptConfig.model_fields, PrivPromptConfig.model_fields["methods"]
    validator, methods_validator = PrivPromptConfig.__pydantic_validator__, MethodsConfig.__pydantic_validator__
    with pytest.raises(ConfigError, match=rf"^invalid config: methods\.{TOY}: unknown config key"):
        parse_config(_raw(**{TOY: {"steps": 5}}))  # not registered yet
    before = parse_config(_raw(prompt_dpsgd={"n_tokens": 4}))

    with late_method() as block:  # registered now, after import
        cfg = parse_config(_raw(**{TOY: {"steps": 5, "scale": 0.5}}, prompt_dpsgd={"n_tokens": 4}))
        assert isinstance(getattr(cfg.methods, TOY), block) and getattr(cfg.methods, TOY).steps == 5
        assert cfg.model_dump(mode="json")["methods"][TOY] == {"enabled": False, "steps": 5, "scale": 0.5}
        # every other block as before, in the registry's order, the late one last; the YAML the run keeps too
        dumped = cfg.model_dump(mode="json")["methods"]
        assert list(dumped)[:-1] == list(before.model_dump(mode="json")["methods"]) and list(dumped)[-1] == TOY
        assert {k: v for k, v in dumped.items() if k != TOY} == before.model_dump(mode="json")["methods"]
        assert f"  {TOY}:\n    enabled: false\n    steps: 5\n" in config_to_yaml(cfg)
        assert getattr(parse_config(_raw()).methods, TOY).steps == 3  # defaults filled in
        # its errors are the same one-line errors as any block's, with the did-you-mean hints
        with pytest.raises(ConfigError, match=rf"^invalid config: methods\.{TOY}\.stepz: unknown config key "
                                              rf"\(did you mean 'methods\.{TOY}\.steps'\?\)$"):
            parse_config(_raw(**{TOY: {"stepz": 5}}))
        with pytest.raises(ConfigError, match=rf"^invalid config: methods\.{TOY}\.steps: Input should be greater "
                                              r"than 0; methods\.toy_late_blok: unknown config key \(did you mean "
                                              rf"'methods\.{TOY}'\?\)$"):
            parse_config(_raw(**{TOY: {"steps": 0}}, toy_late_blok={}))
        assert f"methods.{TOY}.scale" in all_keys()  # the reference lists it
    # the schema itself never changed: the same fields, the same compiled validators
    assert PrivPromptConfig.model_fields is fields and PrivPromptConfig.model_fields["methods"] is methods_field
    assert PrivPromptConfig.__pydantic_validator__ is validator
    assert MethodsConfig.__pydantic_validator__ is methods_validator and MethodsConfig.model_fields == {}
    with pytest.raises(ConfigError, match=rf"methods\.{TOY}: unknown config key"):  # unregistered again
        parse_config(_raw(**{TOY: {}}))


def test_a_method_blocks_own_validator_errors_read_as_before():
    """A block's own validators (a value error, a custom error type) read as before, one line,
    under ``methods.<name>``."""
    from tasks.config import parse_config
    from tasks.errors import ConfigError

    with late_method():
        with pytest.raises(ConfigError) as info:
            parse_config(_raw(dp_opt={"validation_size": 3}, **{TOY: {"scale": 11}}))
    line = str(info.value)
    assert line.startswith("invalid config: methods.dp_opt: Value error, validation_size was removed") and "\n" not in line
    assert line.endswith(f"; methods.{TOY}.scale: scale 11.0 is over 10")


def _counting(monkeypatch):
    """Counts every validation of a whole config (``PrivPromptConfig.model_validate``, and every
    validation of its ``methods:`` block, whatever path it takes: nested, __init__, Prefect's)."""
    import tasks.config as config

    counts = {"model_validate": 0, "methods_block": 0}
    real_validate, real_blocks = config.PrivPromptConfig.model_validate.__func__, config.method_blocks

    def model_validate(cls, *args, **kwargs):
        counts["model_validate"] += 1
        return real_validate(cls, *args, **kwargs)

    def method_blocks():
        counts["methods_block"] += 1
        return real_blocks()

    monkeypatch.setattr(config.PrivPromptConfig, "model_validate", classmethod(model_validate))
    monkeypatch.setattr(config, "method_blocks", method_blocks)
    return counts


def _zero_shot(data, state, **extra) -> dict:
    raw = _config(data, state, **extra)
    raw["method"] = "zero_shot"
    raw["methods"] = {"zero_shot": {}}
    return raw


@pytest.mark.slow  # two small flows (zero-shot, no training): ~40 s
def test_a_flow_parses_its_config_once(prefect_harness, sst2_dir, tmp_path, monkeypatch):
    """A method flow parses its config once; a sweep parses its config once and each variant once
    (when it validates them up front), and its method flows parse nothing again."""
    from flows.method_flow import method_flow
    from flows.sweep import sweep_flow

    data = _toy_dataset(tmp_path / "data", sst2_dir, n_train=60, n_test=20)
    counts = _counting(monkeypatch)
    summary = method_flow(_zero_shot(data, tmp_path / "state"))
    assert summary["metrics"]["test.accuracy"] >= 0
    assert counts == {"model_validate": 1, "methods_block": 1}

    counts.update(model_validate=0, methods_block=0)
    out = sweep_flow(_zero_shot(data, tmp_path / "state2", seeds=[1, 2]))
    assert [r["seed"] for r in out["variants"]] == [1, 2]
    assert counts == {"model_validate": 3, "methods_block": 3}  # the sweep's config, then its two variants


def test_the_audit_flow_hands_its_parsed_configs_to_its_tasks(tmp_path):
    """The audit's tasks read the target from its private file with the config the flow parsed."""
    import json

    from flows.audit import read_target
    from tasks.audit import AuditTarget
    from tasks.config import parse_config

    cfg = parse_config(_config(tmp_path / "data", tmp_path / "state"))
    target = AuditTarget(config=cfg.model_dump(mode="json"), partition={}, prompt_path="p", method="prompt_dpsgd",
                         epsilon=1.0, delta=1e-5, run_id="r", flow_run_id="f", state_dir=str(tmp_path / "state"))
    path = tmp_path / "target.json"
    path.write_text(json.dumps(target.to_dict()))
    assert read_target(str(path), cfg).cfg is cfg
    read = read_target(str(path))
    assert read.cfg is read.cfg and read.cfg == cfg  # parsed once, on first use
    assert "cfg" not in read.to_dict()  # the file and the flow parameters keep the config's JSON only
