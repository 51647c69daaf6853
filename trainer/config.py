"""Reading an experiment config: its validation, and the typed configs the code takes from it.

Size: one validator per config section; the RL and serving sections are the ones to move out.

    validate(config, workdir)          # trainer.main, before any device is touched
    model_cfg = model_config(config)   # models.config.ModelConfig (preset / checkpoint + overrides)
    loss_cfg = loss_config(config)     # rl.losses.LossConfig
    data_cfg = data_config(config, sources=files)   # trainer.data.SFTDataConfig

The sections and their defaults are `configs/base.py` (every field carries a one-line comment
there; config files start from `configs.base.base_config()`):

  mode, seed, compile_cache_dir   what runs, the run's one seed, the persistent XLA cache
  allow_config_change   resume a workdir whose run was started with another config
  model        preset + overrides (ModelConfig fields), or init from hf:DIR / ckpt:DIR
  tokenizer    path and chat format, or a sentencepiece model trained for the demo
  mesh         device mesh axis sizes (data, fsdp, tensor, expert, sequence); -1 = the remaining
               devices
  optimizer    trainer.optim.OptimizerConfig fields (AdamW, Muon, MuonClip, schedule)
  loss         rl.losses.LossConfig fields
  data         SFT data: trainer.data.SFTDataConfig fields (the fixed BatchShape of a step
               included) + held-out files + generated demo episodes
  train        steps and the eval / checkpoint / log intervals
  checkpoint   keep-N, async saves
  metrics      where and how metrics are written, the end-of-run report
  rl, distill, eval   the RL / distillation loop (trainer/rl.py) and held-out evaluation
                      (trainer/evaluate.py)
  serve        the policy server (trainer/serve.py)

`validate` runs in a few seconds (JAX is imported, but no backend is started and nothing is
compiled): it checks every field and raises `ConfigError` naming the field, the value and the
valid choices. The choice lists come from the code that owns them (rl.losses.LOSSES,
rl.advantages.ADVANTAGES, envs.sandbox.BACKENDS, ...); this module owns only the run-level ones
(MODES, RL_LOOPS, ...). What needs the devices (the mesh's product, rows divisible by the data
axes) is checked by `trainer.main` right after `jax.distributed.initialize`.

One module (~875 lines): the section validators and the adapters share the field checks and
the error form, and a reader looks for "what does this field accept" in one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Optional

import ml_collections

from configs import base
from envs import branching, net, sandbox, task_environments, taskgen
from envs.chat import load_chat, load_tokenizer, make_chat, read_chat_templates
from envs.chat.formats import FORMATS, ChatFormat
from envs.verifiers.judge import parse_rubric
from models import hf
from models.config import ModelConfig
from models.presets import PRESETS, get_preset
from models import sharding
from models.sharding import MESH_AXES, MeshConfig
from rl import advantages, corrections, losses
from trainer import blackbox, demo_data, optim, selection
from trainer.data import SFTDataConfig

MODES = ("smoke", "sft", "rl", "distill", "eval", "serve", "demo", "reward_model")
RM_KINDS = ("orm", "prm")  # how the RL loop reads a reward model (trainer.reward_model)
JUDGE_FALLBACKS = ("skip", "group_mean")  # an episode the judge failed (trainer.judge_rewards)
RL_LOSSES_EXCLUDED = ("sft", "dpo")  # not on-policy RL losses (dpo needs preference pairs)
INIT_KINDS = ("random", "hf:<dir>", "ckpt:<dir>")
SFT_LOSSES = ("sft",)
RL_LOOPS = ("sync", "async")
RL_ROLLOUT_WORKERS = ("inprocess", "queue")
RL_ROLLOUTS = ("independent", "branching")
TREE_ADVANTAGES = ("treerl",)  # per call, from the group's tree (trainer.groups.advantages_of)
RL_REFERENCES = ("initial", "ckpt:<dir>")
TEACHER_CHOICE = ("by_domain", "single")
# The fields of the smoke config (configs/smoke.py), which predates the sections.
SMOKE_FIELDS = ("mode", "seed", "model", "batch", "seq", "decode_tokens")


class ConfigError(ValueError):
  """A bad config value; the message names the field, the value and the valid choices."""


# ----------------------------------------------------------------------------- helpers


def _fail(field: str, value: Any, expected: str) -> None:
  raise ConfigError(f"config.{field}={value!r}: expected {expected}")


def _int(config, field: str, minimum: int = 0, maximum: Optional[int] = None) -> int:
  value = _get(config, field)
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum and (
      maximum is None or value <= maximum)
  if not ok:
    _fail(field, value, f"an integer >= {minimum}" + ("" if maximum is None
                                                       else f" and <= {maximum}"))
  return value


def _number(config, field: str, low: float, high: float = math.inf, low_open: bool = False
            ) -> float:
  value = _get(config, field)
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value) and (value > low if low_open else value >= low)
        and value <= high)
  if not ok:
    _fail(field, value, f"a number in {'(' if low_open else '['}{low}, {high}]")
  return value


def _bool(config, field: str) -> bool:
  value = _get(config, field)
  if not isinstance(value, bool):
    _fail(field, value, "True or False")
  return value


def _choice(config, field: str, choices) -> str:
  value = _get(config, field)
  if value not in choices:
    _fail(field, value, f"one of {tuple(choices)}")
  return value


def _str(config, field: str) -> str:
  value = _get(config, field)
  if not isinstance(value, str):
    _fail(field, value, "a string")
  return value


def _paths(config, field: str) -> tuple[str, ...]:
  value = _get(config, field)
  if isinstance(value, str):
    value = (value,) if value else ()
  if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) and p for p in value):
    _fail(field, value, "a tuple of file paths, e.g. \"('a.jsonl', 'b.jsonl')\"")
  return tuple(value)


def _get(config, field: str) -> Any:
  node = config
  for part in field.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f"config.{field} is missing (configs start from "
                        "configs.base.base_config())")
    node = node[part]
  return node


def _known_keys(config, reference, where: str) -> None:
  """Every key of `config` exists in `reference` (both ConfigDicts), recursively, except the
  free-form model.overrides (checked against ModelConfig)."""
  for key in config.keys():
    path = f"{where}.{key}" if where else key
    if key not in reference:
      raise ConfigError(f"config.{path}: unknown field; valid fields"
                        f"{' of config.' + where if where else ''}: {sorted(reference.keys())}")
    if path == "model.overrides":
      continue
    if isinstance(config[key], ml_collections.ConfigDict) and isinstance(
        reference[key], ml_collections.ConfigDict):
      _known_keys(config[key], reference[key], path)


def check_override_keys(config: ml_collections.ConfigDict, keys) -> None:
  """Checks that every dotted `--config.KEY` names an existing field.

  ml_collections would fail with an AttributeError traceback instead.

  Args:
    config: the config file's ConfigDict, before the overrides are applied.
    keys: the dotted keys of the command line's overrides, e.g. "train.steps".

  Raises:
    ConfigError: a key names no field; the message lists the fields where it stops.
  """
  for key in keys:
    node, done = config, []
    for part in key.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        where = "config." + ".".join(done) if done else "config"
        fields = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        extra = (" (model.overrides takes only the fields the config file lists; add others "
                 "there)" if done[-2:] == ["model", "overrides"] else "")
        raise ConfigError(f"--config.{key}: {where} has no field {part!r}; fields there: "
                          f"{fields}{extra}")
      node = node[part]
      done.append(part)


def init_kind(init: str) -> tuple[str, str]:
  """Splits config.model.init into its kind and directory.

  Args:
    init: "random", "hf:DIR" or "ckpt:DIR".

  Returns:
    ("random", ""), ("hf", DIR) or ("ckpt", DIR).

  Raises:
    ConfigError: any other value.
  """
  kind, sep, path = init.partition(":")
  if init == "random":
    return "random", ""
  if sep and kind in ("hf", "ckpt") and path:
    return kind, path
  raise ConfigError(f"config.model.init={init!r}: expected one of {INIT_KINDS}")


def is_remote(path: str) -> bool:
  """Whether `path` is a URL (`gs://...`) rather than a local path."""
  return "://" in path


def overrides(config) -> dict:
  """config.model.overrides without the unset (None) fields; `sharding_rules`, if any set,
  as {logical axis: mesh axes} (`models.sharding.replace_rules`)."""
  out = {k: v for k, v in config.model.overrides.to_dict().items() if v is not None}
  if isinstance(out.get("sharding_rules"), dict):
    rules = {k: v for k, v in out.pop("sharding_rules").items() if v is not None}
    if rules:
      out["sharding_rules"] = rules
  return out


def _with_overrides(cfg, over: dict):
  """cfg.replace(**over), sharding rule changes applied to cfg's own rules."""
  if isinstance(over.get("sharding_rules"), dict):
    over = dict(over, sharding_rules=sharding.replace_rules(cfg.sharding_rules,
                                                            over["sharding_rules"]))
  return cfg.replace(**over)


