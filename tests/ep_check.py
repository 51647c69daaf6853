"""Run in a subprocess with 8 simulated CPU devices (tests/test_expert_parallel.py): the
all-to-all expert-parallel dispatch equals the global ragged dispatch.

The ragged exchange: on CPU, its emulation equals a NumPy transcription of the documented
semantics of `jax.lax.ragged_all_to_all` (slices at offsets with gaps, several per device), so
the offsets the dispatch computes, checked through the emulation below, are those the real
collective gets on TPU and GPU; compiling for TPU selects the real one. Model level, on meshes
(fsdp 2, expert 4) in rounds of 4 of each device's 10 tokens and (expert 8) in one round,
against the single-device model: log-probs, expert choices, load (hence the aux-loss-free bias
step), the gradient of every parameter and a forward with replayed (shifted) choices; the
compiled program exchanges tokens by the emulated all-to-all and all-gathers neither an expert
weight stack nor all tokens. Function level, on (fsdp 2, tensor 2, expert 2), in one round and
in rounds of 3 of 8 tokens: a token count the mesh does not divide, repeated experts within a
token, and a tensor-split expert width, against the all-experts formula, values and gradients.
Routed-expert LoRA adapters on (fsdp 2, expert 4) take the global dispatch, with a warning;
int8-quantized expert stacks take the all-to-all, with the single-device model's logits.
"""

import os

# run_check passes the suite's light CPU backend flags: compiling dominates the run time here
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import re  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models import expert_parallel, lora, sharding, transformer  # noqa: E402
from models.kernels import attention  # noqa: E402
from models.moe import update_router_bias  # noqa: E402
from tests.conftest import TINY_MOE_MLA  # noqa: E402

CFG = TINY_MOE_MLA  # 8 experts, top-2 of 2 groups, sigmoid + bias, a shared expert
ROWS, SEQ = 8, 10  # 80 tokens: no other dimension of the model is 80 or 160
START = time.time()


def say(what: str) -> None:
  print(f"ok {what} ({time.time() - START:.1f} s)", flush=True)


def assert_grad_close(a, b, what):
  """The design's gradient tolerance per leaf: ‖Δg‖ ≤ 1e-5·‖g‖ + 1e-7."""
  err, norm = float(jnp.linalg.norm(a - b)), float(jnp.linalg.norm(b))
  assert err <= 1e-5 * norm + 1e-7, (what, err, norm)
  return err / max(norm, 1e-30)


