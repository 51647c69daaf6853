"""Sharded forward on a simulated 8-device CPU mesh equals the single-device forward."""

import os
import subprocess
import sys
from pathlib import Path

from models.sharding import MeshConfig
import pytest


def test_sharded_forward_matches_single_device():
  root = Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "tests.sharding_check"], cwd=root, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  assert proc.stdout.count("ok ") == 2, proc.stdout


def test_mesh_config_errors():
  assert MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == (2, 2, 2, 1)
  with pytest.raises(ValueError, match="needs 16 devices"):
    MeshConfig(data=2, fsdp=2, tensor=4).shape(8)
  with pytest.raises(ValueError, match="not divisible"):
    MeshConfig(data=3, fsdp=-1).shape(8)
