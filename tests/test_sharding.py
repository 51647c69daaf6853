"""Sharded forward on a simulated 8-device CPU mesh equals the single-device forward."""

import pytest

from models.sharding import MeshConfig
from tests.conftest import run_check


def test_sharded_forward_matches_single_device():
  stdout = run_check("sharding_check")
  assert stdout.count("ok ") == 2, stdout


def test_mesh_config_errors():
  assert MeshConfig(data=2, fsdp=-1, tensor=2).shape(8) == (2, 2, 2, 1, 1)
  assert MeshConfig(fsdp=-1, sequence=4).shape(8) == (1, 2, 1, 1, 4)
  with pytest.raises(ValueError, match="needs 16 devices"):
    MeshConfig(data=2, fsdp=2, tensor=4).shape(8)
  with pytest.raises(ValueError, match="not divisible"):
    MeshConfig(data=3, fsdp=-1).shape(8)