def make_step(graphdef):
  """jit((params, rest, tokens, positions, end, replay) -> (log-probs, aux, grads, replayed
  log-probs)) with the loss = -mean next-token log-prob."""
  def logprobs(model, tokens, positions, end, **kwargs):
    logits, aux = model(tokens, positions, end, **kwargs)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    return jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0], aux

  def step(params, rest, tokens, positions, end, replay):
    def loss(p):
      lp, aux = logprobs(nnx.merge(graphdef, p, rest), tokens, positions, end)
      return -lp.mean(), (lp, aux)
    (_, (lp, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    replayed, _ = logprobs(nnx.merge(graphdef, params, rest), tokens, positions, end,
                           expert_ids=replay)
    return lp, aux, grads, replayed
  return jax.jit(step)


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
  """Result shapes of the all-gather ops of a compiled program's text."""
  shapes = []
  for result in re.findall(r"= (.*?) all-gather(?:-start)?\(", hlo):
    for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", result):
      shapes.append(tuple(int(d) for d in dims.split(",") if d))
  return shapes


def holds_expert_stack(shape: tuple[int, ...]) -> bool:
  """Whether a shape contains a whole [experts, hidden, width] or [experts, width, hidden]."""
  e, d, f = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size
  return any(shape[i:i + 3] in ((e, d, f), (e, f, d)) for i in range(len(shape)))


def hlo_reader_checks():
  line = ("%all-gather.3 = f32[2,8,64,32]{3,2,1,0} all-gather(f32[2,2,64,32]{3,2,1,0} %p), "
          "replica_groups=[2,4]<=[8], dimensions={1}")
  assert gathered_shapes(line) == [(2, 8, 64, 32)] and holds_expert_stack((2, 8, 64, 32))
  assert not holds_expert_stack((2, 2, 64, 32))


def model_checks():
  model = transformer.init(CFG, seed=0)
  bias = model.moe_layers.mlp.router_bias
  bias[...] = 0.1 * jax.random.normal(jax.random.key(7), bias[...].shape)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  step = make_step(graphdef)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (ROWS, SEQ)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), tokens.shape)
  end = jnp.full(tokens.shape, SEQ, jnp.int32)
  replay = jnp.zeros((CFG.num_moe_layers, ROWS, SEQ, CFG.experts_per_token), jnp.int32)
  ref_lp, ref_aux, ref_grads, _ = step(params, rest, tokens, positions, end, replay)
  # replay other experts than the router picks: each choice shifted by one expert
  replay = (ref_aux["expert_ids"] + 1) % CFG.num_experts
  ref_lp, ref_aux, ref_grads, ref_replayed = step(params, rest, tokens, positions, end, replay)
  assert np.abs(ref_replayed - ref_lp).max() > 1e-3  # the replay does change the experts
  say("single-device reference")

  # 10 tokens per device: in 3 rounds of 4 (the last padded), and in one round
  for mesh_cfg, chunk in ((sharding.MeshConfig(fsdp=2, expert=4), 4),
                          (sharding.MeshConfig(fsdp=1, expert=8), 0)):
    mesh = sharding.make_mesh(mesh_cfg)
    cfg = CFG.replace(moe_dispatch_chunk=chunk)
    graphdef_m, _, _ = nnx.split(transformer.abstract(cfg), nnx.Param, ...)  # cfg is static
    _, *placed = nnx.split(sharding.shard_model(model, mesh), nnx.Param, ...)
    inputs = [jax.device_put(a, sharding.batch_sharding(CFG, mesh))
              for a in (tokens, positions, end)]
    with jax.set_mesh(mesh):
      assert expert_parallel.plan(cfg) is not None
      args = (*placed, *inputs, replay)
      traced = make_step(graphdef_m).trace(*args)
      compiled = traced.lower().compile()
      hlo = compiled.as_text()
      lp, aux, grads, replayed = compiled(*args)
    assert ("length=3" in str(traced.jaxpr)) == bool(chunk)  # the rounds' loop
    assert "all-to-all" in hlo and "ragged-all-to-all" not in hlo  # the emulation on CPU
    gathered = gathered_shapes(hlo)
    assert not [s for s in gathered if holds_expert_stack(s)], gathered
    # nor every token (routing included): each device works on its own
    assert not [s for s in gathered if s[:1] in ((ROWS * SEQ,), (ROWS * SEQ * 2,))], gathered
    assert len(lp.sharding.device_set) == 8
    np.testing.assert_array_equal(aux["expert_ids"], ref_aux["expert_ids"])
    lp_err = float(np.abs(lp - ref_lp).max() / np.abs(ref_lp).max())
    replay_err = float(np.abs(replayed - ref_replayed).max() / np.abs(ref_replayed).max())
    assert lp_err <= 1e-5 and replay_err <= 1e-5, (lp_err, replay_err)
    np.testing.assert_allclose(aux["moe_load"], ref_aux["moe_load"], rtol=1e-6, atol=1e-7)
    rate = CFG.bias_update_rate
    np.testing.assert_array_equal(update_router_bias(bias[...], aux["moe_load"], rate),
                                  update_router_bias(bias[...], ref_aux["moe_load"], rate))
    worst = max(assert_grad_close(a, b, jax.tree_util.keystr(path)) for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)))
    say(f"{dict(mesh.shape)}: rel |Δlogprobs| {lp_err:.1e}, replayed {replay_err:.1e}, "
        f"worst leaf ‖Δg‖/‖g‖ {worst:.1e}")


def dense_experts(x, ids, gates, w_gate, w_up, w_down):
  """Every expert on every token, combined by the gates (repeated choices add up)."""
  h = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate)) * jnp.einsum("td,edf->tef", x, w_up)
  combine = jnp.zeros((x.shape[0], w_gate.shape[0])).at[
      jnp.arange(x.shape[0])[:, None], ids].add(gates)
  return jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", h, w_down))


