"""Scaffolds: the agent loops that episodes run, Arbor's own and black-box CLIs.

This package owns
- `registry`: one `Scaffold` entry per agent loop: its install recipe (`Environment.tools`
  entries, exact versions), the protocol its model calls speak, and how one non-interactive
  run is started and pointed at the gateway (`launch`). Entries: "react" (Arbor's loop,
  `envs.scaffold`, run host-side), "claude-code", "codex", "qwen-code", "opencode",
  "mini-swe-agent". `with_scaffold(env, name)` extends a task's `Environment` with one;
- `channel`: the per-episode channel from a sandbox (no network) to the policy gateway: a
  UNIX socket bound into the sandbox, the episode's session and the gateway's token forced on
  every request, replies streamed through;
- `relay`: the in-sandbox end of the channel (stdlib; TCP 127.0.0.1:PORT to the socket);
- `runner`: `run_blackbox_episode`: environment with the scaffold → sandbox with the task's
  files and the channel → the CLI → the task's verifier; returns the reward and the session id;
- `sessions`: a gateway session's records as a `Trajectory` (`trajectory_from_session`: exact
  ids, the sampler's log-probs, versions, expert ids; the CLI's ending mapped onto
  `envs.trajectory.TERMINATIONS`) and the token trie its calls form (`session_tree`);
- `scripted`: a scripted policy with the engine's interface (`ScriptedPolicy`): put behind the
  policy server, it reads each rendered prompt (the tools a CLI offered, the tool results so
  far) and answers a bug fix (read, edit, test, finish) as the chat format's exact tool-call
  ids, so a real CLI's episode can be checked end to end without a trained model;
- `stub`: a scripted stand-in for the gateway itself (one final reply per call, in each
  protocol), for `probe`;
- `__main__`: `python -m envs.scaffolds list | check | probe | build [NAME ...] | show
  SESSION`: installs each recipe into an environment and runs its version command in a
  sandbox, runs each scaffold against a scripted gateway, builds one environment with several
  scaffolds, or prints a session's calls and trie.
"""

from envs.scaffolds.channel import Channel
from envs.scaffolds.registry import (PROTOCOLS, REGISTRY, Launch, LaunchRequest, Scaffold, get,
                                     register, with_scaffold)
from envs.scaffolds.runner import BlackboxResult, run_blackbox_episode
from envs.scaffolds.sessions import map_termination, session_tree, trajectory_from_session

__all__ = ["BlackboxResult", "Channel", "Launch", "LaunchRequest", "PROTOCOLS", "REGISTRY",
           "Scaffold", "get", "map_termination", "register", "run_blackbox_episode",
           "session_tree", "trajectory_from_session", "with_scaffold"]
