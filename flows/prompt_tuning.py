"""The prompt-tuning flow: the one method flow under its historical name (``prefect.yaml``
deployments name ``flows/prompt_tuning.py:prompt_tuning_flow``)."""

from flows.method_flow import method_flow, partition as _partition  # noqa: F401

prompt_tuning_flow = method_flow
