"""The watcher as a library: `watch_once(uri)` runs one cycle, `Watcher` and `loop` keep polling;
`rldiag watch` is its command."""

from rldiag.app.watch.loop import CycleResult, Watcher, loop, watch_once

__all__ = ["CycleResult", "Watcher", "loop", "watch_once"]