def model_config(config):
  """The ModelConfig the run trains.

  Args:
    config: the experiment config (smoke configs, which have no model.init, mean "random").

  Returns:
    The preset (init="random") or the checkpoint's architecture (hf:DIR config.json,
    ckpt:DIR model_config.json), with `model.overrides` applied.

  Raises:
    ConfigError: a bad model.init, or ModelConfig rejects the result.
  """
  init = config.model.get("init", "random")  # smoke configs have no init
  kind, path = init_kind(init)
  over = {**overrides(config), **lora_fields(config)}
  try:
    if kind == "random":
      return _with_overrides(get_preset(config.model.preset), over)
    if kind == "hf":
      return _with_overrides(hf.config_from_hf(hf.read_hf_config(path)), over)
    with open(os.path.join(path, "model_config.json")) as f:
      return _with_overrides(hf.config_from_json(json.load(f)), over)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.model (init={init!r}, overrides {over}): {e}") from e


def lora_fields(config) -> dict:
  """The ModelConfig LoRA fields of config.model.lora (none for configs without the section)."""
  lora = config.model.get("lora")
  if lora is None:
    return {}
  modules = lora.modules if isinstance(lora.modules, (tuple, list)) else lora.modules.split(",")
  return {"lora_rank": lora.rank, "lora_alpha": float(lora.alpha),
          "lora_dropout": float(lora.dropout),
          "lora_modules": tuple(m.strip() for m in modules if m.strip()),
          "lora_experts": lora.get("experts", "per_expert"),
          "lora_rslora": lora.get("rslora", False),
          "base_qtype": lora.get("base_qtype")}


