"""trainer/metrics.py and trainer/report.py: JSONL, TensorBoard events (read back by an
independent decoder: protobuf's own parser on a descriptor built here), W&B, timers, report."""

import json
import math
import os
import struct
import sys
import types

import google_crc32c
import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from trainer import metrics as metrics_lib
from trainer.metrics import MetricsWriter, Timer, read_jsonl
from trainer.report import report


def _event_class():
  """tensorflow's Event / Summary / SessionLog messages (the fields we use), built at run
  time so that protobuf itself, not our encoder, decodes the files."""
  f = descriptor_pb2.FieldDescriptorProto
  proto = descriptor_pb2.FileDescriptorProto(name="arbor_test_event.proto", package="t",
                                             syntax="proto3")
  summary = proto.message_type.add(name="Summary")
  value = summary.nested_type.add(name="Value")
  value.field.add(name="tag", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
  value.field.add(name="simple_value", number=2, type=f.TYPE_FLOAT, label=f.LABEL_OPTIONAL)
  summary.field.add(name="value", number=1, type=f.TYPE_MESSAGE, label=f.LABEL_REPEATED,
                    type_name=".t.Summary.Value")
  session_log = proto.message_type.add(name="SessionLog")
  session_log.field.add(name="status", number=1, type=f.TYPE_INT32, label=f.LABEL_OPTIONAL)
  event = proto.message_type.add(name="Event")
  event.field.add(name="wall_time", number=1, type=f.TYPE_DOUBLE, label=f.LABEL_OPTIONAL)
  event.field.add(name="step", number=2, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
  event.field.add(name="file_version", number=3, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
  event.field.add(name="summary", number=5, type=f.TYPE_MESSAGE, label=f.LABEL_OPTIONAL,
                  type_name=".t.Summary")
  event.field.add(name="session_log", number=7, type=f.TYPE_MESSAGE, label=f.LABEL_OPTIONAL,
                  type_name=".t.SessionLog")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(proto)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Event"))


Event = _event_class()


def read_events(path):
  """TFRecords -> Event messages, checking both masked CRC32Cs of every record."""
  def masked(data):
    crc = google_crc32c.value(data)
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF

  data, pos, events = open(path, "rb").read(), 0, []
  while pos < len(data):
    (length,) = struct.unpack_from("<Q", data, pos)
    (length_crc,) = struct.unpack_from("<I", data, pos + 8)
    assert length_crc == masked(data[pos:pos + 8])
    payload = data[pos + 12:pos + 12 + length]
    (payload_crc,) = struct.unpack_from("<I", data, pos + 12 + length)
    assert payload_crc == masked(payload)
    event = Event()
    event.ParseFromString(payload)
    events.append(event)
    pos += 16 + length
  return events


def event_files(logdir):
  return sorted(os.path.join(logdir, n) for n in os.listdir(logdir) if "tfevents" in n)


def scalars(events):
  return {(e.step, v.tag): v.simple_value for e in events if e.HasField("summary")
          for v in e.summary.value}


def test_jsonl_and_tensorboard_read_back(tmp_path):
  with MetricsWriter(tmp_path, total_steps=3, progress=False) as w:
    w.write(0, {"loss": jnp.float32(2.5), "reward": {"mean": np.float64(0.25), "n": 8},
                "ids": ["a", "b"], "note": "warmup", "hist": np.arange(3)})
    w.write(1, {"loss": 1.5, "kl": float("nan"), "flag": True})
  steps = read_jsonl(tmp_path / "metrics.jsonl")
  assert list(steps) == [0, 1]
  assert steps[0]["loss"] == 2.5 and steps[0]["reward/mean"] == 0.25
  assert steps[0]["reward/n"] == 8 and steps[0]["ids"] == ["a", "b"]
  assert steps[0]["hist"] == [0, 1, 2] and steps[0]["note"] == "warmup"
  assert math.isnan(steps[1]["kl"]) and steps[1]["flag"] is True
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2 and all(json.loads(line)["wall_time"] > 0 for line in lines)

  (path,) = event_files(tmp_path)
  events = read_events(path)
  assert events[0].file_version == "brain.Event:2"
  got = scalars(events)
  assert got == pytest.approx({(0, "loss"): 2.5, (0, "reward/mean"): 0.25, (0, "reward/n"): 8.0,
                               (1, "loss"): 1.5, (1, "kl"): float("nan"), (1, "flag"): 1.0},
                              nan_ok=True)  # lists and strings stay out of TensorBoard


def test_resume_supersedes_later_steps(tmp_path):
  with MetricsWriter(tmp_path, progress=False) as w:
    for step in range(6):
      w.write(step, {"loss": float(step)})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "loss": 6.')  # a line a kill cut short
  assert list(read_jsonl(tmp_path / "metrics.jsonl")) == [0, 1, 2, 3, 4, 5]  # skipped
  with MetricsWriter(tmp_path, start_step=3, progress=False) as w:  # restored checkpoint: 2
    w.write(3, {"loss": 30.0})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["loss"] for line in lines] == [0.0, 1.0, 2.0, 30.0]
  superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
  assert [line[:11] for line in superseded] == ['{"step": 3,', '{"step": 4,', '{"step": 5,',
                                                '{"step": 6,']
  first, second = event_files(tmp_path)
  starts = [e.step for e in read_events(second) if e.HasField("session_log")]
  assert starts == [3] and read_events(second)[1].session_log.status == 1  # START
  assert scalars(read_events(second)) == {(3, "loss"): 30.0}


def test_progress_bar_shows_key_numbers(tmp_path, capsys):
  with MetricsWriter(tmp_path, total_steps=10, bar_keys=("loss", "pass_rate")) as w:
    w.write(0, {"loss": 0.123456, "pass_rate": 0.5, "other": 1})
  err = capsys.readouterr().err
  assert "loss=0.1235" in err and "pass_rate=0.5" in err and "other" not in err
  # steps count from 1: after step 2 of 10 the bar stands at 2/10; a run resumed at step 6
  # starts at 5/10
  with MetricsWriter(tmp_path / "a", total_steps=10, tensorboard=False) as w:
    w.write(1, {"loss": 1.0})
    w.write(2, {"loss": 1.0})
  err = capsys.readouterr().err
  assert "2/10" in err and "3/10" not in err
  with MetricsWriter(tmp_path / "b", total_steps=10, start_step=6, tensorboard=False) as w:
    assert "5/10" in capsys.readouterr().err


def test_wandb_absent_is_not_an_error(tmp_path, monkeypatch, caplog):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with MetricsWriter(tmp_path, wandb_project="arbor", progress=False) as w:
    w.write(0, {"loss": 1.0})
  assert "wandb is not installed" in caplog.text
  assert list(read_jsonl(tmp_path / "metrics.jsonl")) == [0]


def test_wandb_used_when_installed(tmp_path, monkeypatch):
  calls = []
  fake = types.ModuleType("wandb")
  fake.init = lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(id="run123")
  fake.log = lambda data, step: calls.append(("log", data, step))
  fake.finish = lambda: calls.append(("finish",))
  monkeypatch.setitem(sys.modules, "wandb", fake)
  with MetricsWriter(tmp_path, wandb_project="arbor", wandb_config={"lr": 1e-3},
                     progress=False) as w:
    w.write(4, {"loss": 1.0, "ids": ["x"]})
  with MetricsWriter(tmp_path, start_step=5, wandb_project="arbor", progress=False):
    pass
  assert calls[0][1]["project"] == "arbor" and calls[0][1]["config"] == {"lr": 1e-3}
  assert calls[0][1]["id"] is None and calls[3][1]["id"] == "run123"  # resumed: same run
  assert calls[1] == ("log", {"loss": 1.0}, 4) and calls[2] == ("finish",)


def test_non_primary_process_writes_nothing(tmp_path):
  with MetricsWriter(tmp_path / "m", primary=False) as w:
    w.write(0, {"loss": 1.0})
  assert not (tmp_path / "m").exists()


def test_remote_logdir_is_refused():
  with pytest.raises(ValueError, match="logdir"):
    MetricsWriter("gs://bucket/run", progress=False)


def test_timer(monkeypatch):
  now = [100.0]
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: now[0])
  timer = Timer()
  with timer.phase("rollout", tokens=300):
    now[0] += 2.0
  with timer.phase("train", tokens=100):
    now[0] += 1.0
  with timer.phase("rollout"):
    now[0] += 1.0
  now[0] += 1.0  # untimed work still counts in the step
  assert timer.flush() == {"time/rollout": 3.0, "time/train": 1.0, "time/step": 5.0,
                           "tokens_per_s": 80.0, "tokens_per_s/rollout": 100.0,
                           "tokens_per_s/train": 100.0}
  now[0] += 0.5
  assert timer.flush() == {"time/step": 0.5}


def write_run(logdir, seed, steps=30):
  rng = np.random.default_rng(seed)
  with MetricsWriter(logdir, progress=False) as w:
    for s in range(steps):
      w.write(s, {"loss": 2.0 - s / steps + 0.01 * rng.normal(), "reward": {"mean": s / steps},
                  "time": {"rollout": 1.0, "train": 0.5}, "ids": [f"{seed}-{s}"]})


def colour_pixels(image, hex_colour, tol=40):
  rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
  return np.abs(image[..., :3].astype(int) - rgb).sum(-1) < tol


def test_report_files(tmp_path):
  from PIL import Image
  write_run(tmp_path / "s0", 0)
  write_run(tmp_path / "s1", 1)
  tables = {"Held-out pass@1": [{"seed": 0, "SFT": 0.3125, "RL": 0.4721},
                                {"seed": 1, "SFT": 0.2981, "RL": 0.4555}],
            "RL - SFT, paired bootstrap": [{"mean": 0.1585, "95% low": 0.1012,
                                            "95% high": 0.2133}]}
  paths = report({"seed 0": str(tmp_path / "s0"), "seed 1": str(tmp_path / "s1")},
                 str(tmp_path), tables=tables)
  assert paths == {"png": str(tmp_path / "report.png"), "html": str(tmp_path / "report.html")}
  image = Image.open(paths["png"])
  assert image.format == "PNG" and image.width >= 1000 and image.height >= 600
  pixels = np.asarray(image.convert("RGB"))
  assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # not blank
  assert colour_pixels(pixels, "#1f77b4").sum() > 500  # C0: seed 0's curves
  assert colour_pixels(pixels, "#ff7f0e").sum() > 500  # C1: seed 1's curves
  page = open(paths["html"]).read()
  assert "data:image/png;base64," in page
  for text in ("Held-out pass@1", "0.4721", "0.2133", "95% low", "reward/mean", "time/train",
               "seed 1"):
    assert text in page


def test_report_curve_follows_the_data(tmp_path):
  from PIL import Image
  with MetricsWriter(tmp_path, progress=False) as w:
    for s in range(40):
      w.write(s, {"loss": 10.0 - s})  # falls from left to right
  with pytest.raises(ValueError, match="nope"):
    report(str(tmp_path), keys=["loss", "nope"])
  assert os.path.isfile(report(str(tmp_path), keys=["loss", "nope"], skip_missing=True)["png"])
  pixels = np.asarray(Image.open(report(str(tmp_path), keys=["loss"])["png"]).convert("RGB"))
  rows, cols = np.nonzero(colour_pixels(pixels, "#1f77b4"))
  left, right = rows[cols < np.median(cols)].mean(), rows[cols >= np.median(cols)].mean()
  assert left < right  # image rows grow downwards: the left half of the curve is higher
