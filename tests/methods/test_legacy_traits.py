"""A method written against the interface before ``Method.traits`` (the traits as class attributes)
keeps working for one release: its attributes are read into ``traits``, with a DeprecationWarning."""

import pytest

from tasks.methods import Method
from types import SimpleNamespace

from tasks.methods.base import Traits


def test_class_attribute_traits_are_read_into_traits_with_a_warning():
    with pytest.warns(DeprecationWarning, match="neighbour_statistics, stage_names, unit_level, uses_validation"):
        class Legacy(Method):
            name = "legacy_traits_probe"
            uses_validation = True
            unit_level = True
            neighbour_statistics = ["clipped_gradient_sum"]
            stage_names = {"train": "tune"}

    assert Legacy.traits == Traits(uses_validation=True, unit_level=True, neighbour_statistics=("clipped_gradient_sum",),
                                   stage_names=(("train", "tune"),))
    assert Method.traits == Traits()  # the base class's traits are not changed by a subclass


def test_a_subclass_keeps_its_parents_traits_and_overrides_one():
    class Parent(Method):
        name = "traits_parent_probe"
        traits = Traits(unit_level=True, neighbour_statistics=("clipped_gradient_sum",))

    with pytest.warns(DeprecationWarning, match="supports_loss_mia"):
        class Child(Parent):
            name = "traits_child_probe"
            supports_loss_mia = False

    assert Child.traits == Traits(unit_level=True, neighbour_statistics=("clipped_gradient_sum",),
                                  supports_loss_mia=False)
    assert Parent.traits.supports_loss_mia


def test_a_selection_has_the_methods_traits_with_its_own_release():
    from tasks.methods import get_method
    from tasks.selected import Selection, selected

    method = get_method("dpzero")
    spec = selected(method)
    assert isinstance(spec.mechanism, Selection) and spec.mechanism.spec is spec and spec.name == method.name
    assert method.mechanism.spec is method  # the method's own mechanism stays bound to its own spec
    traits = spec.traits
    assert (traits.always_dp, traits.release, traits.compares_with_no_prompt, traits.uses_validation) == (
        True, "selection", True, True)
    assert (traits.unit_level, traits.neighbour_statistics) == (method.traits.unit_level,
                                                                 method.traits.neighbour_statistics)


def test_report_and_settings_members_of_the_old_interface_are_read_into_traits_and_report():
    from tasks.methods.base import Report, ReportMetric, run_label

    metric = ReportMetric("legacy_score", ("legacy.score",))
    with pytest.warns(DeprecationWarning, match="contract_test_config, ldp_level, report_metrics, run_label, selection_grid"):
        class Legacy(Method):
            name = "legacy_report_probe"

            @classmethod
            def contract_test_config(cls):
                return {"n_tokens": 2}

            def selection_grid(self, cfg):
                return [{"lr": 0.1}, {"lr": 0.2}]

            def report_metrics(self):
                return (metric,)

            def run_label(self, cfg):
                return f"{self.name}[{cfg}]"

            def ldp_level(self, params):
                return float(params["eta"])

    assert Legacy.traits.test_settings == {"n_tokens": 2}
    assert Legacy.traits.selection_grid == ({"lr": 0.1}, {"lr": 0.2})
    assert Legacy.report.metrics == (metric,) and Legacy.report.sections == ()
    assert run_label(Legacy(), "x") == "legacy_report_probe[x]" and Legacy.report.ldp_level({"eta": "3"}) == 3.0
    assert Method.report == Report()


def test_a_method_defining_its_own_default_delta_is_refused():
    with pytest.raises(TypeError, match="default_delta .from .*Legacy. is no longer read"):
        class Legacy(Method):
            name = "legacy_delta_probe"

            def default_delta(self, n_train):
                return 1.0 / n_train


def test_an_old_style_parent_is_read_for_each_subclass_under_its_own_name():
    from tasks.methods.base import run_label

    with pytest.warns(DeprecationWarning):
        class Base(Method):  # an intermediate base: no name, read when a subclass is
            def run_label(self, cfg):
                return f"{self.name}:{cfg}"

            def report_metrics(self):
                from tasks.methods.base import ReportMetric

                return (ReportMetric(self.name, (f"{self.name}.score",)),)

    with pytest.warns(DeprecationWarning):
        class Parent(Base):
            name = "legacy_parent_probe"
    with pytest.warns(DeprecationWarning):
        class Child(Parent):
            name = "legacy_child_probe"

    assert run_label(Parent(), "x") == "legacy_parent_probe:x" and run_label(Child(), "x") == "legacy_child_probe:x"
    assert [m.key for m in Child.report.metrics] == ["legacy_child_probe"]


