"""Benchmark code that tests run or check: the benchmarks use it, so it stays in `bench/`; the tests
import it from here only (servers: `tests.helpers.net`; divergence scenarios: `tests.helpers.divergence`)."""

from __future__ import annotations

from bench._common import metric_store
from bench.journal_scale import ENVELOPE, SEGMENT, child_outage
from bench.run_all import splice_readme
from bench.team_load import run_load

__all__ = ["ENVELOPE", "SEGMENT", "child_outage", "metric_store", "run_load", "splice_readme"]
