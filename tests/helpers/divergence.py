"""The synthetic traces and RL-like scenarios the detector's tests and benchmarks share. The benchmarks run
them, so they stay in `bench/` (divergence_data, divergence_rl, divergence_length); the tests import them
from here only. `divergence_rl` is the module itself (a test patches its length `T`)."""

from __future__ import annotations

from bench import divergence_rl
from bench.divergence_data import ONSET, T, refs, seed_run, trace
from bench.divergence_length import scenario as length_scenario
from bench.divergence_rl import NO_CHANGE, every, make_set, scenario

__all__ = ["NO_CHANGE", "ONSET", "T", "divergence_rl", "every", "length_scenario", "make_set", "refs", "scenario",
           "seed_run", "trace"]
