"""Pins every private API of the trackers that app/importers/compat_*.py uses, against the installed packages.

A tensorboard or wandb release that moves a module, renames a protobuf field or changes the file framing
fails here, by name, before an import reads a run wrong.
"""

from __future__ import annotations

import math
import struct

import pytest

from rldiag.app.importers import compat_tensorboard as ctb
from rldiag.app.importers import compat_wandb as cwb
from tests.helpers.importers import write_tensorboard, write_wandb


def test_tensorboard_modules_rldiag_reads_through():
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    crc = 0xE3069283  # CRC32C("123456789"), the standard check value; TFRecord masks it:
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert {"step", "wall_time", "summary"} <= set(event_pb2.Event.DESCRIPTOR.fields_by_name)
    value = event_pb2.Event.DESCRIPTOR.fields_by_name["summary"].message_type.fields_by_name["value"].message_type
    assert {"tag", "simple_value", "tensor", "metadata"} <= set(value.fields_by_name)
    assert "session_start_info" in plugin_data_pb2.HParamsPluginData.DESCRIPTOR.fields_by_name
    assert callable(tensor_util.make_ndarray)


@pytest.mark.parametrize("new_style", [False, True], ids=["simple_value", "tensor"])
def test_tensorboard_reader_agrees_with_event_accumulator(tmp_path, new_style):
    """Every scalar that tensorboard's own EventAccumulator reads, at the same step, NaN included: torch's
    legacy simple_value events and its new-style tensor events (the scalars plugin's metadata)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [(s, {"a/x": s * 0.5, "b": math.nan if s == 7 else -s}) for s in range(20)]
    f = write_tensorboard(tmp_path, rows, hparams={"lr": 0.1, "name": "x", "flag": True}, new_style=new_style)
    tags: set[str] = set()
    hparams: dict[str, object] = {}
    files = sorted(tmp_path.glob("events.out.tfevents.*"))  # add_hparams writes a second file
    assert f in files and len(files) == 2
    got = [(s.tag, s.step, s.value) for path in files for _, rec in ctb.read_records(path.read_bytes())
           for s in ctb.parse_event(rec, tags, hparams) if not s.tag.startswith("hparam/")]
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    if new_style:  # EventAccumulator keeps tensor-valued scalars among its tensors
        from tensorboard.util import tensor_util

        want = [(t, e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for t in ("a/x", "b")
                for e in ea.Tensors(t)]
    else:
        want = [(t, e.step, e.value) for t in ("a/x", "b") for e in ea.Scalars(t)]
    assert len(got) == len(want) == 40
    key = (lambda r: (r[0], r[1]))
    for g, w in zip(sorted(got, key=key), sorted(want, key=key)):
        assert g[:2] == w[:2] and (g[2] == w[2] or (math.isnan(g[2]) and math.isnan(w[2])))
    assert hparams == {"lr": 0.1, "name": "x", "flag": True}


def test_wandb_file_framing_and_records(tmp_path):
    """What the installed wandb writes: the header, CRC-checked chunks (a record over 32 KiB spans blocks:
    first/middle/last), and the record fields rldiag reads."""
    from wandb.proto import wandb_internal_pb2

    f = write_wandb(tmp_path, [(0, {"k": 1.0}), (1, {"k": math.nan})], config={"big": "x" * 70_000})
    data = f.read_bytes()
    assert data[:7] == cwb.FILE_HEADER == b":W&B\xe1\xbe\x00"
    kinds, spans = [], 0
    for _, rec in cwb.read_records(data[7:]):
        kind, r = cwb.parse_record(rec)
        kinds.append(kind)
        spans += len(rec) > cwb.BLOCK
        if kind == "history":
            items = {cwb.item_key(i): i.value_json for i in r.history.item}
            assert {"k", "_step", "_timestamp"} <= set(items)
        if kind == "run":
            assert r.run.project == "proj" and any(cwb.item_key(i) == "big" for i in r.run.config.update)
    assert {"run", "history", "exit"} <= set(kinds) and kinds.count("history") == 2
    assert spans >= 1, "no record spanned blocks: the first/middle/last path was not exercised"
    assert {"record_type"} <= set(wandb_internal_pb2.Record.DESCRIPTOR.oneofs_by_name)
    assert "exit_code" in wandb_internal_pb2.RunExitRecord.DESCRIPTOR.fields_by_name
    # the CRC is zlib's CRC-32 of the type byte and the data: change one data byte and the chunk is refused
    bad = bytearray(data)
    crc, length, _ = struct.unpack("<IHB", data[7:14])
    bad[14 + length // 2] ^= 1
    with pytest.raises(cwb.CorruptRecord):
        list(cwb.read_records(bytes(bad[7:])))


@pytest.mark.parametrize("chunk", [64, 5000, 1 << 20])
def test_reading_in_chunks_gives_the_records_of_the_whole_file(tmp_path, chunk):
    """A run file is read a chunk at a time (a large one is never in memory whole): records across chunk
    boundaries, and records larger than a chunk, come out as from the whole file."""
    from rldiag.app.importers.common import whole_records

    tb = write_tensorboard(tmp_path / "tb", [(s, {"a": float(s), "b": -1.0}) for s in range(300)])
    wb = write_wandb(tmp_path / "wb", [(s, {"k": float(s)}) for s in range(300)], config={"big": "x" * 40_000})
    for f, read, start in ((tb, ctb.read_records, 0), (wb, cwb.read_records, 7)):
        whole = list(read(f.read_bytes()[start:], start))
        assert len(whole) > 300 and list(whole_records(f, start, read, chunk)) == whole
