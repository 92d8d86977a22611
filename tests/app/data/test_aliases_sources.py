"""Every framework's metric names, read from its own source: the provenance table and the loader's alias table
agree, and a run logged under each framework's exact key strings into a real SQLite MLflow store is read onto
the canonical keys (its other names kept under their own)."""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np
import pytest

from rldiag.app.data.aliases_sources import FOREIGN_METRICS, aliases, aliases_markdown
from rldiag.app.data.histories import load_histories
from rldiag.app.data.store import open_store
from rldiag.collectors import keys
from tests.helpers.runs import T0_MS, log_raw, write_run

FRAMEWORKS = ("TRL", "verl", "NeMo-RL", "slime", "Miles", "prime-rl", "OpenRLHF", "SkyRL", "AReaL", "ROLL",
              "PipelineRL")


def test_the_alias_table_is_exactly_the_sourced_aliases():
    # both ways: no alias without its source, no sourced alias the loader does not apply
    assert aliases() == keys.ALIASES


def test_every_alias_note_is_about_an_alias():
    assert set(keys.ALIAS_NOTES) <= set(keys.ALIASES)


def test_every_target_is_a_canonical_key_and_no_key_has_two_targets():
    targets: dict[str, set[str | None]] = defaultdict(set)
    for m in FOREIGN_METRICS:
        targets[m.key].add(m.canonical)
        assert m.canonical is None or m.canonical in keys.CANONICAL_METRICS, m
        assert m.definition and m.source.count("/") >= 2, m  # "owner/repo path/..."
    assert {k: t for k, t in targets.items() if len(t) > 1} == {}
    assert {m.framework for m in FOREIGN_METRICS} == set(FRAMEWORKS)


def test_markdown_has_a_row_per_name_with_its_target_and_source():
    md = aliases_markdown()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| framework")]
    assert len(rows) == len(FOREIGN_METRICS)
    for row, m in zip(rows, FOREIGN_METRICS):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[:3] == [m.framework, f"`{m.key}`", f"`{m.canonical}`" if m.canonical else "own name (not aliased)"]
        assert cells[4] == m.source.replace("|", "\\|")


def _runs_for(framework: str) -> list[list[tuple[str, str | None]]]:
    """The framework's names split into runs so that no run logs two names of one canonical key."""
    runs: list[list[tuple[str, str | None]]] = []
    for m in (m for m in FOREIGN_METRICS if m.framework == framework):
        i = 0
        while i < len(runs) and m.canonical is not None and m.canonical in {c for _, c in runs[i]}:
            i += 1
        if i == len(runs):
            runs.append([])
        runs[i].append((m.key, m.canonical))
    return runs


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_under_the_frameworks_exact_keys_reads_onto_the_canonical_keys(store_uri, framework):
    store = open_store(store_uri)
    runs = _runs_for(framework)
    assert runs, f"no name of {framework}'s was read from its source"
    for n, names in enumerate(runs):
        rid = write_run(store_uri, name=f"{framework}-{n}")
        # each name gets its own values (0.25 * i + 0.01 * step) so a wrong mapping shows as wrong numbers
        log_raw(store_uri, rid, [(key, 0.25 * i + 0.01 * s, T0_MS + s, s)
                                 for i, (key, _) in enumerate(names) for s in range(5)])
        h = load_histories(store, [rid])
        for i, (key, canonical) in enumerate(names):
            shown = canonical or key  # not aliased: kept under its own name
            t = h.get(rid, shown)
            assert t is not None and t.source_key == key, (framework, key, shown)
            np.testing.assert_allclose(t.values, [0.25 * i + 0.01 * s for s in range(5)], err_msg=key)
            assert t.steps.tolist() == list(range(5))
        aliased = {c for _, c in names if c is not None}
        assert aliased <= set(h.keys)


def test_verls_score_is_read_as_the_reward():
    # verl's reward curve is critic/score/mean (trainer/ppo/metric_utils.py); critic/rewards/mean has the in-reward
    # KL penalty subtracted, so it is kept under its own name
    assert keys.ALIASES.get("critic/score/mean") == keys.REWARD_MEAN and "critic/rewards/mean" not in keys.ALIASES