def function_checks():
  e, d, f, k, t = 8, 16, 12, 3, 30  # 30 tokens: padded to a multiple of the 4 token shards
  keys = jax.random.split(jax.random.key(1), 6)
  x = jax.random.normal(keys[0], (t, d))
  ids = jax.random.randint(keys[1], (t, k), 0, e).at[:5].set(0)  # repeated experts included
  gates = jax.random.uniform(keys[2], (t, k))
  w = [0.3 * jax.random.normal(keys[3 + i], shape) for i, shape in
       enumerate(((e, d, f), (e, d, f), (e, f, d)))]
  cot = jax.random.normal(jax.random.key(2), (t, d))
  cfg = CFG.replace(hidden_size=d, moe_intermediate_size=f, experts_per_token=k,
                    moe_dispatch="all_to_all")

  def loss(fn, x, gates, w):
    return (fn(x, ids, gates, *w) * cot).sum()

  want, want_grads = jax.value_and_grad(lambda *a: loss(dense_experts, *a), (0, 1, 2))(x, gates, w)
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, tensor=2, expert=2))
  for chunk in (0, 3):  # 8 tokens per device: one round; 3 rounds of 3 (the last padded)
    with jax.set_mesh(mesh):
      layout = expert_parallel.plan(cfg.replace(moe_dispatch_chunk=chunk))
      assert layout.expert_axes == ("expert",) and layout.mlp_axes == ("tensor",), layout
      ep = lambda *a: expert_parallel.all_to_all_experts(layout, *a)
      step = jax.jit(jax.value_and_grad(lambda *a: loss(ep, *a), (0, 1, 2)))
      traced = step.trace(x, gates, w)
      assert ("length=3" in str(traced.jaxpr)) == bool(chunk)  # the rounds' loop
      got, grads = step(x, gates, w)
      if chunk:  # compiling for TPU takes the real collective (lowered only: CPU has none)
        with attention.compile_for("tpu"):
          tpu = jax.jit(jax.value_and_grad(lambda *a: loss(ep, *a), (0, 1, 2))).lower(x, gates, w)
        assert "ragged_all_to_all" in tpu.as_text()
        assert "ragged_all_to_all" not in traced.lower().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    worst = max(assert_grad_close(a, b, "function") for a, b in zip(
        jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    say(f"function on (fsdp 2, tensor 2, expert 2), {t} tokens, top-{k} with repeats, "
        f"chunk {chunk}: worst ‖Δg‖/‖g‖ {worst:.1e}")


def ragged_all_to_all_reference(operands, outputs, input_offsets, send_sizes, output_offsets,
                                recv_sizes):
  """`jax.lax.ragged_all_to_all` over one axis in NumPy, transcribed from its documentation:
  per-device lists of operand [n, ...], output [m, ...] and [K] offsets and sizes."""
  a, k = len(operands), len(input_offsets[0])
  s = k // a  # slices per device
  results = [np.array(o) for o in outputs]
  for j in range(a):  # receiver
    # output_offsets_ = all_to_all(output_offsets, tiled=True): entry r comes from device r // s
    offsets_ = [output_offsets[r // s][j * s + r % s] for r in range(k)]
    for r in range(k):
      i, q = r // s, j * s + r % s  # the sender and its slice sent to j
      sent = operands[i][input_offsets[i][q]:input_offsets[i][q] + send_sizes[i][q]]
      assert recv_sizes[j][r] == send_sizes[i][q] == len(sent)
      results[j][offsets_[r]:offsets_[r] + recv_sizes[j][r]] = sent
  return results


def ragged_exchange_checks():
  """`_ragged_exchange` on CPU (the emulation) against the NumPy transcription: 8 devices, 2
  slices per device of random sizes (zero included), placed in both buffers in random order
  with gaps; rows nobody writes keep `output`."""
  a, s, n, m, width = 8, 2, 96, 96, 3
  k = a * s
  rng = np.random.default_rng(3)
  sizes = rng.integers(0, 5, (a, k))  # sizes[i, q]: rows of device i's slice q

  def place(slice_sizes):  # offsets of slices laid out in random order with gaps of 0-2 rows
    offsets, at = np.zeros(len(slice_sizes), np.int32), 0
    for q in rng.permutation(len(slice_sizes)):
      at += rng.integers(0, 3)
      offsets[q], at = at, at + slice_sizes[q]
    assert at <= n
    return offsets

  input_offsets = np.stack([place(sizes[i]) for i in range(a)])
  # receiver j's entry r: slice j·s + r % s of device r // s
  recv_sizes = np.stack([[sizes[r // s, j * s + r % s] for r in range(k)] for j in range(a)])
  recv_at = np.stack([place(recv_sizes[j]) for j in range(a)])
  output_offsets = np.stack([[recv_at[q // s, i * s + q % s] for q in range(k)]
                             for i in range(a)]).astype(np.int32)
  operands = rng.normal(size=(a, n, width)).astype(np.float32)
  outputs = rng.normal(size=(a, m, width)).astype(np.float32)
  want = ragged_all_to_all_reference(operands, outputs, input_offsets, sizes, output_offsets,
                                     recv_sizes)
  mesh = sharding.make_mesh(sharding.MeshConfig(expert=8))
  spec = jax.sharding.PartitionSpec("expert")
  exchange = jax.jit(jax.shard_map(
      lambda *arrays: expert_parallel._ragged_exchange(*(v[0] for v in arrays),
                                                       axis_name=("expert",))[None],
      mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
  got = exchange(operands, outputs, *(jnp.asarray(v, jnp.int32) for v in (
      input_offsets, sizes, output_offsets, recv_sizes)))
  np.testing.assert_array_equal(np.asarray(got), np.stack(want))
  say(f"ragged exchange (CPU emulation) = ragged_all_to_all's semantics: {a} devices, {s} "
      f"slices each, {int(sizes.sum())} rows")

def lora_checks():
  """Routed-expert LoRA adapters run the global dispatch on a mesh with an experts axis
  ("auto" warns that it leaves the all-to-all), with the single-device model's logits."""
  cfg = CFG.replace(lora_rank=4, lora_alpha=8.0, lora_modules=("attention", "mlp", "experts"))
  model = transformer.with_adapters(transformer.init(CFG, seed=0), cfg)
  adapters = nnx.state(model, nnx.LoRAParam)
  nnx.update(model, jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), adapters))  # B != 0
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (ROWS, SEQ)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), tokens.shape)
  end = jnp.full(tokens.shape, SEQ, jnp.int32)
  forward = nnx.jit(lambda m, *a: m(*a)[0])
  ref = np.asarray(forward(model, tokens, positions, end))
  mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=2, expert=4))
  inputs = [jax.device_put(a, sharding.batch_sharding(cfg, mesh))
            for a in (tokens, positions, end)]
  with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = np.asarray(forward(sharding.shard_model(model, mesh), *inputs))
  assert any("global MoE dispatch" in str(w.message) for w in caught), caught
  err = float(np.abs(got - ref).max() / np.abs(ref).max())
  assert err <= 1e-5, err
  # int8-quantized expert stacks travel through the all-to-all dispatch as they are
  quantized = lora.quantize(transformer.init(CFG, seed=0), CFG, "int8", transformer.Transformer)
  ref_q = np.asarray(forward(quantized, tokens, positions, end))
  with jax.set_mesh(mesh):
    assert expert_parallel.plan(CFG) is not None
    got_q = np.asarray(forward(sharding.shard_model(quantized, mesh), *inputs))
  err_q = float(np.abs(got_q - ref_q).max() / np.abs(ref_q).max())
  assert err_q <= 1e-5, err_q
  say(f"routed-expert LoRA on an experts mesh: global dispatch, logits rel err {err:.1e}; "
      f"int8 experts, all-to-all: {err_q:.1e}")


if __name__ == "__main__":
  assert len(jax.devices()) == 8
  hlo_reader_checks()
  ragged_exchange_checks()
  function_checks()
  model_checks()
  lora_checks()