def data_config(config, *, sources: tuple[str, ...] = (), eval: bool = False):
  """The trainer.data.SFTDataConfig of config.data.

  Args:
    config: the experiment config.
    sources: the JSONL files to read.
    eval: held-out data: no shuffling, one epoch.

  Returns:
    The SFTDataConfig.

  Raises:
    ConfigError: SFTDataConfig rejects a field (named config.data.FIELD).
  """
  d = config.data
  kw = dict(sources=tuple(sources), row_len=d.row_len, rows_per_batch=d.rows_per_batch,
            microbatches=d.microbatches, max_seqs=d.max_seqs, seq_len=d.seq_len, seed=d.seed,
            shuffle=d.shuffle and not eval, num_epochs=1 if eval else (d.num_epochs or None),
            group_by=d.group_by, max_group_size=d.max_group_size or None,
            mask_tool_errors=d.mask_tool_errors, skip_bad=d.skip_bad,
            num_threads=d.num_threads, prefetch=d.prefetch)
  try:
    return SFTDataConfig(**kw)
  except ValueError as e:
    raise ConfigError(re.sub(r"^SFTDataConfig\.", "config.data.", str(e))) from e


def loss_config(config):
  """The rl.losses.LossConfig of config.loss, checked.

  Args:
    config: the experiment config.

  Returns:
    The LossConfig.

  Raises:
    ConfigError: an unknown field or a bad value (named config.loss.FIELD).
  """
  fields = {f.name for f in dataclasses.fields(losses.LossConfig)}
  given = config.loss.to_dict()
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ConfigError(f"config.loss: unknown fields {unknown}; valid fields: {sorted(fields)}")
  if given.get("name") not in losses.LOSSES:
    _fail("loss.name", given.get("name"), f"one of {tuple(sorted(losses.LOSSES))}")
  try:
    cfg = losses.LossConfig(**given)
    losses.check_config(cfg)
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e).replace("LossConfig.", "config.loss.")) from e
  return cfg


def tokenizer_source(config, workdir: str) -> str:
  """Where the run's tokenizer is.

  Args:
    config: the experiment config.
    workdir: the run's workdir (where a demo tokenizer is trained).

  Returns:
    tokenizer.path when set, else `workdir`/tokenizer when the demo trains one, else the
    model.init checkpoint's (an HF directory, a `models.hf import` directory's hf_extra/, an
    Arbor run's tokenizer/ or the tokenizer.path of its config.json).

  Raises:
    ConfigError: nothing provides a tokenizer.
  """
  if config.tokenizer.path:
    return config.tokenizer.path
  if config.tokenizer.train_vocab_size > 0:
    return os.path.join(workdir, "tokenizer")
  kind, path = init_kind(config.model.init)
  if kind == "hf":
    return path
  if kind == "ckpt":
    for sub in ("hf_extra", "tokenizer"):  # a `models.hf import` dir, an Arbor run's workdir
      if os.path.isdir(os.path.join(path, sub)):
        return os.path.join(path, sub)
    source = os.path.join(path, "config.json")  # an Arbor run given a tokenizer.path
    if os.path.isfile(source):
      with open(source) as f:
        given = json.load(f).get("tokenizer", {}).get("path", "")
      if given:
        return given
  raise ConfigError("config.tokenizer.path='': nothing provides a tokenizer; set "
                    "tokenizer.path, tokenizer.train_vocab_size > 0 (demo), or model.init to an "
                    "hf:<dir> / ckpt:<dir> that holds one")


# ----------------------------------------------------------------------------- validation


def validate(config: ml_collections.ConfigDict, workdir: Optional[str] = None, *,
             files: bool = True) -> None:
  """Checks every field of an experiment config (see the module doc).

  Args:
    config: the experiment config.
    workdir: the run's --workdir (None: skip the checks that need it).
    files: also check that the data, task and tokenizer files exist (False: only what defines
      the run's programs, as `trainer.aot` compiles them without data).

  Raises:
    ConfigError: the first bad field, with its value and the valid choices.
  """
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"config: expected an ml_collections.ConfigDict, got "
                      f"{type(config).__name__}")
  mode = _choice(config, "mode", MODES)
  _int(config, "seed", 0, 2**32 - 1)
  if workdir is not None and (not isinstance(workdir, str) or not workdir):
    raise ConfigError(f"--workdir={workdir!r}: expected a directory (local path or gs://)")
  if mode == "smoke":
    _validate_smoke(config)
    return
  if mode == "demo":
    _validate_demo(config, workdir)
    return
  _known_keys(config, base.base_config(), "")
  _str(config, "compile_cache_dir")
  _bool(config, "allow_config_change")
  _validate_model(config)
  _validate_mesh(config)
  _validate_train(config, mode)  # before the optimizer, whose schedule spans train.steps
  _validate_optimizer(config)
  loss = loss_config(config)
  if mode == "sft" and loss.name not in SFT_LOSSES:
    _fail("loss.name", loss.name, f"one of {SFT_LOSSES} for mode 'sft'")
  if mode in ("rl", "distill") and loss.name in RL_LOSSES_EXCLUDED:
    rl_losses = tuple(sorted(set(losses.LOSSES) - set(RL_LOSSES_EXCLUDED)))
    _fail("loss.name", loss.name, f"one of {rl_losses} for mode {mode!r}")
  _validate_data(config, mode if files else "")
  _validate_tokenizer(config, mode, workdir)
  _int(config, "checkpoint.keep", 1)
  _bool(config, "checkpoint.async_save")
  _validate_metrics(config, workdir)
  _validate_rl(config)
  _validate_distill(config)
  _validate_eval(config)
  _validate_serve(config)
  _validate_reward_model(config, mode, files)
  _validate_judge_reward(config)
  if files and mode in ("rl", "distill", "eval", "serve"):
    tokenizer_source(config, workdir or ".")
  if files and config.tokenizer.chat_format == "template":
    _check_template(config, workdir or ".")
  if mode == "rl" or mode == "distill":
    _validate_rl_mode(config, files)
  if mode == "distill" and not config.distill.teachers:
    raise ConfigError("config.distill.teachers=(): mode 'distill' needs at least one teacher "
                      "'domain=ckpt:<dir>'")
  if mode == "eval" and config.eval.selection != "none" and config.eval.samples < 2:
    _fail("eval.samples", config.eval.samples, f"an integer >= 2 for eval.selection="
          f"{config.eval.selection!r} (it selects one of several samples)")


