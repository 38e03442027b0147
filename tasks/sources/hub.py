"""A Hugging Face hub dataset, named by the config (``data.hub``, ``data.hub_config``,
``data.hub_revision``); class-label integers become their names."""

from __future__ import annotations

from ..errors import DataError
from . import DataSource, register_source


@register_source
class HubDataset(DataSource):
    name = "hub"

    def named_by(self, cfg):
        return bool(cfg.hub)

    def describe(self, cfg, split):
        return f"hub dataset {cfg.hub}:{split}"

    def signature(self, cfg):
        return f"hub:{cfg.hub}:{cfg.hub_config}"

    def read_split(self, cfg, split):
        try:
            import datasets  # heavy; only for hub datasets
            ds = datasets.load_dataset(cfg.hub, cfg.hub_config, split=split, revision=cfg.hub_revision)
        except Exception as err:  # noqa: BLE001 - any loading failure is reported the same way
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"cannot load hub dataset {cfg.hub!r} split {split!r}: {first}") from None
        names = getattr(ds.features.get(cfg.label_field), "names", None)
        rows = []
        for row in ds:
            label = row.get(cfg.label_field)
            if names is not None and isinstance(label, int):
                label = names[label]
            item = {cfg.text_field: row.get(cfg.text_field), cfg.label_field: label}
            if cfg.unit_field is not None and cfg.unit_field in row:
                item[cfg.unit_field] = row[cfg.unit_field]
            rows.append(item)
        return rows
