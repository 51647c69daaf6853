"""Expert parallelism: the all-to-all dispatch equals the global ragged dispatch on simulated
8-device CPU meshes (tests/ep_check.py, in a subprocess), and the dispatch choice."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import expert_parallel
from models.config import ModelConfig
from tests.conftest import TINY_MOE_MLA


def test_all_to_all_dispatch_matches_global_dispatch():
  root = Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=str(root))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "tests.ep_check"], cwd=root, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  assert proc.stdout.count("ok ") == 4, proc.stdout


def test_dispatch_choice_without_a_mesh():
  assert expert_parallel.plan(TINY_MOE_MLA) is None  # "auto": the global dispatch
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch='all_to_all'"):
    expert_parallel.plan(TINY_MOE_MLA.replace(moe_dispatch="all_to_all"))
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch="):
    ModelConfig(num_experts=8, moe_dispatch="ragged")
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch="):
    ModelConfig(num_experts=8, moe_impl="dense", moe_dispatch="all_to_all")
