"""Importing TensorBoard logdirs and W&B run folders into MLflow, so that rldiag reads them (`rldiag import`)."""

from rldiag.app.importers.common import Poll, RunImport

__all__ = ["Poll", "RunImport"]