def _validate_rl_mode(config, files: bool) -> None:
  """What only an active RL loop needs."""
  rl = config.rl
  if rl.loop == "async" and rl.max_staleness < 1:
    _fail("rl.max_staleness", rl.max_staleness, "an integer >= 1 with rl.loop='async'")
  if rl.rollout_workers == "queue" and rl.max_staleness < 1:
    # remote workers go on sampling while the trainer trains: their groups are >= 1 behind
    _fail("rl.max_staleness", rl.max_staleness, "an integer >= 1 with rl.rollout_workers="
          "'queue' (workers sample while the trainer trains)")
  if rl.rollout_workers == "queue" and not rl.queue_url:
    _fail("rl.queue_url", rl.queue_url, "'memory' or a redis:// URL with rl.rollout_workers="
          "'queue'")
  if files and rl.tasks and not os.path.isfile(rl.tasks):
    _fail("rl.tasks", rl.tasks, "a task JSONL file (envs.tasks) or '' (generated tasks)")
  if files and rl.get("swe_mirror") and not os.path.isdir(rl.swe_mirror):
    _fail("rl.swe_mirror", rl.swe_mirror, "a directory of git mirrors (owner__name.git) or ''")
  if rl.max_new_tokens >= rl.max_context_tokens:
    _fail("rl.max_new_tokens", rl.max_new_tokens, f"fewer than rl.max_context_tokens="
          f"{rl.max_context_tokens}")
  _choice(config, "rl.kv_cache", ("contiguous", "paged"))
  _choice(config, "rl.engine_mesh", ("none", "colocated"))
  try:
    MeshConfig.parse(_str(config, "rl.engine_mesh_shape"))
  except ValueError as e:
    _fail("rl.engine_mesh_shape", rl.engine_mesh_shape, f"axis=size pairs, e.g. 'tensor=4' ({e})")
  _int(config, "rl.kv_page_size", 1)
  _int(config, "rl.kv_pages", 0)
  path = rl.reward_model.path
  if files and path and not os.path.isfile(os.path.join(path, "model_config.json")):
    _fail("rl.reward_model.path", path, "a mode 'reward_model' workdir (with model_config.json "
          "and rm_checkpoints/) or ''")
  judge = rl.judge_reward
  if (files and judge.weight and judge.source.startswith("ckpt:")
      and not os.path.isdir(judge.source[5:])):
    _fail("rl.judge_reward.source", judge.source, "'ckpt:<dir>' of an existing checkpoint "
          "directory")
  if rl.advantage in advantages.CRITIC_ADVANTAGES:
    _check_critic(config)


def _check_critic(config) -> None:
  """What the learned critic (trainer.critic) cannot serve yet: LoRA (it would train a full
  copy of the policy)."""
  if config.model.lora.rank:
    raise ConfigError(f"config.rl.advantage={config.rl.advantage!r}: not with LoRA "
                      f"(config.model.lora.rank={config.model.lora.rank}): the critic would "
                      "train a full copy of the policy, base weights included")


DEMO_FIELDS = ("mode", "seed", "seeds", "sft", "rl")


