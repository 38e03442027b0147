"""Every check of a config that needs no private data (models, tokenizers, label words, templates,
placements, endpoints), run by ``privprompt plan`` and by a run alike before any budget is reserved,
so a config mistake fails in one line and spends nothing."""

from __future__ import annotations

from .selected import method_for


def check_endpoint(endpoint, timeout_s: float = 10.0) -> None:
    """The endpoint answers HTTP at all (GET <base_url>/models; nothing is sent)."""
    import urllib.error
    import urllib.request

    from models.prompts.endpoint import EndpointError

    url = endpoint.base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered (401, 404, …): reachable
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise EndpointError(f"models.endpoints[{endpoint.alias}]: {endpoint.base_url} is unreachable "
                            f"({type(err).__name__}: {reason})") from None


def check_placements(cfg) -> None:
    """``models.placement`` and each ``models.placement_for`` entry can apply on this machine's device
    (8-/4-bit and device_map need CUDA; 8-/4-bit need bitsandbytes): refused in one line before any model
    is loaded or any budget reserved."""
    from models.backbones import ModelLoadError
    from models.device import default_device
    from models.placement import PlacementError, check_placement

    device = default_device()
    blocks = [("models.placement", cfg.models.placement),
              *((f"models.placement_for[{name!r}]", block) for name, block in cfg.models.placement_for.items())]
    for where, block in blocks:
        try:
            check_placement(block.placement(), device)
        except PlacementError as e:
            raise ModelLoadError(f"{where}: {e}") from None


def preflight(cfg, prepared: dict[str, dict] | None = None) -> None:
    """Every check of ``cfg`` that needs no private data, raising a one-line user error: each run
    method's own (``Mechanism.preflight``: models, tokenizers, label words / descriptions,
    templates), the evaluation models', and the endpoints' reachability. ``prepared``: method →
    what its ``prepare`` returned (None in ``privprompt plan``). A run calls it before it reserves
    any budget; ``privprompt plan`` calls the same function."""
    from .methods.base import check_classifier, settings_of
    from .stages import evaluation_models

    check_placements(cfg)
    methods = {name: method_for(cfg, name) for name in cfg.run_methods}
    for name, method in methods.items():  # a selected method checks every candidate's settings too
        method.mechanism.preflight(cfg, None if prepared is None else prepared.get(name))
    published = methods[cfg.method]  # its soft prompt's or prefix's positions, on every model that scores it
    positions = (getattr(settings_of(cfg, published), "n_tokens", 0) or 0) if published.prompt_kind in ("soft", "prefix") else 0
    if any(m.extras.evaluate_published is None for m in methods.values()):
        for role, model_name in evaluation_models(cfg).items():
            check_classifier(cfg, model_name, f"models.{role}" if role == "local" else "models.target", positions)
    for model_name in cfg.models.evaluate_on:
        check_classifier(cfg, model_name, "models.evaluate_on", positions)
    for endpoint in cfg.models.endpoints:
        check_endpoint(endpoint)
