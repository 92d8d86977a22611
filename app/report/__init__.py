"""The run-comparison report as a library: `build_report(uri, group=...)` or `render_report(histories, ...)`
gives a `Report` with `.html` (self-contained), `.markdown` and `.divergence`; `rldiag report` is its command."""

import importlib

_WHERE = {name: "rldiag.app.report.build" for name in ("Report", "build_report", "departure_lines", "render_report",
                                                    "resolve_runs")}


def __getattr__(name: str):
    """The library's names, imported on first use: `rldiag report --help` imports this package without them."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Report", "build_report", "departure_lines", "render_report", "resolve_runs"]