def _validate_demo(config, workdir: Optional[str]) -> None:
  """The demo pipeline (trainer/demo.py): its own fields plus the SFT and RL stage configs, each
  validated as the run will use it (the RL stage starts from the SFT stage's checkpoint and
  tokenizer, which exist only once that stage ran)."""
  unknown = sorted(set(config.keys()) - set(DEMO_FIELDS))
  if unknown:
    raise ConfigError(f"config.{unknown[0]}: unknown field for mode 'demo'; valid fields: "
                      f"{list(DEMO_FIELDS)}")
  seeds = _get(config, "seeds")
  if not (isinstance(seeds, (tuple, list)) and seeds and all(
      isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
    _fail("seeds", seeds, "a non-empty tuple of seeds >= 0, e.g. '(0, 1)'")
  for stage, mode in (("sft", "sft"), ("rl", "rl")):
    sub = _get(config, stage)
    if not isinstance(sub, ml_collections.ConfigDict) or sub.get("mode") != mode:
      _fail(f"{stage}.mode", getattr(sub, "get", lambda _: sub)("mode"), repr(mode))
    if stage == "rl":  # as trainer.demo runs it: the SFT stage's weights and tokenizer
      sub = ml_collections.ConfigDict(sub.to_dict())
      sub.tokenizer.train_vocab_size = config.sft.tokenizer.train_vocab_size
    try:
      validate(sub, workdir)
    except ConfigError as e:
      raise ConfigError(str(e).replace("config.", f"config.{stage}.", 1)) from e


def _validate_smoke(config) -> None:
  unknown = sorted(set(config.keys()) - set(SMOKE_FIELDS))
  if unknown:
    raise ConfigError(f"config.{unknown[0]}: unknown field for mode 'smoke'; valid fields: "
                      f"{list(SMOKE_FIELDS)}")
  for field in ("batch", "seq", "decode_tokens"):
    _int(config, field, 1)
  _choice(config, "model.preset", _preset_names())
  _check_overrides(config)
  model_config(config)  # ModelConfig's own checks


def _preset_names() -> tuple[str, ...]:
  return tuple(sorted(PRESETS))


def _check_overrides(config) -> None:

  node = _get(config, "model.overrides")
  if not isinstance(node, ml_collections.ConfigDict):
    _fail("model.overrides", node, "a ConfigDict of ModelConfig fields")
  fields = sorted(f.name for f in dataclasses.fields(ModelConfig))
  for key in node.keys():
    if key not in fields:
      raise ConfigError(f"config.model.overrides.{key}: not a ModelConfig field; valid "
                        f"fields: {fields}")


def _validate_model(config) -> None:
  kind, path = init_kind(_str(config, "model.init"))
  preset = _str(config, "model.preset")
  _check_overrides(config)
  if kind == "random":
    _choice(config, "model.preset", _preset_names())
  else:
    if preset:
      raise ConfigError(f"config.model.preset={preset!r}: must be '' with model.init="
                        f"{config.model.init!r} (the checkpoint defines the architecture)")
    if is_remote(path):
      raise ConfigError(f"config.model.init={config.model.init!r}: expected a local directory")
    need = "config.json" if kind == "hf" else "model_config.json"
    if not os.path.isfile(os.path.join(path, need)):
      raise ConfigError(f"config.model.init={config.model.init!r}: no {need} in {path!r} "
                        + ("(an HF checkpoint directory)" if kind == "hf" else
                           "(a `python -m models.hf import` output or an Arbor run's workdir)"))
    if kind == "ckpt" and not any(os.path.isdir(os.path.join(path, d))
                                  for d in ("state", "checkpoints")):
      raise ConfigError(f"config.model.init={config.model.init!r}: {path!r} has neither state/ "
                        "(models.hf import) nor checkpoints/ (an Arbor run)")
  model_config(config)  # ModelConfig's own checks


def _validate_mesh(config) -> None:
  sizes = {}
  for axis in MESH_AXES:
    value = _get(config, f"mesh.{axis}")
    if not (isinstance(value, int) and not isinstance(value, bool) and (value >= 1
                                                                         or value == -1)):
      _fail(f"mesh.{axis}", value, "a positive integer or -1 (the remaining devices)")
    sizes[axis] = value
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError(f"config.mesh={sizes}: at most one axis may be -1")
  extra = sorted(set(config.mesh.keys()) - set(MESH_AXES))
  if extra:
    raise ConfigError(f"config.mesh.{extra[0]}: unknown axis; valid axes: {MESH_AXES}")


def mesh_shape(config, num_devices: int) -> tuple[int, ...]:
  """The mesh's axis sizes on the devices of the run.

  Args:
    config: the experiment config (config.mesh, config.data.rows_per_batch).
    num_devices: the number of devices, all processes together.

  Returns:
    One size per axis of `MESH_AXES`, the -1 axis resolved.

  Raises:
    ConfigError: the sizes' product is not `num_devices`, data.rows_per_batch is not a
      multiple of data x fsdp x expert, or data.row_len not a multiple of sequence.
  """
  given = {a: config.mesh[a] for a in MESH_AXES}
  try:
    sizes = MeshConfig(**given).shape(num_devices)
  except ValueError as e:
    raise ConfigError(f"config.mesh={given}: {re.sub(r'^MeshConfig[^:]*: ', '', str(e))} "
                      "(the axes' product must equal the device count; -1 = the rest)") from e
  rows = config.data.rows_per_batch
  batch = math.prod(s for a, s in zip(MESH_AXES, sizes) if a in ("data", "fsdp", "expert"))
  if rows % batch:
    raise ConfigError(f"config.data.rows_per_batch={rows}: expected a multiple of mesh data x "
                      f"fsdp x expert = {batch} (the batch axes)")
  sequence = sizes[MESH_AXES.index("sequence")]
  if config.data.row_len % sequence:
    raise ConfigError(f"config.data.row_len={config.data.row_len}: expected a multiple of "
                      f"mesh.sequence = {sequence} (each sequence shard holds an equal chunk "
                      "of every row)")
  return tuple(sizes)


def _validate_optimizer(config) -> None:
  try:
    optim.OptimizerConfig.from_config(config.optimizer)
  except (ValueError, TypeError) as e:
    msg = str(e)
    msg = re.sub(r"^OptimizerConfig\.", "config.optimizer.", msg)
    msg = re.sub(r"^optimizer\.", "config.optimizer.", msg)
    raise ConfigError(msg if msg.startswith("config.") else f"config.optimizer: {msg}") from e


def _validate_data(config, mode: str) -> None:
  for field in ("sources", "eval_sources"):
    for p in _paths(config, f"data.{field}"):
      if mode == "sft" and not is_remote(p) and not os.path.isfile(p):
        raise ConfigError(f"config.data.{field}: {p!r}: no such file")
  data_config(config)  # the SFTDataConfig fields (errors name config.data.FIELD)
  _int(config, "data.num_epochs", 0)
  _int(config, "data.max_group_size", 0)
  _int(config, "data.demo.episodes", 0)
  _int(config, "data.demo.eval_episodes", 0)
  _choice(config, "data.demo.level", taskgen.LEVELS)
  _int(config, "data.demo.seed", 0)
  _number(config, "data.demo.error_rate", 0.0, 1.0)
  _number(config, "data.demo.early_submit_rate", 0.0, 1.0)
  _choice(config, "data.demo.sandbox", demo_data.SANDBOXES)
  try:
    task_environments.default_environment(_str(config, "data.demo.environment"),
                                          "data.demo.environment")
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  if mode == "sft" and not config.data.sources and not config.data.demo.episodes:
    raise ConfigError("config.data.sources=(): no training data; give files or set "
                      "data.demo.episodes > 0 (generated demo episodes)")


def has_eval_data(config) -> bool:
  """Whether the config gives held-out data (files or generated demo episodes)."""
  return bool(config.data.eval_sources) or config.data.demo.eval_episodes > 0


def _validate_train(config, mode: str) -> None:
  steps = _int(config, "train.steps", 1)
  for field in ("eval_every", "checkpoint_every", "eval_batches"):
    _int(config, f"train.{field}", 0)
  _int(config, "train.log_every", 1)
  for field in ("eval_every", "checkpoint_every"):
    value = config.train[field]
    if value > steps:
      _fail(f"train.{field}", value, f"0 or an interval <= train.steps={steps}")
  if mode == "sft" and config.train.eval_every and not has_eval_data(config):
    raise ConfigError(f"config.train.eval_every={config.train.eval_every}: needs held-out data; "
                      "set data.eval_sources or data.demo.eval_episodes > 0 (or eval_every=0)")


CHAT_FORMATS = ("template",) + tuple(FORMATS)


def make_chat_format(config, tokenizer_path: str) -> ChatFormat:
  """The run's chat format over the tokenizer at `tokenizer_path` (`tokenizer_source`).

  Args:
    config: the experiment config (tokenizer.chat_format, tokenizer.template_kwargs).
    tokenizer_path: a tokenizer directory or file.

  Returns:
    For chat_format "template", the checkpoint's own Jinja template (envs.chat.load_chat) with
    the config's template kwargs; else the built-in format of that name.

  Raises:
    ConfigError: "template" for a tokenizer without a chat template.
  """
  tokenizer = load_tokenizer(tokenizer_path)
  name = config.tokenizer.chat_format
  if name != "template":
    return make_chat(name, tokenizer)
  kwargs = config.tokenizer.get("template_kwargs", None) or {}
  kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else dict(kwargs)
  try:
    return load_chat(tokenizer_path, tokenizer, template_kwargs=kwargs)
  except ValueError as e:
    raise ConfigError(f"config.tokenizer.chat_format='template': {e} (or name a built-in "
                      f"format: {', '.join(FORMATS)})") from None


def _check_template(config, workdir: str) -> None:
  """chat_format "template" needs a local tokenizer source that has a chat template."""
  try:
    source = tokenizer_source(config, workdir)
  except ConfigError:
    return  # nothing provides a tokenizer yet (the modes that need one say so)
  if is_remote(source) or not os.path.exists(source):
    return
  if read_chat_templates(source) is None:
    _fail("tokenizer.chat_format", "template", f"a built-in format ({', '.join(FORMATS)}): "
          f"{source} has no chat template (chat_template.jinja or tokenizer_config.json's "
          "chat_template)")


def _validate_tokenizer(config, mode: str, workdir: Optional[str]) -> None:

  fmt = _choice(config, "tokenizer.chat_format", CHAT_FORMATS)
  path = _str(config, "tokenizer.path")
  vocab = _int(config, "tokenizer.train_vocab_size", 0)
  kwargs = config.tokenizer.get("template_kwargs", None) or {}
  if not hasattr(kwargs, "items"):
    _fail("tokenizer.template_kwargs", kwargs, "a dict of chat-template variables")
  if kwargs and fmt != "template":
    _fail("tokenizer.template_kwargs", dict(kwargs),
          f"{{}} for the built-in chat format {fmt!r} (template kwargs are for "
          "chat_format='template')")
  if fmt == "template" and vocab > 0:
    _fail("tokenizer.chat_format", fmt, "a built-in format when the run trains its own "
          "tokenizer (tokenizer.train_vocab_size > 0): a trained tokenizer has no template")
  _int(config, "tokenizer.train_episodes", 1)
  if path and not is_remote(path) and not os.path.exists(path):
    raise ConfigError(f"config.tokenizer.path={path!r}: no such file or directory")
  if path and vocab:
    raise ConfigError(f"config.tokenizer.train_vocab_size={vocab}: must be 0 when "
                      f"tokenizer.path={path!r} is given (one tokenizer per run)")
  if vocab:
    model_vocab = model_config(config).vocab_size
    if vocab > model_vocab:
      raise ConfigError(f"config.tokenizer.train_vocab_size={vocab}: more than the model's "
                        f"vocab_size={model_vocab} (set model.overrides.vocab_size)")
  if mode == "sft":
    tokenizer_source(config, workdir or ".")


def _validate_metrics(config, workdir: Optional[str]) -> None:
  logdir = _str(config, "metrics.dir")
  for field in ("tensorboard", "progress", "report"):
    _bool(config, f"metrics.{field}")
  _str(config, "metrics.wandb_project")
  if is_remote(logdir):
    _fail("metrics.dir", logdir, "a local directory (metrics are appended to files)")
  if workdir is not None and is_remote(workdir) and not logdir:
    raise ConfigError(f"config.metrics.dir='': set a local directory when --workdir={workdir!r} "
                      "is remote (metrics are appended to local files)")
  if workdir is not None and is_remote(workdir) and (config.data.demo.episodes
                                                     or config.tokenizer.train_vocab_size):
    raise ConfigError(f"--workdir={workdir!r}: generated demo data and tokenizers are written "
                      "to a local workdir; use one, or give data.sources and tokenizer.path")


def _validate_rl(config) -> None:
  _choice(config, "rl.loop", RL_LOOPS)
  _int(config, "rl.max_staleness", 0)
  _int(config, "rl.prompts_per_step", 1)
  _int(config, "rl.group_size", 2)
  _int(config, "rl.epochs", 1)
  _int(config, "rl.minibatches", 1)
  _choice(config, "rl.advantage", tuple(advantages.ADVANTAGES) + TREE_ADVANTAGES
          + tuple(advantages.CRITIC_ADVANTAGES))
  _number(config, "rl.gae_gamma", 0.0, 1.0)
  _number(config, "rl.gae_lambda", 0.0, 1.0)
  _number(config, "rl.value_clip", 0.0)
  _number(config, "rl.critic_lr", 0.0, low_open=True)
  _int(config, "rl.critic_warmup_steps", 0)
  _int(config, "rl.critic_epochs", 0)
  _bool(config, "rl.drop_constant_groups")
  _bool(config, "rl.cache_verdicts")
  ref = _str(config, "rl.reference")
  if ref != "initial" and not (ref.startswith("ckpt:") and len(ref) > 5):
    _fail("rl.reference", ref, f"one of {RL_REFERENCES}")
  _bool(config, "rl.recompute_old")
  _choice(config, "rl.correction", corrections.KINDS)
  _int(config, "rl.mcla_passes", 0)
  if (config.rl.correction != "none" and not config.rl.recompute_old
      and not config.rl.mcla_passes):  # else π_old is the sampler's own: every weight is 1
    _fail("rl.correction", config.rl.correction, "'none' unless the trainer scores π_old "
          "(rl.recompute_old=True or rl.mcla_passes > 0), which the correction weighs "
          "against the sampler's log-probs")
  _choice(config, "rl.mcla_mode", corrections.MCLA_MODES)
  _bool(config, "rl.routing_replay")
  _bool(config, "rl.fixed_batch_shape")
  _number(config, "rl.temperature", 0.0)
  _number(config, "rl.top_p", 0.0, 1.0, low_open=True)
  _int(config, "rl.top_k", 0)
  for field in ("max_new_tokens", "max_turns", "max_context_tokens", "concurrency"):
    _int(config, f"rl.{field}", 1)
  _choice(config, "rl.sandbox", sandbox.BACKENDS)
  sandbox_url = _str(config, "rl.sandbox_url")
  token_file = _str(config, "rl.sandbox_token_file")
  if config.rl.sandbox == "remote":
    if not sandbox_url.startswith(("http://", "https://")):
      _fail("rl.sandbox_url", sandbox_url, "the sandbox server's http(s)://host:port with "
            "rl.sandbox='remote'")
    if not os.path.isfile(token_file):
      _fail("rl.sandbox_token_file", token_file, "an existing file holding the sandbox "
            "server's token with rl.sandbox='remote'")
  _number(config, "rl.episode_timeout_s", 0.0, low_open=True)
  _number(config, "rl.group_deadline_s", 0.0, low_open=True)
  _choice(config, "rl.rollout_workers", RL_ROLLOUT_WORKERS)
  url = _str(config, "rl.queue_url")
  if url and url != "memory" and not url.startswith(("redis://", "rediss://")):
    _fail("rl.queue_url", url, "'' | 'memory' | 'redis://host:port[/db]' | 'rediss://...'")
  _str(config, "rl.queue_password_file")
  _str(config, "rl.tasks")
  _str(config, "rl.swe_mirror")
  _str(config, "rl.swe_cache")
  _choice(config, "rl.env_from", task_environments.ENV_FROM)
  try:  # a preset name or a spec file: read now, so a typo fails at start-up
    task_environments.default_environment(_str(config, "rl.default_environment"),
                                          "rl.default_environment")
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  _choice(config, "rl.task_level", taskgen.LEVELS)
  _int(config, "rl.task_seed", 0)
  _choice(config, "rl.rollout", RL_ROLLOUTS)
  if config.rl.rollout == "branching" and config.rl.rollout_workers == "queue":
    _fail("rl.rollout", "branching", "'independent' with rl.rollout_workers='queue' (start "
          "the remote workers with --rollout branching and --branch_* flags instead)")
  _validate_scaffold(config, "rl.scaffold")
  try:
    branching.BranchConfig(**config.rl.branch.to_dict())
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e).replace("BranchConfig.", "config.rl.branch.")) from e


