"""Records: a list of plain rows that turns into a pandas DataFrame on request."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from packbench.core.errors import PackbenchError


def as_dict(row: Any) -> dict[str, Any]:
    """A row (frozen dataclass, NamedTuple or mapping) as a plain dict of its fields."""
    if dataclasses.is_dataclass(row):
        return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    if hasattr(row, "_asdict"):
        return dict(row._asdict())
    if isinstance(row, Mapping):
        return dict(row)
    raise TypeError(f"not a row: {type(row).__name__}")


class Records(list):
    """The rows a `Client` or `Archive` lists: an ordinary list of immutable records, plus
    `frame()`. `context` holds, per row, columns that lead the frame (screen id, attempt
    number, protocol) where the record itself does not carry them."""

    def __init__(self, rows: Iterable[Any] = (), *, context: list[dict[str, Any]] | None = None) -> None:
        super().__init__(rows)
        self.context = context if context is not None else [{} for _ in self]
        if len(self.context) != len(self):
            raise ValueError("one context mapping per row")

    def dicts(self) -> list[dict[str, Any]]:
        """Each row as a plain dict, its context columns first."""
        return [{**ctx, **as_dict(row)} for ctx, row in zip(self.context, self)]

    def frame(self):
        """The rows as a pandas DataFrame, one column per field (pandas: `pip install 'packbench[api]'`)."""
        try:
            import pandas as pd
        except ImportError:
            raise PackbenchError("Records.frame() needs pandas, which is not installed: "
                                 "pip install 'packbench[api]' (or pip install pandas)") from None
        rows = self.dicts()
        if rows:
            return pd.DataFrame.from_records(rows)
        return pd.DataFrame()
