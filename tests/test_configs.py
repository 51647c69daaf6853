"""The shipped configs: every file in configs/ loads (each family ARG of the templates), the
runnable ones validate as they are, and the templates for real checkpoints (sft, rl, distill) fail
validation only on their placeholder paths, naming the field, and validate once those point at
real (tiny) files: an HF checkpoint directory per family written by the transformers config class
of that family, task and data files.
"""

import glob
import json
import os
import re
import shutil
import time

import ml_collections
import pytest

from configs import sft_demo
from trainer import config as config_lib
from trainer import harness
from trainer import main as main_lib
from trainer.config import ConfigError, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(os.path.splitext(os.path.basename(p))[0]
               for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
               if not p.endswith(("__init__.py", "base.py")))  # base: the sections, not a run
FAMILIES = ("qwen2.5-coder", "qwen3", "deepseek-v3")
TEMPLATES = ("sft", "rl", "distill", "long_context")  # imported HF models: placeholder paths
RUNNABLE = ("smoke", "sft_demo", "demo", "reward_model")  # configs that validate (and run) as they are
PLACEHOLDER = "/path/to/"
# Placeholder fields that `validate` does not check on disk (read when the run starts):
# held-out task files (mode "eval" reads them) and the teachers' directories (format only).
UNCHECKED = {"eval.tasks", "distill.teachers"}
TASK_LINE = {"id": "add-1", "kind": "code", "prompt": "Write add(a, b).", "entry_point": "add",
             "tests": [{"args": [1, 2], "expected": 3}], "domain": "swe"}


def load(name: str, arg=None) -> ml_collections.ConfigDict:
  """As `trainer.main` loads `--config=configs/NAME.py[:ARG]` (a fresh module every time)."""
  spec = f"configs/{name}.py" + (f":{arg}" if arg is not None else "")
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    return main_lib._load_config_file([f"--config={spec}"])
  finally:
    os.chdir(cwd)


def args_of(name: str) -> list:
  import importlib
  module = importlib.import_module(f"configs.{name}")
  if name == "distill":
    return list(FAMILIES)
  return list(getattr(module, "FAMILIES", {None: None}))


def placeholders(config, prefix: str = "") -> dict[str, object]:
  """{dotted field: value} of every field whose value (or an entry of it) is a placeholder."""
  out = {}
  for key, value in config.items():
    field = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      out.update(placeholders(value, field + "."))
    elif isinstance(value, str) and PLACEHOLDER in value:
      out[field] = value
    elif isinstance(value, (tuple, list)) and any(isinstance(v, str) and PLACEHOLDER in v
                                                  for v in value):
      out[field] = value
  return out


def set_field(config, field: str, value) -> None:
  *parents, last = field.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[last] = value


def timed_validate(config, workdir: str) -> None:
  start = time.perf_counter()
  try:
    validate(config, workdir)
  finally:
    assert time.perf_counter() - start < 10, "validation must take seconds"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def real_paths(tmp_path_factory):
  """Tiny real stand-ins for the placeholders: an HF checkpoint directory (config.json of that
  family's transformers config class) per family, data and task files, teacher directories."""
  from transformers import DeepseekV3Config, Qwen2Config, Qwen3Config

  root = tmp_path_factory.mktemp("real")
  common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=256)
  hf_configs = {
      "qwen2.5-coder": Qwen2Config(**common, num_key_value_heads=2),
      "qwen3": Qwen3Config(**common, num_key_value_heads=2, head_dim=16),
      "deepseek-v3": DeepseekV3Config(**dict(
          common, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32,
          n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
          q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
          n_group=2, topk_group=1)),
  }
  hf_dirs = {}
  for family, cfg in hf_configs.items():
    hf_dirs[family] = str(root / f"hf_{family}")
    cfg.save_pretrained(hf_dirs[family])
  template = os.path.join(os.path.dirname(__file__), "data", "chat_templates", "qwen3.jinja")
  shutil.copy(template, os.path.join(hf_dirs["qwen3"], "chat_template.jinja"))  # its own
  data = root / "train.jsonl"
  data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "hello"}]}) + "\n")
  tasks = root / "tasks.jsonl"
  tasks.write_text(json.dumps(TASK_LINE) + "\n")
  teachers = []
  for domain in ("swe", "terminal"):
    (root / f"{domain}_expert").mkdir()
    teachers.append(f"{domain}=ckpt:{root / f'{domain}_expert'}")
  return {"hf": hf_dirs, "data": str(data), "tasks": str(tasks), "teachers": tuple(teachers)}