def _validate_reward_model(config, mode: str, files: bool) -> None:
  """The reward model served in RL (rl.reward_model) and mode "reward_model"'s section."""
  _str(config, "rl.reward_model.path")
  _number(config, "rl.reward_model.weight", 0.0)
  _choice(config, "rl.reward_model.kind", RM_KINDS)
  r = config.reward_model
  for field in ("episodes", "eval_episodes"):
    path = _str(config, f"reward_model.{field}")
    if files and mode == "reward_model" and path and not os.path.isfile(path):
      _fail(f"reward_model.{field}", path, "a JSONL file of trajectories or '' (demo episodes)")
  _int(config, "reward_model.demo_tasks", 0)
  _int(config, "reward_model.demo_eval_tasks", 0)
  for field in ("pairwise_coef", "orm_coef", "prm_coef", "margin", "weight_decay"):
    _number(config, f"reward_model.{field}", 0.0)
  _int(config, "reward_model.batch_pairs", 1)
  _int(config, "reward_model.max_len", 16)
  _number(config, "reward_model.learning_rate", 0.0, low_open=True)
  if mode != "reward_model":
    return
  if not (r.pairwise_coef or r.orm_coef or r.prm_coef):
    _fail("reward_model.pairwise_coef", r.pairwise_coef, "a positive weight in at least one of "
          "reward_model.pairwise_coef, orm_coef, prm_coef")
  if not r.episodes and not r.demo_tasks:
    _fail("reward_model.demo_tasks", r.demo_tasks, "> 0 when reward_model.episodes='' (no "
          "training trajectories otherwise)")
  if files:
    tokenizer_source(config, ".")


