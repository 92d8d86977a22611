"""`rldiag COMMAND --help` against `python -c pass`: the help of every command is instant because each
command imports its library (torch, MLflow, pandas, plotly, Streamlit) only when it runs.

    python -m bench.cli_help            # 7 alternating rounds of every command's --help and `python -c pass`
    python -m bench.cli_help --quick    # 3 rounds

Goal (issue 44): every help under 0.5 s. Wall time of a fresh interpreter each, median over rounds; the
ratio is to `python -c pass` measured in the same rounds (what no command can beat).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bench._common import env_info, summary_row, write_result

NAME = "cli_help"
GOAL_S = 0.5
COMMANDS = ("", "demo", "sync", "experiment", "watch", "report", "app", "preflight", "import")


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    base = [sys.executable, "-c", "pass"]
    times: dict[str, list[float]] = {"python -c pass": []}
    for r in range(rounds):
        times["python -c pass"].append(_wall(base))
        for c in COMMANDS:
            cmd = [sys.executable, "-m", "rldiag.app.cli.main", *([c] if c else []), "--help"]
            times.setdefault(f"rldiag {c} --help".replace("  ", " "), []).append(_wall(cmd))
        print(f"  round {r + 1}/{rounds} done", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med.pop("python -c pass")
    worst = max(med, key=med.get)
    for k, v in med.items():
        print(f"{k:28} {v * 1000:6.0f} ms  ({v / floor:.1f}x python -c pass)")
    print(f"python -c pass               {floor * 1000:6.0f} ms")
    out = {"benchmark": NAME, "quick": args.quick, "env": env_info(), "rounds": rounds, "median_s": med,
           "python_pass_s": floor}
    out["summary"] = [summary_row("slowest `rldiag COMMAND --help` (fresh interpreter)",
                                  f"{worst}: {med[worst] * 1000:.0f} ms", f"python -c pass: {floor * 1000:.0f} ms",
                                  f"{med[worst] / floor:.1f}x", f"< {GOAL_S} s", med[worst] < GOAL_S)]
    print(f"wrote {write_result(NAME, out)}")
    return out


if __name__ == "__main__":
    main()
