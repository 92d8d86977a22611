"""What an experiment shows in the terminal: rldiag's own lines and one progress bar per run; what the
libraries print (vLLM's and transformers' logs, Python warnings, Triton, DeepSpeed, tcmalloc, the engine's
child processes) goes to a log file named in one line.

    with library_output_to(log_file("engine-parity")) as term:
        run_experiment(cfg, progress_file=term)     # bars and rldiag's lines on `term`

Libraries write to file descriptors 1 and 2 from Python, from native code and from child processes
(vLLM's engine core), so the redirection is of the descriptors themselves (`os.dup2`), not of
`sys.stdout`: everything that would have reached the terminal reaches the log, and `term` is a
duplicate of the terminal's stderr taken before.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

LOG_DIR = Path(".rldiag") / "logs"  # beside the writer's spill folder, in the working directory


def log_file(name: str, directory: str | Path = LOG_DIR) -> Path:
    """`.rldiag/logs/<name>-<UTC time>.log` (the folder is made)."""
    path = Path(directory) / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def library_output_to(path: Path) -> Iterator[TextIO]:
    """Send file descriptors 1 and 2 (and so every library's output) to `path` while the block runs;
    yield a line-buffered stream to the terminal's stderr for rldiag's own lines and progress bars.
    Says where the log is on entry, and again if the block raises."""
    print(f"library warnings and logs: {path}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    term = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    # rldiag's own warnings (the alert at a step, an undelivered point) stay in the terminal, above the bars
    ours = logging.getLogger("rldiag")
    handler = _AboveBars(term)
    ours.addHandler(handler)
    propagate, ours.propagate = ours.propagate, False
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield term
    except BaseException:
        print(f"failed: the libraries' output is in {path}", file=term)
        raise
    finally:
        ours.removeHandler(handler)
        ours.propagate = propagate
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
        term.close()


class _AboveBars(logging.Handler):
    """rldiag's log lines on the terminal, written through tqdm so a progress bar is redrawn below them."""

    def __init__(self, stream: TextIO):
        super().__init__(logging.WARNING)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise into the training loop
            self.handleError(record)