def _validate_judge_reward(config) -> None:
  """The LLM judge served in RL as a generative reward (rl.judge_reward)."""
  _number(config, "rl.judge_reward.weight", 0.0)
  source = _str(config, "rl.judge_reward.source")
  if not (source == "policy" or (source.startswith("ckpt:") and source[5:].strip())
          or re.match(r"https?://\S+$", source)):
    _fail("rl.judge_reward.source", source, "'policy', 'ckpt:<dir>' or an http(s):// "
          "completions URL such as 'http://127.0.0.1:8000/v1'")
  if not _str(config, "rl.judge_reward.model") and source.startswith("http"):
    _fail("rl.judge_reward.model", "", "the served model's name with an http(s) source")
  rubric = _get(config, "rl.judge_reward.rubric")
  try:
    parse_rubric(rubric if isinstance(rubric, (tuple, list)) else ())
  except ValueError as e:
    _fail("rl.judge_reward.rubric", rubric, f"a tuple of 'name:weight:description' ({e})")
  _int(config, "rl.judge_reward.max_retries", 0)
  _choice(config, "rl.judge_reward.fallback", JUDGE_FALLBACKS)
  _int(config, "rl.judge_reward.concurrency", 1)
  _number(config, "rl.judge_reward.timeout_s", 0.0, low_open=True)
  _int(config, "rl.judge_reward.max_tokens", 1)
  _int(config, "rl.judge_reward.max_chars", 1)
  _int(config, "rl.judge_reward.cache_size", 0)
  _str(config, "rl.judge_reward.cache_file")