def test_a_default_delta_from_a_mixin_is_refused_too():
    class Mixin:
        def default_delta(self, n_train):
            return 1.0 / n_train

    with pytest.raises(TypeError, match="default_delta .from .*Mixin. is no longer read"):
        class Legacy(Mixin, Method):
            name = "legacy_mixin_delta_probe"


def test_an_old_member_that_needs_a_config_is_refused_with_one_line():
    with pytest.raises(TypeError, match="selection_grid cannot be read without a config"), \
            pytest.warns(DeprecationWarning):
        class Legacy(Method):
            name = "legacy_grid_probe"

            def selection_grid(self, cfg):
                return [{"lr": cfg.methods.x.lr}]


def test_reads_private_data_of_the_old_interface_is_read_into_the_traits():
    with pytest.warns(DeprecationWarning, match="reads_private_data"):
        class Legacy(Method):
            name = "legacy_reads_probe"

            def reads_private_data(self, cfg):
                return False

    assert Legacy.traits.reads_private is False and Method.traits.reads_private is True


def test_a_subclass_declaring_report_and_traits_keeps_them_over_its_old_style_parent():
    from tasks.methods.base import Report

    with pytest.warns(DeprecationWarning):
        class Old(Method):
            name = "legacy_old_parent_probe"

            def ldp_level(self, params):
                return 1.0

            def selection_grid(self, cfg):
                return [{"lr": 1}]

    class New(Old):
        name = "legacy_new_child_probe"
        report = Report(ldp_level=None)
        traits = Traits(selection_grid=({"lr": 2},))

    assert New.report.ldp_level is None and New.traits.selection_grid == ({"lr": 2},)
    assert Old.report.ldp_level({}) == 1.0 and Old.traits.selection_grid == ({"lr": 1},)


def test_a_second_module_cannot_take_a_built_in_name_with_the_same_mechanism_class():
    """A name belongs to the module that registered it: another spec under ``prompt_sgd`` — even on
    the toolkit's own mechanism class, with traits saying it reads nothing private — is refused."""
    import pytest

    from tasks.methodkit.prompt_methods import NonPrivateSoftPrompt
    from tasks.methods import MethodSpec, get_method, register_method
    from tasks.schema import PromptTuningConfig

    before = get_method("prompt_sgd")
    with pytest.raises(ValueError, match="already registered"):
        register_method(MethodSpec(name="prompt_sgd", config_class=PromptTuningConfig, mechanism=NonPrivateSoftPrompt(),
                                   traits=Traits(reads_private=False)))
    assert get_method("prompt_sgd") is before


def test_an_old_style_method_keeps_the_extras_defaults_and_a_toolkit_subclass_is_told_what_to_do():
    import pytest

    from tasks.methodkit.prompt_methods import SoftPromptDPSGD
    from tasks.methods import spec_from_class
    from tasks.schema import DPSGDConfig

    class Legacy(Method):
        name, config_class = "legacy_extras", DPSGDConfig

        def published_model(self, cfg, prepared):
            return "target:" + self.source_model(cfg, prepared)  # the old default, called from an override

    cfg = SimpleNamespace(models=SimpleNamespace(local="local-model"))
    spec = spec_from_class(Legacy)
    assert spec.extras.published_model(cfg, {}) == "target:local-model"
    assert spec.extras.source_model(cfg, {}) == "local-model" and spec.extras.evaluate_published is None

    class Skeleton(SoftPromptDPSGD):
        name, config_class = "legacy_skeleton", DPSGDConfig

    with pytest.raises(TypeError, match="register a MethodSpec"):
        spec_from_class(Skeleton)


def test_a_spec_derived_with_other_checks_needs_its_own_mechanism():
    import dataclasses

    import pytest

    from tasks.methods import get_method

    spec = get_method("prompt_dpsgd")
    with pytest.raises(ValueError, match="needs its own mechanism"):
        dataclasses.replace(spec, prompt_kind="prefix")
    assert dataclasses.replace(spec, label="x").mechanism.spec is spec  # the binding stays the registered spec's
