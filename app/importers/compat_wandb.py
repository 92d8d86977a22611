"""Everything rldiag uses of the `wandb` package: the `.wandb` file's framing and its `Record` protobuf.

wandb (0.31) has no Python reader for its run files (its Go core writes and syncs them), so the framing
is read here; tests/app/importers/test_compat.py pins it against what the installed wandb writes.
The file is a 7-byte header (`:W&B`, the magic 0xBEE1 little-endian, version 0) and then LevelDB's log
format: 32 KiB blocks counted from the start of the file; each chunk has a 7-byte header (CRC, 2-byte
length, 1-byte type: 1 full, 2 first, 3 middle, 4 last); a block's tail under 7 bytes is padding. The
CRC is zlib's CRC-32 of the type byte and the data, unmasked (not LevelDB's masked CRC32C).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class CorruptRecord(ValueError):
    """A chunk whose CRC or type is wrong: the bytes from `offset` on cannot be trusted."""

    def __init__(self, offset: int, why: str):
        super().__init__(f"{why} (at byte {offset})")
        self.offset, self.why = offset, why


def is_wandb_file(head: bytes) -> bool:
    return head[:len(FILE_HEADER)] == FILE_HEADER


def read_records(buf: bytes, base: int = len(FILE_HEADER)) -> Iterator[tuple[int, bytes]]:
    """`(end_offset, record)` for each whole record in `buf`, the file's bytes from offset `base` (the
    header's end, or an offset this function gave). Offsets are the file's. Stops at a partial record at
    the end (a run still being written); raises `CorruptRecord`."""
    pos, n, parts = base, base + len(buf), None
    while True:
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            pos += left
            continue
        if pos + CHUNK_HEADER > n:
            return
        crc, length, kind = struct.unpack("<IHB", buf[pos - base:pos - base + CHUNK_HEADER])
        if crc == 0 and length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        end = pos + CHUNK_HEADER + length
        if end > n:
            return
        data = buf[pos - base + CHUNK_HEADER:end - base]
        if kind not in (FULL, FIRST, MIDDLE, LAST) or length > left - CHUNK_HEADER:
            raise CorruptRecord(pos, f"a chunk with type {kind} and length {length}")
        if zlib.crc32(data, zlib.crc32(bytes([kind]))) != crc:
            raise CorruptRecord(pos, f"a chunk of {length} bytes fails its CRC")
        pos = end
        if kind == FULL:
            yield pos, data
        elif kind == FIRST:
            parts = [data]
        elif parts is None:
            raise CorruptRecord(pos - length - CHUNK_HEADER, "a chunk continues a record that never started")
        else:
            parts.append(data)
            if kind == LAST:
                yield pos, b"".join(parts)
                parts = None


def resync(path, offset: int) -> int | None:
    """Where reading goes on after a corrupt chunk at `offset`: the first later chunk that starts a record
    (full or first) and passes its CRC, found byte by byte (a false match needs a CRC-32 collision); the chunks
    that continue a record begun before it are never taken for a start. None where the file has none."""
    with open(path, "rb") as fh:
        start = offset + 1
        while True:
            fh.seek(start)
            buf = fh.read(2 * BLOCK)  # a chunk never crosses a block: one starting in the first half ends in buf
            for i in range(min(BLOCK, len(buf) - CHUNK_HEADER + 1)):
                pos = start + i
                left = BLOCK - pos % BLOCK
                crc, length, kind = struct.unpack_from("<IHB", buf, i)
                if kind not in (FULL, FIRST) or left < CHUNK_HEADER or length > left - CHUNK_HEADER \
                        or i + CHUNK_HEADER + length > len(buf):
                    continue
                if zlib.crc32(buf[i + CHUNK_HEADER:i + CHUNK_HEADER + length], zlib.crc32(bytes([kind]))) == crc:
                    return pos
            if len(buf) <= BLOCK:
                return None
            start += BLOCK


def parse_record(data: bytes):
    """One `wandb_internal_pb2.Record`, and the name of its `record_type` (history, run, config, exit...)."""
    from wandb.proto import wandb_internal_pb2

    rec = wandb_internal_pb2.Record.FromString(data)
    return rec.WhichOneof("record_type"), rec


def item_key(item) -> str:
    """A history or config item's name: `key`, or its `nested_key` path (a nested dict's) joined with '.',
    as W&B's UI names it (`{"a": {"b": 1}}` is `a.b`; a key `train/loss` stays as it is)."""
    return item.key or ".".join(item.nested_key)