def _validate_scaffold(config, field: str) -> None:
  """A scaffold mix (trainer.blackbox.check_scaffold_mix) and the settings black-box ones need."""
  rl = field.startswith("rl.")  # eval episodes: in-process, independent, selected
  try:
    blackbox.check_scaffold_mix(
        _str(config, field), field, sandbox=config.rl.sandbox,
        rollout=config.rl.rollout if rl else "independent",
        rollout_workers=config.rl.rollout_workers if rl else "inprocess",
        selection="none" if rl else config.eval.selection)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _validate_distill(config) -> None:
  teachers = _paths(config, "distill.teachers")
  _choice(config, "distill.choose", TEACHER_CHOICE)
  _number(config, "distill.opd_coef", 0.0)
  for t in teachers:
    domain, sep, ckpt = t.partition("=")
    if not (sep and domain and ckpt.startswith("ckpt:") and len(ckpt) > 5):
      _fail("distill.teachers", teachers, "entries 'domain=ckpt:<dir>'")


def _validate_serve(config) -> None:
  host = _str(config, "serve.host")
  _int(config, "serve.port", 0, 65535)
  _str(config, "serve.served_name")
  _int(config, "serve.slots", 1)
  _int(config, "serve.max_seq_len", 128)
  _int(config, "serve.top_logprobs", 0)
  _int(config, "serve.max_connections", 1)
  _number(config, "serve.header_timeout_s", 0.0, low_open=True)
  _number(config, "serve.body_timeout_s", 0.0, low_open=True)
  if config.mode == "serve":
    try:
      net.check_bind(host, os.environ.get("ARBOR_SERVE_TOKEN") or None)
    except ValueError as e:
      raise ConfigError(f"config.serve.host={host!r}: {e}") from e


def _validate_eval(config) -> None:
  _str(config, "eval.tasks")
  _int(config, "eval.num_tasks", 1)
  k = _int(config, "eval.k", 1)
  samples = _int(config, "eval.samples", 1)
  if samples < k:
    _fail("eval.samples", samples, f"an integer >= eval.k={k}")
  _choice(config, "eval.selection", selection.SELECTIONS)
  _number(config, "eval.temperature", 0.0)
  _validate_scaffold(config, "eval.scaffold")
  for c in _paths(config, "eval.checkpoints"):
    if not (c.startswith("ckpt:") and len(c) > 5):
      _fail("eval.checkpoints", c, "entries 'ckpt:<dir>'")