def real_value(field: str, family: str, paths: dict):
  if field == "model.init":
    return f"hf:{paths['hf'][family]}"
  if field in ("data.sources", "data.eval_sources"):
    return (paths["data"],)
  if field in ("rl.tasks", "eval.tasks"):
    return paths["tasks"]
  if field == "distill.teachers":
    return paths["teachers"]
  raise AssertionError(f"no stand-in for the placeholder field {field}")


# ----------------------------------------------------------------------------- tests


def test_every_base_field_has_a_comment():
  """configs/base.py: each field assignment carries a comment on its line or the line above,
  and every field of `base_config()` is assigned there (nothing added elsewhere)."""
  from configs.base import base_config
  lines = open(os.path.join(ROOT, "configs", "base.py")).read().splitlines()
  assigned = set()
  for i, line in enumerate(lines):
    m = re.match(r"\s+([sc](?:\.\w+)+) = ", line)
    if not m or line.strip().startswith(("s = ", "c = ")):
      continue
    assigned.add(m.group(1).split(".")[-1])
    section = "ConfigDict()" in line or re.search(r"= _\w+\(\)$", line)  # its docstring
    assert "#" in line or lines[i - 1].strip().startswith("#") or section, (
        f"configs/base.py:{i + 1}: a field without its one-line comment: {line.strip()}")

  def leaves(c):
    for key, value in c.items():
      yield key
      if isinstance(value, ml_collections.ConfigDict):
        yield from leaves(value)
  assert set(leaves(base_config())) <= assigned | {"model", "tokenizer", "mesh", "optimizer",
                                                   "loss", "data", "train", "checkpoint",
                                                   "metrics", "rl", "distill", "eval", "serve"}


def test_every_config_file_is_covered():
  assert set(NAMES) == set(TEMPLATES) | set(RUNNABLE), (
      "a new configs/*.py: add it to TEMPLATES or RUNNABLE here")


@pytest.mark.parametrize("name", NAMES)
def test_config_loads(name):
  for arg in args_of(name):
    c = load(name, arg)
    assert isinstance(c, ml_collections.ConfigDict)
    assert c.mode in config_lib.MODES
    doc = open(os.path.join(ROOT, "configs", f"{name}.py")).read()
    assert doc.startswith('"""'), "every config starts with its docstring (the command line)"
    assert "python -m trainer.main --config=configs/" + name + ".py" in doc


@pytest.mark.parametrize("name", RUNNABLE)
def test_runnable_configs_validate_as_they_are(name, tmp_path):
  c = load(name)
  assert not placeholders(c)
  timed_validate(c, str(tmp_path / name))


def test_demo_config_is_the_demo():
  c = load("demo")
  assert c.mode == "demo" and c.sft.mode == "sft" and c.rl.mode == "rl"
  assert c.rl.loss.name == "cispo" and c.rl.rl.sandbox == "bwrap"


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_docstring_flags_exist(name):
  """The --config.KEY flags of the docstring's command lines name fields of the config."""
  doc = open(os.path.join(ROOT, "configs", f"{name}.py")).read().split('"""')[1]
  keys = sorted(set(re.findall(r"--config\.([\w.]+)=", doc)))
  assert keys
  for arg in args_of(name):
    config_lib.check_override_keys(load(name, arg), keys)


@pytest.mark.parametrize("name", TEMPLATES)
def test_unknown_family_is_refused(name):
  with pytest.raises(ValueError, match=rf"configs/{name}.py:llama: expected one of"):
    load(name, "llama")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", TEMPLATES)
