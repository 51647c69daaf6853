"""The import rules of docs/design.md §1, checked on the source (AST) and by importing.

Who may import whom (project packages only; third-party packages are each package's business):

  models   models                          (the network; never envs, rl, trainer)
  rl       rl                              (the math of learning from trajectories)
  envs     envs                            (the world the agent acts in; no JAX)
  trainer  trainer, models, rl, envs, configs
  launch   launch, configs, envs           (configs to jobs; no JAX)
  configs  configs                         (ml_collections only)

Besides: no import of a project module inside a function (dependencies are visible at the top
of each file), no import cycle between project modules, and envs, launch and configs never
import the JAX stack (a launcher reads a config and a rollout worker runs on a CPU VM without
it). Each violation is reported as file:line.
"""

import ast
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("models", "rl", "envs", "trainer", "launch", "configs")
ALLOWED = {
    "models": {"models"},
    "rl": {"rl"},
    "envs": {"envs"},
    "trainer": {"trainer", "models", "rl", "envs", "configs"},
    "launch": {"launch", "configs", "envs"},
    "configs": {"configs"},
}
JAX_FREE = ("envs", "launch", "configs")
JAX_STACK = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")


def _modules(root: str) -> dict[str, str]:
  """Dotted module name -> file, for every .py file of the project packages under `root`."""
  out = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(root, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
          out[dotted.removesuffix(".__init__")] = path
  return out


def _imports(tree: ast.Module):
  """(line, imported names, inside a function) of every absolute import in `tree`."""
  def walk(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Import):
        yield child.lineno, [a.name for a in child.names], in_function
      elif isinstance(child, ast.ImportFrom) and not child.level and child.module:
        yield child.lineno, [f"{child.module}.{a.name}" for a in child.names], in_function
      yield from walk(child, in_function or isinstance(
          child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
  yield from walk(tree, False)


def violations(root: str) -> list[str]:
  """Every broken rule of the module docstring in the project under `root`, as
  "file:line: what"."""
  modules = _modules(root)

  def resolve(name: str):  # the project module an imported name lives in (None: third-party)
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  found, edges = [], {}
  for module, path in sorted(modules.items()):
    package = module.split(".")[0]
    where = os.path.relpath(path, root)
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    targets = edges.setdefault(module, {})
    for line, names, in_function in _imports(tree):
      top = names[0].split(".")[0]
      if package in JAX_FREE and top in JAX_STACK:
        found.append(f"{where}:{line}: {package} must not import {names[0]} (no JAX)")
      project = {resolve(n) for n in names} - {None, module}
      for target in sorted(project):
        targets.setdefault(target, line)
        if target.split(".")[0] not in ALLOWED[package]:
          found.append(f"{where}:{line}: {package} may not import {target}")
        if in_function:
          found.append(f"{where}:{line}: {target} imported inside a function (import it at "
                       "the top)")
  found += _cycles(edges, modules, root)
  return found


def _cycles(edges: dict, modules: dict, root: str) -> list[str]:
  """One line per import cycle (Tarjan's strongly connected components)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, {}):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        first = min(component)
        step = next(w for w in edges[first] if w in component)
        out.append(f"{os.path.relpath(modules[first], root)}:{edges[first][step]}: import "
                   f"cycle between {sorted(component)}")

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_the_project_follows_the_import_rules():
  assert violations(ROOT) == []


def test_configs_and_launch_import_without_jax():
  """Every config file and launcher imports (and builds its config) with the JAX stack
  unimportable."""
  configs = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                   if f.endswith(".py") and f != "__init__.py")
  code = textwrap.dedent(f"""
      import importlib, sys
      for name in {JAX_STACK!r}:
        sys.modules[name] = None  # `import jax` raises ImportError
      for name in {configs!r}:
        module = importlib.import_module("configs." + name)
        getattr(module, "get_config", getattr(module, "base_config", None))()
      for name in ("launch.common", "launch.tpu", "launch.xm", "launch.fleet"):
        importlib.import_module(name)
      print("ok")
  """)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _write(root, files: dict[str, str]) -> None:
  for path, text in files.items():
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
      f.write(textwrap.dedent(text))


def test_the_checker_reports_each_kind_of_violation(tmp_path):
  """A synthetic project with one violation of each rule: each is reported at its line."""
  _write(tmp_path, {
      "envs/__init__.py": "",
      "envs/policy.py": "import dataclasses\n",
      "envs/worker.py": "import os\nimport jax\n",
      "models/__init__.py": "",
      "models/engine/__init__.py": "",
      "models/engine/loop.py": "import numpy\nfrom envs.policy import SamplingParams\n",
      "models/a.py": "import models.b\n",
      "models/b.py": "def f():\n  from models import a\n",
      "trainer/__init__.py": "",
      "trainer/config.py": "import optax\n",
      "trainer/rl.py": "def run():\n  from trainer import config\n",
      "configs/__init__.py": "",
      "configs/rl.py": "from trainer.config import base_config\n",
      "launch/__init__.py": "",
      "launch/tpu.py": "from models import engine\n",
      "rl/__init__.py": "",
  })
  found = violations(str(tmp_path))
  expected = [
      "envs/worker.py:2: envs must not import jax",
      "models/engine/loop.py:2: models may not import envs.policy",
      "configs/rl.py:1: configs may not import trainer.config",
      "launch/tpu.py:1: launch may not import models.engine",
      "trainer/rl.py:2: trainer.config imported inside a function",
      "models/b.py:2: models.a imported inside a function",
      "models/a.py:1: import cycle between ['models.a', 'models.b']",
  ]
  for line in expected:
    assert any(f.startswith(line) for f in found), (line, found)
  assert len(found) == len(expected), found  # nothing else: trainer may import optax
