"""Everything rldiag uses of the `tensorboard` package: its Event protobuf, its CRC and its hparams data.

These are tensorboard's internal modules (no public API reads event files record by record with the
file offsets a resumable import needs); tests/app/importers/test_compat.py pins each one against the
installed tensorboard. The framing is TFRecord's: per record an 8-byte little-endian length, its masked
CRC32C (4 bytes), the data, the data's masked CRC32C (4 bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

HEADER = 12  # length (8) + its CRC (4)
FOOTER = 4


class CorruptRecord(ValueError):
    """A record whose CRC does not match: the bytes from `offset` on cannot be trusted."""

    def __init__(self, offset: int, why: str):
        super().__init__(f"{why} (at byte {offset})")
        self.offset, self.why = offset, why


def masked_crc32c(data: bytes) -> int:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as crc

    return crc(data)


def read_records(buf: bytes, base: int = 0) -> Iterator[tuple[int, bytes]]:
    """`(end_offset, record)` for each whole record in `buf`, the file's bytes from offset `base`; offsets
    are the file's. Stops at a partial record at the end (a file still being written); raises
    `CorruptRecord` at a record whose CRC fails."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as crc

    pos, n = 0, len(buf)
    while pos + HEADER <= n:
        head = buf[pos:pos + 8]
        if struct.unpack("<I", buf[pos + 8:pos + 12])[0] != crc(head):
            raise CorruptRecord(base + pos, "a record's length fails its CRC")
        (length,) = struct.unpack("<Q", head)
        end = pos + HEADER + length + FOOTER
        if end > n:
            return
        data = buf[pos + HEADER:end - FOOTER]
        if struct.unpack("<I", buf[end - FOOTER:end])[0] != crc(data):
            raise CorruptRecord(base + pos, f"a record of {length} bytes fails its CRC")
        yield base + end, data
        pos = end


def resync(path, offset: int, window: int = 1 << 20) -> int | None:
    """Where reading goes on after a corrupt record at `offset`: the first later position whose length passes
    its CRC and whose data passes theirs, found byte by byte (a false match needs two CRC collisions); None
    where the file has none."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as crc

    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        start = offset + 1
        while start + HEADER <= size:
            fh.seek(start)
            buf = fh.read(window + HEADER)
            for i in range(min(window, len(buf) - HEADER + 1)):
                head = buf[i:i + 8]
                (length,) = struct.unpack("<Q", head)
                if start + i + HEADER + length + FOOTER > size:
                    continue
                if struct.unpack("<I", buf[i + 8:i + 12])[0] != crc(head):
                    continue
                fh.seek(start + i + HEADER)
                data = fh.read(length + FOOTER)
                if struct.unpack("<I", data[length:])[0] == crc(data[:length]):
                    return start + i
            start += window
    return None


@dataclass
class Scalar:
    tag: str
    step: int
    wall_ms: int
    value: float


def parse_event(record: bytes, scalar_tags: set[str], hparams: dict[str, object]) -> list[Scalar]:
    """The scalars of one serialized `Event`: legacy `simple_value`s, and tensors of tags whose first
    metadata names the `scalars` plugin (TF2 writers; `scalar_tags` remembers those across events).
    Hyperparameters of an hparams session start (torch's `add_hparams`) are added to `hparams`."""
    from tensorboard.compat.proto import event_pb2

    ev = event_pb2.Event.FromString(record)
    if not ev.HasField("summary"):
        return []
    out = []
    for v in ev.summary.value:
        kind = v.WhichOneof("value")
        plugin = v.metadata.plugin_data.plugin_name if v.HasField("metadata") else ""
        if plugin == "hparams":
            hparams.update(_hparams(v.metadata.plugin_data.content))
            continue
        if plugin == "scalars":
            scalar_tags.add(v.tag)
        if kind == "simple_value":
            out.append(Scalar(v.tag, ev.step, int(ev.wall_time * 1000), float(v.simple_value)))
        elif kind == "tensor" and v.tag in scalar_tags:
            out.append(Scalar(v.tag, ev.step, int(ev.wall_time * 1000), _tensor_scalar(v.tensor)))
    return out


def _tensor_scalar(tensor) -> float:
    from tensorboard.util import tensor_util

    return float(tensor_util.make_ndarray(tensor).reshape(-1)[0])


def _hparams(content: bytes) -> dict[str, object]:
    from tensorboard.plugins.hparams import plugin_data_pb2

    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    if not data.HasField("session_start_info"):
        return {}
    out: dict[str, object] = {}
    for name, value in data.session_start_info.hparams.items():
        kind = value.WhichOneof("kind")
        out[name] = getattr(value, kind) if kind is not None else None
    return out