def test_template_fails_only_on_its_placeholders(name, family, real_paths, tmp_path):
  workdir = str(tmp_path / "work")
  c = load(name, family)
  fields = placeholders(c)
  assert "model.init" in fields, "the checkpoint is the user's to give"
  if name != "sft":
    assert {"rl.tasks", "eval.tasks"} <= set(fields)
  if name == "distill":
    assert "distill.teachers" in fields

  # as shipped: the checkpoint placeholder is the first error
  with pytest.raises(ConfigError, match=r"^config\.model\.init='hf:/path/to/"):
    timed_validate(c, workdir)

  # with every placeholder but one replaced, the error names that one (or it is not checked)
  unchecked = set()
  for missing in fields:
    c = load(name, family)
    for field in fields:
      if field != missing:
        set_field(c, field, real_value(field, family, real_paths))
    try:
      timed_validate(c, workdir)
      unchecked.add(missing)
    except ConfigError as e:
      assert str(e).startswith(f"config.{missing}"), (missing, str(e))
      assert PLACEHOLDER in str(e)
  assert unchecked <= UNCHECKED, f"placeholders that validate: {sorted(unchecked - UNCHECKED)}"

  # every placeholder replaced: it validates, with the template's settings
  c = load(name, family)
  for field in fields:
    set_field(c, field, real_value(field, family, real_paths))
  assert not placeholders(c)
  timed_validate(c, workdir)
  model = config_lib.model_config(c)
  assert model.dtype == "bfloat16" and model.remat == "full"
  assert (model.attention == "mla") == (family == "deepseek-v3")
  assert config_lib.tokenizer_source(c, workdir) == real_paths["hf"][family]
  assert c.tokenizer.chat_format == {"qwen2.5-coder": "qwen2.5", "qwen3": "template",
                                     "deepseek-v3": "deepseek_v3"}[family]
  if name == "sft":
    return
  assert c.mode == {"long_context": "rl"}.get(name, name)
  loss = config_lib.loss_config(c)
  assert loss.name not in config_lib.RL_LOSSES_EXCLUDED
  rl = c.rl
  assert rl.loop == "async" and rl.max_staleness == 1 and rl.group_size in (8, 16)
  assert rl.routing_replay is True  # MoE policies train through the sampler's experts
  assert rl.max_new_tokens < rl.max_context_tokens <= c.data.row_len
  assert rl.rollout_workers == "queue" and rl.queue_url.startswith("redis://")
  if name == "distill":
    assert c.distill.opd_coef > 0 and not rl.drop_constant_groups
    from envs.tasks import load_tasks
    (task,) = load_tasks(real_paths["tasks"])  # the task-file line the docstring describes
    assert task.metadata["domain"] == "swe"
    assert [t.split("=")[0] for t in c.distill.teachers] == ["swe", "terminal"]


def test_rollout_engine_records_experts_for_moe_policies_with_replay():
  from models.presets import get_preset
  from trainer.rollouts import engine_config
  c = load("rl", "deepseek-v3")
  moe, dense = get_preset("tiny-moe-mla"), get_preset("tiny-dense")
  assert engine_config(c, moe).return_expert_ids
  assert not engine_config(c, dense).return_expert_ids
  assert not engine_config(c).return_expert_ids  # evaluation engines: no model config
  c.rl.routing_replay = False
  assert not engine_config(c, moe).return_expert_ids


def test_rollout_engine_takes_the_paged_cache_fields():
  from trainer.rollouts import engine_config
  c = load("rl", "qwen2.5-coder")
  assert engine_config(c).cache == "contiguous"
  c.rl.kv_cache, c.rl.kv_page_size, c.rl.kv_pages = "paged", 32, 1024
  e = engine_config(c)
  assert (e.cache, e.page_size, e.num_pages) == ("paged", 32, 1024)
  c.rl.kv_cache = "pages"
  with pytest.raises(ConfigError, match=r"config.rl.kv_cache='pages': expected one of"):
    config_lib._validate_rl_mode(c, files=False)


def test_rollout_engine_reports_top_logprobs_for_arpo_entropy():
  from trainer.rollouts import engine_config
  c = load("rl", "qwen2.5-coder")
  c.rl.rollout, c.rl.branch.entropy_measure, c.rl.branch.entropy_top_k = "branching", "arpo", 7
  assert engine_config(c).top_logprobs == 7
  c.rl.branch.entropy_measure = "nats"
  assert engine_config(c).top_logprobs == 0


def test_sharding_rule_overrides_replace_named_rules_and_name_bad_values():
  c = load("rl", "qwen2.5-coder")
  c.model.init, c.model.preset = "random", "tiny-moe-mla"
  rules = dict(config_lib.model_config(c).sharding_rules)
  c.model.overrides.sharding_rules.act_embed = "tensor"
  got = dict(config_lib.model_config(c).sharding_rules)
  assert got["act_embed"] == ("tensor",) and {k: v for k, v in got.items() if k != "act_embed"} \
      == {k: v for k, v in rules.items() if k != "act_embed"}
  c.model.overrides.sharding_rules.act_embed = "tensr"
  with pytest.raises(ConfigError, match=r"sharding_rules.act_embed='tensr'.*not \['tensr'\]"):
    config_lib.model_config(c)
  c.model.overrides.sharding_rules.act_embed = None
  c.model.overrides.sharding_rules.residual = "tensor"
  with pytest.raises(ConfigError, match=r"sharding_rules.residual: no such logical axis"):
    config_lib.model_config(c)


