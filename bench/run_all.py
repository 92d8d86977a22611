"""Run every benchmark one after the other and print the README table.

    python -m bench.run_all                      # full: ~25 min on 2 cores (outage ~8, log_stall ~7, dashboard ~2)
    python -m bench.run_all --quick              # shortened (outage 10 s)
    python -m bench.run_all --only throughput    # some of them; the table uses the other results on disk
    python -m bench.run_all --table-only         # rebuild the table from bench/results/*.json

Each benchmark runs in its own process (no MLflow or torch state shared between them) and writes
bench/results/<name>.json; the table goes to stdout and to bench/results/README-table.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import bench  # noqa: F401 - sets MLFLOW_DISABLE_TELEMETRY for the children too
from bench._common import RESULTS

BENCHMARKS = ("write_latency", "throughput", "overhead", "outage", "log_stall", "load_histories", "callback_overhead",
              "divergence_quality", "divergence_speed", "report_build", "dashboard_load", "install_footprint", "journal_scale",
              "team_load", "logits_memory", "entropy_cache", "cli_help")
# rows of results `run_all` does not produce itself (a longer run of a benchmark, by its own command)
TABLE = (*BENCHMARKS[:3], "overhead_d1024", *BENCHMARKS[3:8], "divergence_quality_long", "divergence_quality_zeros",
         "divergence_quality_zeros_often", *BENCHMARKS[8:], "import_runs")
# overhead_d1024: python -m bench.overhead --d-model 1024 --blocks 6 --block-steps 4;
# divergence_quality_long: python -m bench.divergence_quality --long-steps 100000 --held-out 0 --per-kind 1;
# divergence_quality_zeros: python -m bench.divergence_quality --zeros
# divergence_quality_zeros_often: python -m bench.divergence_quality --zeros often
# divergence_speed: python -m bench.divergence_speed --full --repeats 2 (run_all's quick default writes
#   divergence_speed_quick.json, not this row)
# import_runs: python -m bench.import_runs (10 runs x 50 scalars x 10k steps, about 35 min)
COLUMNS = ("benchmark", "rldiag", "alternative", "ratio", "goal", "met?")


def splice_readme(readme: Path, md: str) -> bool:
    """Put the table between bench/README.md's `<!-- bench-table ... -->` and `<!-- /bench-table -->` lines."""
    text = readme.read_text()
    start = text.find("<!-- bench-table")
    end = text.find("<!-- /bench-table -->")
    if start < 0 or end < start:
        return False
    start = text.index("\n", start) + 1
    readme.write_text(text[:start] + md + text[end:])
    return True


def table(names: tuple[str, ...] = TABLE) -> str:
    """The Markdown table of every `summary` row in bench/results/<name>.json."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    notes = []
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | not run | | | | |")
            continue
        data = json.loads(path.read_text())
        for row in data.get("summary", []):
            met = {True: "yes", False: "**no**", None: "-"}[row["met"]]
            cells = [row["benchmark"], row["rldiag"], row["alternative"], row["ratio"], row["goal"], met]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
        env = data.get("env", {})
        notes.append(f"{name}: {env.get('when', '?')}{' (--quick)' if data.get('quick') else ''}")
    env = {}
    for name in names:
        path = RESULTS / f"{name}.json"
        if path.exists():
            env = json.loads(path.read_text()).get("env", {})
            break
    foot = (f"\nMeasured with `python -m bench.run_all` or `python -m bench.<name>` (Python {env.get('python', '?')}, MLflow {env.get('mlflow', '?')}, "
            f"torch {env.get('torch', '?')}, {env.get('cpus', '?')} CPUs, shared machine: absolute times +-2x, ratios "
            f"hold better). Runs: {'; '.join(notes)}.\n")
    return "\n".join(lines) + "\n" + foot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shortened runs")
    ap.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this one (repeatable)")
    ap.add_argument("--table-only", action="store_true", help="just rebuild the table from existing results")
    args = ap.parse_args(argv)
    repo = Path(__file__).resolve().parent.parent
    failed = []
    if not args.table_only:
        for name in args.only or BENCHMARKS:
            print(f"\n=== bench.{name} {'--quick' if args.quick else ''}", flush=True)
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", f"bench.{name}", *(["--quick"] if args.quick else [])], cwd=repo)
            print(f"=== bench.{name}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
            if rc:
                failed.append(name)
    md = table()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "README-table.md").write_text(md)
    splice_readme(repo / "bench" / "README.md", md)
    print("\n" + md)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
