"""What the session's engine-parity store holds (the `parity_store` fixture, tests/experiments/conftest.py):
every variant's runs read back once (tags, params, full metric histories)."""

from __future__ import annotations

from dataclasses import dataclass

PARITY_STEPS = 20  # step 0: same weights on both sides; steps 1-19: after weight updates
PARITY_SEEDS = 3  # reference seeds (the noise band); every candidate runs seed 0


@dataclass
class StoredRun:
    run_id: str
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, list[float]]  # key -> value per step 0..PARITY_STEPS-1, from the full history

    def at(self, key: str, step: int) -> float:
        return self.metrics[key][step]


@dataclass
class ParityStore:
    uri: str
    wall_s: float  # the experiment's wall time (engine starts included)
    runs: dict[tuple[str, int], StoredRun]  # (variant, seed) -> what the store holds

    def run_id(self, variant: str, seed: int = 0) -> str:
        return self.runs[(variant, seed)].run_id
