"""Reading journals back without holding them in memory: names of segments, a scan, batches one by one.

A journal is a stem (`<run_id>`, or `<run_id>-2`, ... for further writers of the same run) and its
segments in a folder: `<stem>.jsonl` (segment 0; a journal of rldiag before segments is just this file),
`<stem>.1.jsonl`, `<stem>.2.jsonl`, ... and `<stem>.lock` (`journal_lock`).

`scan_journal` reads every segment once, line by line, keeping only numbers: each batch line's
sequence number, where it starts and how many entries it holds (taken from the line's first bytes,
`{"seq":N,"n":K,`, without parsing the rest), and the acks. What it returns names the batches still
undelivered; `read_batch` parses one of them when the sender gets to it. Acknowledged batches are
never parsed.

Only verified segments are ever read for batches, acknowledged or deleted (`read_header`): a file
whose name is a segment's but whose first line is not an rldiag journal header for that name (the
user's `my_eval_results.jsonl`, rldiag's own `alerts.jsonl`, a file of damaged lines), or whose header
names another run than the journal's, is listed in `JournalScan.foreign` with the reason, and left
byte-identical.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rldiag.collectors.uri import is_redacted

Point = tuple[str, float, int, int]  # key, value, timestamp_ms, step

_SEQ = re.compile(rb'\{"seq":(\d+),(?:"n":(\d+),)?')
_loads = json.loads  # one name for every parse here (the tests count them)


@dataclass
class Batch:
    seq: int
    metrics: list[Point]
    tags: dict[str, str] = field(default_factory=dict)
    replayed: bool = False  # read back from an earlier journal
    created: float = 0.0  # time.monotonic() when queued for sending (0: send at once)
    home: Segment | None = None  # the segment that holds it (its ack goes there)

    @property
    def size(self) -> int:
        return len(self.metrics) + len(self.tags)


@dataclass(eq=False)
class Segment:
    """One file of a journal and how many of the batches in it are not acknowledged yet."""

    path: Path
    number: int
    stem: str
    open_batches: int = 0
    batches: int = 0  # written into it by this process (a segment with none is not rotated away)


@dataclass
class Pending:
    """An undelivered batch of a scanned segment: where its line starts and its entry count."""

    seq: int
    offset: int
    size: int


@dataclass
class SegmentScan:
    segment: Segment
    pending: list[Pending]


@dataclass
class JournalScan:
    run_id: str | None = None
    tracking_uri: str | None = None
    uri_redacted: bool = False
    segments: list[SegmentScan] = field(default_factory=list)
    corrupt_lines: int = 0
    refused: int = 0
    max_seq: int = -1
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # journal segments that could not be read
    foreign: list[tuple[Path, str]] = field(default_factory=list)  # files named like segments, not journals: left alone

    @property
    def pending_batches(self) -> int:
        return sum(len(s.pending) for s in self.segments)

    @property
    def pending_entries(self) -> int:
        return sum(p.size for s in self.segments for p in s.pending)


def split_name(path: Path) -> tuple[Path, str, int]:
    """(folder, stem, segment number) of a segment's path: `a/R.jsonl` -> (a, R, 0), `a/R.3.jsonl` -> 3."""
    name = path.name
    base = name.removesuffix(".jsonl")
    m = re.fullmatch(r"(.+)\.(\d+)", base)
    if m:
        return path.parent, m.group(1), int(m.group(2))
    return path.parent, base, 0


def segment_path(folder: Path, stem: str, number: int) -> Path:
    return folder / (f"{stem}.jsonl" if number == 0 else f"{stem}.{number}.jsonl")


def lock_path(folder: Path, stem: str) -> Path:
    return folder / f"{stem}.lock"


def segment_files(folder: Path, stem: str) -> list[tuple[int, Path]]:
    """The segments of `stem` in `folder`, in order."""
    pat = re.compile(re.escape(stem) + r"(?:\.(\d+))?\.jsonl")
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1) or 0), folder / n) for n in names if (m := pat.fullmatch(n))]
    return sorted(found)


def journal_stems(folder: Path) -> list[str]:
    """Every journal stem with a segment in `folder`."""
    stems = set()
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for n in names:
        if n.endswith(".jsonl"):
            stems.add(split_name(folder / n)[1])
    return sorted(stems)


HEADER_MAX_BYTES = 1 << 16  # a header line is ~200 bytes; a longer first line is not one


def read_header(path: Path) -> tuple[dict | None, str | None]:
    """(the header, None) when `path` is a segment of an rldiag journal, else (None, why not): a regular
    file named `<stem>.jsonl` or `<stem>.<K>.jsonl` whose first line is a journal header
    (`{"rldiag_journal": N, "run_id": R, ...}`) that, when it says a segment number, says K."""
    if not path.name.endswith(".jsonl"):
        return None, "its name does not end in .jsonl"
    number = split_name(path)[2]
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a device or FIFO would read forever
            return None, "it is not a regular file"
        with open(path, "rb") as f:
            first = f.readline(HEADER_MAX_BYTES)
    except OSError as e:
        return None, f"it cannot be read ({e})"
    try:
        head = _loads(first)
    except ValueError:
        head = None
    if not isinstance(head, dict) or not isinstance(head.get("rldiag_journal"), int):
        return None, "its first line is not an rldiag journal header"
    if not isinstance(head.get("run_id"), str) or not head["run_id"]:
        return None, "its header names no run"
    if "segment" in head and head["segment"] != number:
        return None, f"its header says segment {head['segment']!r}, its name segment {number}"
    return head, None