def test_template_chat_format_needs_a_template(real_paths, tmp_path):
  """chat_format="template" on a checkpoint without a chat template fails naming the field."""
  c = load("sft", "qwen3")
  c.model.init = f"hf:{real_paths['hf']['qwen2.5-coder']}"  # config.json, no template
  c.data.sources = c.data.eval_sources = (real_paths["data"],)
  with pytest.raises(ConfigError, match=r"config.tokenizer.chat_format='template': expected a "
                                        r"built-in format .* has no chat template"):
    validate(c, str(tmp_path))
  c.tokenizer.chat_format = "chatml"
  c.tokenizer.template_kwargs = {"enable_thinking": False}
  with pytest.raises(ConfigError, match="config.tokenizer.template_kwargs"):
    validate(c, str(tmp_path))


def test_demo_switches_to_tree_rollouts_and_aepo_by_fields(tmp_path):
  """The demo's RL stage takes branching rollouts, TreeRL credit and the AEPO loss from config
  fields; bad branching values and the queue combination fail naming the field."""
  from trainer.rollouts import branch_config
  c = load("demo")
  assert branch_config(c.rl) is None
  c.rl.rl.rollout, c.rl.rl.advantage = "branching", "treerl"
  c.rl.loss.name, c.rl.loss.entropy_adv_coef, c.rl.loss.eps_high = "aepo", 0.3, None
  c.rl.rl.branch.width = 3
  timed_validate(c, str(tmp_path / "demo"))
  assert branch_config(c.rl).width == 3
  assert config_lib.loss_config(c.rl).name == "aepo"
  c.rl.rl.branch.base_prob = 1.5
  with pytest.raises(ConfigError, match=r"config\.rl\.rl\.branch\.base_prob=1\.5"):
    timed_validate(c, str(tmp_path / "demo"))
  c.rl.rl.branch.base_prob = 0.5
  c.rl.rl.rollout_workers = "queue"
  with pytest.raises(ConfigError, match=r"config\.rl\.rl\.rollout='branching'"):
    timed_validate(c, str(tmp_path / "demo"))


@pytest.mark.parametrize("field,value,match", [
    ("env_from", "conda", r"^config\.rl\.rl\.env_from='conda': expected one of \('none', "),
    ("default_environment", "bookworm", r"^config\.rl\.rl\.default_environment='bookworm': "
     r"expected '' \(none\), a preset \(bookworm-pytest\)"),
    ("default_environment", "/nope/env.toml", r"^config\.rl\.rl\.default_environment="
     r"'/nope/env.toml': no such spec file"),
])
def test_task_environment_fields_are_validated(field, value, match, tmp_path):
  c = load("demo")
  c.rl.rl[field] = value  # the demo's RL stage
  with pytest.raises(ConfigError, match=match):
    timed_validate(c, str(tmp_path / "w"))


def test_the_demo_runs_its_tasks_in_the_bookworm_pytest_environment():
  c = load("demo")
  assert (c.rl.rl.env_from, c.rl.rl.default_environment) == ("none", "bookworm-pytest")


def test_the_demo_episodes_environment_is_validated(tmp_path):
  c = load("sft_demo")
  assert c.data.demo.environment == "bookworm-pytest"
  c.data.demo.environment = "trixie"
  with pytest.raises(ConfigError, match=r"^config\.data\.demo\.environment='trixie': expected"):
    timed_validate(c, str(tmp_path / "w"))


def test_resuming_an_older_workdir_ignores_new_fields_at_their_default(tmp_path):
  """A workdir whose config.json predates a field: the field at its default is no change; set
  to another value, or any field changed, it is named."""
  config = sft_demo.get_config()
  older = json.loads(config.to_json_best_effort())
  del older["rl"]["engine_mesh_shape"]  # a field the older run's Arbor did not have
  older["optimizer"]["learning_rate"] = 0.5
  (tmp_path / "config.json").write_text(json.dumps(older))
  assert harness.config_changes(config, str(tmp_path)) == [
      ("optimizer.learning_rate", 0.5, config.optimizer.learning_rate)]
  config.rl.engine_mesh_shape = "tensor=2"
  assert [k for k, *_ in harness.config_changes(config, str(tmp_path))] == [
      "optimizer.learning_rate", "rl.engine_mesh_shape"]
