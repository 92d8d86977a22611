"""Benchmarks: rldiag's write path and monitor overhead against what a user would use instead.

    python -m bench.run_all            # everything, minutes; writes bench/results/*.json
    python -m bench.run_all --quick    # shortened, for a smoke run
    python -m bench.write_latency      # one benchmark

Each module measures rldiag and the alternative side by side in one run and reports the ratio.
"""

import os

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # before anything imports mlflow
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # no "View run" lines
