"""The config diff of imported runs: `rldiag import`'s bookkeeping tags (rldiag.import.*: the source path,
its hash, the tracker) differ between any two imported runs and are left out as noise; their settings stay."""

from __future__ import annotations

from rldiag.app.analysis.config_diff import IMPORT_PREFIX, config_diff, load_configs
from rldiag.app.cli.main import main
from rldiag.app.data.store import open_store
from rldiag.app.importers import common
from tests.helpers.importers import imported_runs, write_tensorboard


def test_import_bookkeeping_is_left_out_of_the_config_diff(store_uri, tmp_path):
    assert {common.TAG_SOURCE, common.TAG_SOURCE_ID, common.TAG_TRACKER} == {
        t for t in vars(common).values() if isinstance(t, str) and t.startswith(IMPORT_PREFIX)}
    for name, lr in (("a", 1e-6), ("b", 3e-6)):  # two runs, written by SummaryWriter, one setting apart
        write_tensorboard(tmp_path / "tb" / name, [(s, {"actor/grad_norm": 1.0}) for s in range(3)],
                          hparams={"lr": lr, "algo": "grpo"})
    assert main(["import", "tensorboard", str(tmp_path / "tb"), "--tracking-uri", store_uri]) == 0
    runs = imported_runs(store_uri)
    assert len(runs) == 2 and all(r.data.tags[common.TAG_SOURCE] for r in runs)  # the tags are there ...
    configs = load_configs(open_store(store_uri), [r.info.run_id for r in runs])
    diff = config_diff(configs)
    assert diff["name"].tolist() == ["lr"]  # ... and only the setting that differs is shown
    every = config_diff(configs, include_mlflow_tags=True)
    assert {common.TAG_SOURCE, common.TAG_SOURCE_ID} <= set(every["name"])  # asked for: shown
    same = config_diff(configs, only_differing=False)["name"].tolist()
    assert "algo" in same and not [n for n in same if n.startswith(IMPORT_PREFIX)]
