"""Expert parallelism: the all-to-all dispatch (whole and in rounds) equals the global ragged
dispatch on simulated 8-device CPU meshes, and its ragged exchange's CPU emulation follows
`jax.lax.ragged_all_to_all`'s semantics (tests/ep_check.py, in a subprocess); the dispatch
choice and settings."""

import pytest

from models import expert_parallel
from models.config import ModelConfig
from tests.conftest import TINY_MOE_MLA, run_check


def test_all_to_all_dispatch_matches_global_dispatch():
  stdout = run_check("ep_check")
  assert stdout.count("ok ") == 7, stdout


def test_dispatch_choice_without_a_mesh():
  assert expert_parallel.plan(TINY_MOE_MLA) is None  # "auto": the global dispatch
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch='all_to_all'"):
    expert_parallel.plan(TINY_MOE_MLA.replace(moe_dispatch="all_to_all"))
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch="):
    ModelConfig(num_experts=8, moe_dispatch="ragged")
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch="):
    ModelConfig(num_experts=8, moe_impl="dense", moe_dispatch="all_to_all")
  with pytest.raises(ValueError, match="ModelConfig.moe_dispatch_chunk=-1: must be >= 0"):
    ModelConfig(num_experts=8, moe_dispatch_chunk=-1)
