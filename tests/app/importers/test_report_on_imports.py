"""The issue's bar: imported runs are compared by `rldiag report` on the canonical keys."""

from __future__ import annotations

import random

from rldiag.app.cli.main import main
from tests.helpers.importers import write_tensorboard, write_wandb


def verl_steps(seed: int, departs: bool):
    """120 steps of verl's names; the departing run's clip fraction climbs 0.02 a step after step 60."""
    rng = random.Random(seed)
    for s in range(1, 121):
        drift = (s - 60) * 0.02 if departs and s > 60 else 0.0
        yield s, {"actor/pg_clipfrac": 0.02 + rng.gauss(0, 0.002) + drift, "actor/entropy": 1.5 + rng.gauss(0, 0.02)}


def trl_steps(seed: int, departs: bool):
    """The same under TRL's names as transformers' WandbCallback logs them: the grad norm climbs after 60."""
    rng = random.Random(seed)
    for s in range(1, 121):
        drift = (s - 60) * 0.25 if departs and s > 60 else 0.0
        yield s, {"train/grad_norm": 1.0 + rng.gauss(0, 0.05) + drift, "train/loss": 0.5 + rng.gauss(0, 0.01)}


def test_report_names_the_departure_of_an_imported_tensorboard_and_wandb_candidate(store_uri, tmp_path):
    for name, seed, departs in (("ref_s1", 1, False), ("ref_s2", 2, False), ("fix_s1", 3, True)):
        write_tensorboard(tmp_path / "tb" / name, verl_steps(seed, departs))
        write_wandb(tmp_path / "wb" / name, trl_steps(seed, departs), config={"seed": seed})
    (tmp_path / "map.json").write_text('{"ref_*": {"role": "reference"}, "fix_*": {"role": "candidate"}}')
    assert main(["import", "tensorboard", str(tmp_path / "tb"), "--group", "verl", "--map", str(tmp_path / "map.json"),
                 "--tracking-uri", store_uri]) == 0
    for name in ("ref_s1", "ref_s2", "fix_s1"):
        role = "candidate" if name.startswith("fix") else "reference"
        assert main(["import", "wandb", str(tmp_path / "wb" / name), "--group", "trl", "--role", role,
                     "--tracking-uri", store_uri]) == 0
    for group, key in (("verl", "policy/clip_active_rate"), ("trl", "grad/norm")):
        out = tmp_path / group
        assert main(["report", "--group", group, "--out", str(out), "--quiet", "--tracking-uri", store_uri]) == 0
        md = (out / "rldiag-report.md").read_text()
        line = next(ln for ln in md.splitlines() if ln.startswith("- ") and "leaves the reference band" in ln)
        assert key.replace("_", "\\_") in line and "(started about step 6" in line, line  # onset at step 61 or 62
