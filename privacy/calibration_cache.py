"""Noise calibrations kept on disk between runs (issue 29: a smoke run spent ~8 s of its ~10 s of
orchestration re-deriving the same σ every time).

``calibrate_noise_multiplier(ε, δ, q, steps, tolerance)`` is a pure function of its numbers and of
the accountant's code, so its answer is stored in one JSON file under the state folder
(``$PRIVPROMPT_ACCOUNTING_CACHE``, set by the CLI and the flows) keyed by those numbers and by a hash
of the accounting code (``privacy/{accountant,accountants,calibrate,rdp,pld,events,validation}.py`` and dp-accounting's
version): any change to that code starts an empty cache. Only σ is cached; every ε a run reserves,
commits or reports is still computed by the accountant from the event, so a cached σ can never
make a claim — at worst a wrong σ would be refused by the ledger's reservation check.
The numbers are public config values (and n_train through q, which the run record logs)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

ENV = "PRIVPROMPT_ACCOUNTING_CACHE"
_CODE = ("accountant.py", "accountants.py", "calibrate.py", "rdp.py", "pld.py", "events.py", "validation.py")


def enable(state_root: str | Path) -> None:
    """Use ``<state_root>/cache/accounting.json`` unless ``$PRIVPROMPT_ACCOUNTING_CACHE`` says otherwise."""
    os.environ.setdefault(ENV, str(Path(state_root) / "cache" / "accounting.json"))


@functools.lru_cache(maxsize=1)
def code_key() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _CODE:
        path = here / name
        h.update(name.encode() + b"\x1f" + (path.read_bytes() if path.is_file() else b"") + b"\x1e")
    try:
        from importlib.metadata import version

        h.update(version("dp-accounting").encode())
    except Exception:  # noqa: BLE001 - not installed as a distribution: the code hash alone
        pass
    return h.hexdigest()[:24]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("code") == code_key() else {}


def cached(kind: str, compute: Callable[..., float], *args) -> float:
    """``compute(*args)``, through the disk cache when ``$PRIVPROMPT_ACCOUNTING_CACHE`` is set.
    A cache that cannot be read or written is skipped (it only saves time)."""
    target = os.environ.get(ENV)
    if not target:
        return compute(*args)
    path = Path(target)
    key = f"{kind}:{json.dumps(args)}"
    hit = _read(path).get("values", {}).get(key)
    if isinstance(hit, float):
        return hit
    value = compute(*args)
    try:
        data = _read(path) or {"code": code_key(), "values": {}}
        data["values"][key] = float(value)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".accounting-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass
    return value
