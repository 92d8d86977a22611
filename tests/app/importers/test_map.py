"""`rldiag import --map`: rldiag.group/role/variant per run from name patterns; a bad file is one line."""

from __future__ import annotations

import json

from rldiag.app.cli.main import main
from rldiag.collectors import keys
from tests.helpers.importers import imported_runs, write_tensorboard, write_wandb


def test_mapping_file_tags_each_run_by_its_name_over_the_flags(store_uri, tmp_path):
    logdir = tmp_path / "tb"
    for name in ("base_seed1", "fix_seed1"):
        write_tensorboard(logdir / name, [(0, {"loss": 1.0})])
    mapping = tmp_path / "runs.json"
    mapping.write_text(json.dumps({"*": {"group": "gsm8k"}, "fix_*": {"role": "candidate", "variant": "fix"}}))
    assert main(["import", "tensorboard", str(logdir), "--role", "reference", "--map", str(mapping),
                 "--tracking-uri", store_uri]) == 0
    tags = {r.info.run_name: r.data.tags for r in imported_runs(store_uri)}
    assert {n: (t[keys.TAG_GROUP], t[keys.TAG_ROLE], t.get(keys.TAG_VARIANT)) for n, t in tags.items()} == {
        "base_seed1": ("gsm8k", "reference", None), "fix_seed1": ("gsm8k", "candidate", "fix")}


def test_a_bad_mapping_file_is_one_line_and_imports_nothing(store_uri, tmp_path, capsys):
    write_tensorboard(tmp_path / "tb", [(0, {"loss": 1.0})])
    bad = tmp_path / "runs.json"
    for text, says in (("{not json", "is not JSON"), ('{"*": {"role": "baseline"}}', "role 'baseline'"),
                       ('{"*": {"colour": "red"}}', "give an object with string values")):
        bad.write_text(text)
        rc = main(["import", "tensorboard", str(tmp_path / "tb"), "--map", str(bad), "--tracking-uri", store_uri])
        assert rc == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and str(bad) in err
    assert not imported_runs(store_uri)


def test_a_wandb_run_is_mapped_by_its_display_name(store_uri, tmp_path):
    # W&B names a run in its run record, read after the file's header: the mapping must see that name, not the id
    for name in ("ref_seed0", "fix_seed0"):
        write_wandb(tmp_path / name, [(1, {"train/loss": 1.0})], name=name)
    mapping = tmp_path / "runs.json"
    mapping.write_text(json.dumps({"*": {"group": "trl"}, "ref_*": {"role": "reference"},
                                   "fix_*": {"role": "candidate", "variant": "fix"}}))
    assert main(["import", "wandb", str(tmp_path), "--map", str(mapping), "--tracking-uri", store_uri]) == 0
    tags = {r.info.run_name: r.data.tags for r in imported_runs(store_uri)}
    assert {n: (t[keys.TAG_GROUP], t.get(keys.TAG_ROLE), t.get(keys.TAG_VARIANT)) for n, t in tags.items()} == {
        "ref_seed0": ("trl", "reference", None), "fix_seed0": ("trl", "candidate", "fix")}
