"""The run-comparison report as a library: `build_report(uri, group=...)` or `render_report(histories, ...)`
gives a `Report` with `.html` (self-contained), `.markdown` and `.divergence`; `rldiag report` is its command."""

from rldiag.app.report.build import (
    Report,
    build_report,
    departure_lines,
    render_report,
    resolve_runs,
)

__all__ = ["Report", "build_report", "departure_lines", "render_report", "resolve_runs"]
