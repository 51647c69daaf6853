"""Shared fixtures: tiny models built once per test session; the runner of the multi-device
check scripts."""

import os
import subprocess
import sys
from pathlib import Path

# libtpu (a test dependency: tests compile for TPU topologies ahead of time) would otherwise
# probe for a TPU at start-up in every process; the tests run on the CPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are tiny and compiled once or twice each: compiling them is most of the
# suite's time, running them little. XLA:CPU's lowest backend optimisation level and its
# classic elemental emitters instead of the MLIR fusion emitters (same HLO passes, another
# code generator) halve the compile time of a model's train step (slower code, the same
# results within the references' tolerances). Subprocesses inherit them; `run_check` passes
# them to the check scripts, which add their simulated device count.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()

import jax
import pytest

from models.config import ModelConfig
from models import transformer

# fp32 everywhere: tests compare against references at 1e-5.
jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parents[1]


def run_check(module: str, *args: str, timeout: int = 600) -> str:
  """Runs `python -m tests.<module> ARGS` in a fresh process and returns its stdout.

  The scripts get `FAST_COMPILE_FLAGS` as their XLA_FLAGS (not the inherited ones) and add
  their simulated device count before importing JAX. Fails the test on a non-zero exit, with
  the output.
  """
  env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=FAST_COMPILE_FLAGS)
  proc = subprocess.run([sys.executable, "-m", f"tests.{module}", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  return proc.stdout

TINY_DENSE = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=96, qkv_bias=True,
                         initializer_range=0.1)
TINY_MOE_MLA = ModelConfig(
    vocab_size=128, hidden_size=64, num_layers=3, num_heads=4, intermediate_size=96,
    attention="mla", q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, num_experts=8, num_shared_experts=1, experts_per_token=2, n_group=2,
    topk_group=1, score_func="sigmoid", router_bias=True, routed_scaling_factor=2.0,
    first_k_dense_replace=1, moe_intermediate_size=32, rope_type="yarn", rope_factor=4.0,
    rope_original_max_position=32, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
    initializer_range=0.1)


@pytest.fixture(scope="session")
def dense_model():
  return transformer.init(TINY_DENSE, seed=0)


@pytest.fixture(scope="session")
def moe_mla_model():
  model = transformer.init(TINY_MOE_MLA, seed=0)
  bias = model.moe_layers.mlp.router_bias
  bias[...] = 0.1 * jax.random.normal(jax.random.key(7), bias[...].shape)  # non-zero selection bias
  return model


# The longest files first: `make test` hands whole files to its two workers in collection order
# (with --no-loadscope-reorder; xdist's default order is by test count), so the long ones start
# early and short files fill the end instead of one long file running alone (the order within a
# file is unchanged). Longest first, from `--durations`.
LONGEST_FIRST = ("test_rl.py", "test_sft.py", "test_notebook.py", "test_aot.py",
                 "test_vmap_grad.py", "test_expert_parallel.py", "test_cluster.py",
                 "test_context_parallel.py", "test_blackbox_rollouts.py",
                 "test_constrained_decoding.py", "test_tree_training.py",
                 "test_sandbox_isolation.py",
                 "test_aot_lora.py", "test_lora.py", "test_step.py", "test_environments.py",
                 "test_swe_history.py", "test_models.py", "test_hf_sharded.py",
                 "test_optimizers.py", "test_multihost.py", "test_routing_replay.py",
                 "test_rejection.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
