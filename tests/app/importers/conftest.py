"""The importers' tests need the [import] extra (tensorboard); their runs are written with
`tests.helpers.importers` (torch's SummaryWriter and wandb in offline mode)."""

import pytest

pytest.importorskip("tensorboard", reason="the [import] extra (tensorboard) is not installed")
