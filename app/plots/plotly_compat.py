"""plotly internals the figures rely on, checked against the installed plotly by tests/app/plots/test_figures.py."""

from __future__ import annotations

from typing import Any


def figure_from_dicts(data: list[dict], layout: dict[str, Any]):
    """A `go.Figure` from plain trace and layout dicts, without plotly's per-property validation
    (`_validate=False`: 10-40x faster, the same JSON as the validated figure)."""
    import plotly.graph_objects as go

    return go.Figure(data=data, layout=layout, _validate=False)