def segment_problem(path: Path) -> str | None:
    """Why `path` is not a segment of an rldiag journal, or None (`read_header`)."""
    return read_header(path)[1]


def _names_stem(run_id: str, stem: str) -> bool:
    return stem == run_id or re.fullmatch(re.escape(run_id) + r"-\d+", stem) is not None


def scan_journal(folder: Path, stem: str, run_id: str | None = None) -> JournalScan:
    """Every segment of the journal `stem`, read once for numbers only (see the module docstring).

    Only segments of one run are read: `run_id`, else the run whose journals the stem names (`R`,
    `R-<k>`), else (a journal copied under another name) the run of its first segment. Any other file
    named like a segment is listed in `foreign` and never read further, written or deleted."""
    out = JournalScan()
    acked: set[int] = set()
    found: list[tuple[Segment, list[Pending], list[int]]] = []
    heads = []
    for number, path in segment_files(folder, stem):
        head, why = read_header(path)
        if why is not None:
            out.foreign.append((path, why))
        else:
            heads.append((number, path, head["run_id"]))
    if run_id is None and heads:
        run_id = next((r for _, _, r in heads if _names_stem(r, stem)), heads[0][2])
    for number, path, named in heads:
        if named != run_id:
            out.foreign.append((path, f"its header names run {named!r}, not this journal's run {run_id!r}"))
            continue
        try:
            batches, unsized = _scan_segment(path, out, acked)
        except OSError as e:
            out.unreadable.append((path, str(e)))
            continue
        found.append((Segment(path, number, stem), batches, unsized))
    for seg, batches, unsized in found:
        pending = [p for p in batches if p.seq not in acked]
        if unsized:  # lines of older rldiag say no entry count: parse those still undelivered, once
            todo = set(unsized)
            with open(seg.path, "rb") as f:
                for p in pending:
                    if p.seq in todo:
                        b = read_batch(f, p.offset)
                        p.size = b.size if b is not None else 0
        seg.open_batches = len(pending)
        out.segments.append(SegmentScan(seg, pending))
    return out


def _scan_segment(path: Path, out: JournalScan, acked: set[int]) -> tuple[list[Pending], list[int]]:
    batches: list[Pending] = []
    unsized: list[int] = []
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            at, offset = offset, offset + len(raw)
            m = _SEQ.match(raw)
            if m and raw.endswith(b"}\n"):  # a whole line (a torn last line has no newline)
                seq = int(m.group(1))
                if m.group(2) is None:
                    unsized.append(seq)
                batches.append(Pending(seq, at, int(m.group(2) or 0)))
                out.max_seq = max(out.max_seq, seq)
                continue
            try:
                obj = _loads(raw)
                if "rldiag_journal" in obj:
                    if out.run_id is None:
                        out.run_id, out.tracking_uri = obj.get("run_id"), obj.get("tracking_uri")
                        out.uri_redacted = bool(obj.get("uri_redacted")) or is_redacted(out.tracking_uri)
                elif "ack" in obj:
                    acked.update(int(s) for s in obj["ack"])
                elif "refused" in obj:
                    out.refused += len(obj["refused"])
                else:  # a batch line spelled otherwise (written by hand or by another JSON encoder)
                    seq = int(obj["seq"])
                    batches.append(Pending(seq, at, len(obj.get("m", [])) + len(obj.get("t", {}))))
                    out.max_seq = max(out.max_seq, seq)
            except (ValueError, TypeError, KeyError, AttributeError):
                out.corrupt_lines += 1
    return batches, unsized


def read_batch(f, offset: int) -> Batch | None:
    """The batch whose line starts at `offset` of the open (binary) segment `f`; None if damaged."""
    f.seek(offset)
    try:
        obj = _loads(f.readline())
        points = [(str(k), float(v), int(ts), int(st)) for k, v, ts, st in obj.get("m", [])]
        tags = {str(k): str(v) for k, v in obj.get("t", {}).items()}
        return Batch(int(obj["seq"]), points, tags)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def iter_pending(scan: JournalScan) -> Iterator[Batch | None]:
    """Every undelivered batch of a scanned journal, parsed one at a time (None for a damaged line)."""
    for s in scan.segments:
        if not s.pending:
            continue
        with open(s.segment.path, "rb") as f:
            for p in s.pending:
                b = read_batch(f, p.offset)
                if b is not None:
                    b.home = s.segment
                yield b
