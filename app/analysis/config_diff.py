"""Params and tags of several runs side by side, the settings that break train-inference parity first.

The first lesson of the vLLM V0 -> V1 migration: an unpinned runtime default is a silent difference.
So the engine-parity knobs (logprobs mode, prefix caching, async scheduling, dtypes) lead, then the
batch and accumulation settings (the NaN-gradient bug needs batch x accumulation > 1), then the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import pandas as pd

from rldiag.app.data.store import Store, require_store

PARITY_KNOBS: tuple[str, ...] = (
    "engine.logprobs_mode",
    "engine.enable_prefix_caching",
    "engine.async_scheduling",
    "engine.dtype",
    "model.lm_head_dtype",
)
# Other trainers spell them differently (TRL: vllm_enable_prefix_caching, torch_dtype, ...).
_PARITY_WORDS = ("logprobs_mode", "prefix_caching", "async_scheduling", "dtype")
_BATCH = re.compile(r"batch|accum|num_generations|micro|mini_?batch", re.IGNORECASE)

GROUP_PARITY = "engine parity"
GROUP_BATCH = "batch / accumulation"
GROUP_OTHER = "other params"
GROUP_TAGS = "tags"
GROUPS: tuple[str, ...] = (GROUP_PARITY, GROUP_BATCH, GROUP_OTHER, GROUP_TAGS)
# `rldiag import`'s bookkeeping (app/importers/common.py: the source path, its hash, the tracker): differs
# between any two imported runs without meaning, so left out like MLflow's own mlflow.* tags
IMPORT_PREFIX = "rldiag.import."


class RunConfig(NamedTuple):
    params: dict[str, str]
    tags: dict[str, str]


def load_configs(store: Store, run_ids: Sequence[str]) -> dict[str, RunConfig]:
    """`{run_id: RunConfig}` in `run_ids` order; RunNotFound names ids the store does not hold."""
    from rldiag.app.data.runs import get_runs

    require_store(store)
    return {r.info.run_id: RunConfig(dict(r.data.params), dict(r.data.tags)) for r in get_runs(store, run_ids)}


def _param_rank(name: str) -> tuple[int, int, str]:
    if name in PARITY_KNOBS:
        return (0, PARITY_KNOBS.index(name), name)
    for i, word in enumerate(_PARITY_WORDS):
        if word in name.lower():
            return (0, len(PARITY_KNOBS) + i, name)
    if _BATCH.search(name):
        return (1, 0, name)
    return (2, 0, name)


def config_diff(
    configs: Mapping[str, RunConfig],
    *,
    labels: Mapping[str, str] | None = None,
    only_differing: bool = True,
    include_mlflow_tags: bool = False,
) -> pd.DataFrame:
    """One row per param or tag, one column per run (`labels[run_id]`, default the id).

    Columns: `group` (one of GROUPS, in that order), `kind` ("param" or "tag"), `name`, then the runs;
    a value the run does not have is None. With `only_differing` (the default) only rows whose values
    are not all equal are kept; a missing value differs from any value. MLflow's own `mlflow.*` tags and
    `rldiag import`'s bookkeeping (`rldiag.import.*` tags or params) are left out unless `include_mlflow_tags`.
    """
    run_ids = list(configs)
    cols = [labels.get(r, r) for r in run_ids] if labels else run_ids
    if len(set(cols)) != len(cols):
        raise ValueError(f"run labels must be unique, got {cols}; label runs by name and id")
    rows = []
    param_names = sorted({k for c in configs.values() for k in c.params
                          if include_mlflow_tags or not k.startswith(IMPORT_PREFIX)}, key=_param_rank)
    for name in param_names:
        rows.append((GROUPS[_param_rank(name)[0]], "param", name, [configs[r].params.get(name) for r in run_ids]))
    tag_names = sorted({k for c in configs.values() for k in c.tags
                        if include_mlflow_tags or not k.startswith(("mlflow.", IMPORT_PREFIX))})
    for name in tag_names:
        rows.append((GROUP_TAGS, "tag", name, [configs[r].tags.get(name) for r in run_ids]))
    if only_differing:
        rows = [row for row in rows if len(set(row[3])) > 1]
    return pd.DataFrame([[g, kind, name, *vals] for g, kind, name, vals in rows],
                        columns=["group", "kind", "name", *cols], dtype=object)  # object: None stays None


def value_key(v) -> str:
    """A config value as compared: its text; a missing value (None, NaN) apart from any text."""
    return "\0missing" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)


def shared_values(diff: pd.DataFrame, base_columns: Sequence[str]) -> list[str | None]:
    """Per row of `diff` (`config_diff`'s frame), the value (as `value_key`) every one of `base_columns`
    (the references) holds; None where they disagree or there are none. A candidate differs where its
    value is not this one: compared with one reference, every candidate's seed would differ."""
    if not len(base_columns):
        return [None] * len(diff)
    return [values.pop() if len(values := {value_key(v) for v in row}) == 1 else None
            for row in diff[list(base_columns)].itertuples(index=False)]
