"""The synthetic traces and RL-like scenarios the detector's tests and benchmarks share. The benchmarks run
them, so they stay in `bench/` (divergence_data, divergence_rl, divergence_length); the tests import them
from here only. `divergence_rl` is the module itself (a test patches its length `T`)."""

from __future__ import annotations

from bench import _common as bench_common
from bench import divergence_rl
from bench.divergence_data import ONSET, T, refs, seed_run, trace
from bench.divergence_length import HELD_OUT_SEEDS
from bench.divergence_length import main as length_main
from bench.divergence_length import scenario as length_scenario
from bench.divergence_rl import NO_CHANGE, every, make_set, scenario

__all__ = ["HELD_OUT_SEEDS", "NO_CHANGE", "ONSET", "T", "bench_common", "divergence_rl", "every", "length_main",
           "length_scenario", "make_set", "refs", "scenario", "seed_run", "trace"]
