"""Image profiles of the docker backend: how a sandbox starts from an image, by its name.

    profile = profile_for("swebench/sweb.eval.x86_64.django_1776_django-11099:latest")
    profile.workspace   # "/testbed"
    profile.env         # PATH and CONDA_* as `conda activate testbed` sets them

A profile says where the workspace is (the commands' working directory and the tmpfs the
sandbox writes), what every command's environment adds, the default sandbox user, whether
the image already holds the repository at the workspace path (then the tmpfs is seeded with a
copy of it when the sandbox starts), and whether the image may be pulled from a registry.

Profiles, first match wins (`PROFILES`):
  swebench   SWE-bench's per-instance images `swebench/sweb.eval.x86_64.<id>:<tag>` (with
             "__" of the instance id spelled "_1776_"), images the harness builds locally as
             `sweb.eval.<arch>.<id>`, and SWE-Gym's `xingyaoww/sweb.eval.x86_64.<id>`;
  swesmith   SWE-smith's `jyangballin/swesmith.x86_64.<owner>_1776_<repo>.<commit>`;
  arbor      everything else: Arbor's own images (`envs.environments`: `arbor-env:...`,
             `arbor-debian:...`) and any plain image; the workspace is an empty /workspace.

What the SWE profiles encode comes from the swebench package (`swebench.image_builder` and
`swebench.harness.run_evaluation`): the repository is cloned to /testbed (CONTAINER_WORKDIR),
`chmod -R 777` "so nonroot user can run tests", and installed in editable mode into the conda
environment `testbed` (CONTAINER_ENV_NAME) of the Miniconda at /opt/miniconda3; the harness's
eval script runs `source /opt/miniconda3/bin/activate; conda activate testbed; cd /testbed`.
`CONDA_ENV` below is what those two activations leave in the environment (the conda
variables and PATH); activation hooks a package of the environment may add under
etc/conda/activate.d are not run. The harness runs as root; a sandbox never does: its user
owns the seeded copy of /testbed instead. SWE-smith's images follow SWE-bench's layout.
The published images themselves are not run by Arbor's tests (no registry is reachable
there): the tests build a local image of the same layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

CONDA_ROOT = "/opt/miniconda3"
CONDA_ENV_NAME = "testbed"
_CONDA_PREFIX = f"{CONDA_ROOT}/envs/{CONDA_ENV_NAME}"
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# `source /opt/miniconda3/bin/activate` (base, level 1), then `conda activate testbed` (2).
CONDA_ENV = (
    ("PATH", f"{_CONDA_PREFIX}/bin:{CONDA_ROOT}/condabin:{_SYSTEM_PATH}"),
    ("CONDA_DEFAULT_ENV", CONDA_ENV_NAME),
    ("CONDA_PREFIX", _CONDA_PREFIX),
    ("CONDA_PREFIX_1", CONDA_ROOT),
    ("CONDA_SHLVL", "2"),
    ("CONDA_EXE", f"{CONDA_ROOT}/bin/conda"),
    ("CONDA_PYTHON_EXE", f"{CONDA_ROOT}/bin/python"),
    ("CONDA_PROMPT_MODIFIER", f"({CONDA_ENV_NAME}) "),
)
# A workspace path is interpolated into the backend's shell scripts: plain characters only.
_SAFE_PATH = re.compile(r"^(/[A-Za-z0-9_.-]+)+$")


@dataclasses.dataclass(frozen=True)
class ImageProfile:
  """How the docker backend starts a sandbox from a matching image.

  Attributes:
    name: the profile's name.
    pattern: a regular expression `re.match`ed against the image reference.
    workspace: the workspace's absolute path (a tmpfs; the commands' working directory).
    env: (name, value) pairs every command's environment gets (a request's own `env` wins).
    user: the default sandbox user "uid[:gid]" (never root; numeric ids need no passwd entry).
    seed: the image holds the repository at `workspace`: the tmpfs starts as a copy of it
      (files owned by the sandbox user, modes kept), so what the image built in place (an
      editable install's compiled extensions, its egg-info) is there; else it starts empty.
    pull: the image may be pulled from a registry when the engine lacks it (Arbor's own
      images are built locally and never pulled).
  """

  name: str
  pattern: str
  workspace: str = "/workspace"
  env: tuple[tuple[str, str], ...] = ()
  user: str = "65534:65534"
  seed: bool = False
  pull: bool = True

  def __post_init__(self):
    if not _SAFE_PATH.match(self.workspace) or "/." in self.workspace:
      raise ValueError(f"profile {self.name}: workspace={self.workspace!r}: expected an "
                       "absolute path of letters, digits, '_', '-', '.' with no dot segments")
    uid, _, gid = self.user.partition(":")
    if uid in ("0", "root", "") or gid in ("0", "root"):
      raise ValueError(f"profile {self.name}: user={self.user!r}: never root")


SWEBENCH = ImageProfile(
    "swebench", r"^(docker\.io/)?((swebench|xingyaoww)/)?sweb\.eval\.[a-z0-9_]+\.",
    workspace="/testbed", env=CONDA_ENV, seed=True)
SWESMITH = ImageProfile(
    "swesmith", r"^(docker\.io/)?jyangballin/swesmith\.", workspace="/testbed", env=CONDA_ENV,
    seed=True)
ARBOR = ImageProfile("arbor", r"", pull=False)
# Arbor's local image repositories: never looked up in a registry.
_LOCAL = re.compile(r"^arbor-[a-z0-9-]+(:|$)")
PROFILES: tuple[ImageProfile, ...] = (SWEBENCH, SWESMITH)
_PRESENT: set[tuple[str, str]] = set()  # (engine, image) found by `ensure_image`


def profile_for(image: str, profiles: Optional[tuple[ImageProfile, ...]] = None
                ) -> ImageProfile:
  """The profile of `image`: the first of `profiles` (default `PROFILES`) whose pattern
  matches, else `ARBOR` (for an image that is not one of Arbor's repositories, with pulling
  allowed).

  Raises:
    ValueError: `image` is not a non-empty string.
  """
  if not isinstance(image, str) or not image.strip():
    raise ValueError(f"image={image!r}: expected an image reference (name[:tag] or id)")
  for p in PROFILES if profiles is None else profiles:
    if re.match(p.pattern, image):
      return p
  return ARBOR if _LOCAL.match(image) else dataclasses.replace(ARBOR, pull=True)


def ensure_image(client, image: str, pull: bool) -> None:
  """Makes sure the engine has `image`: present, or pulled when `pull` and a registry answers.

  Args:
    client: a docker-py client.
    image: the image reference.
    pull: try `docker pull` when it is absent.

  Raises:
    LookupError: the image is absent and cannot be had; the message names the image, says
      whether a registry was tried (and what it answered), and names the fallbacks: an
      environment built locally (`python -m envs.environments`) or a saved image loaded with
      `docker load`.
  """
  import docker
  key = (client.api.base_url, image)
  if key in _PRESENT:  # one look-up per image and process: creates stay one round trip
    return
  try:
    client.images.get(image)
    _PRESENT.add(key)
    return
  except docker.errors.ImageNotFound:
    pass
  fallback = ("build the environment locally instead (python -m envs.environments, "
              "backend docker) or load a saved image (gunzip -c IMAGE.tar.gz | docker load)")
  if not pull:
    raise LookupError(f"image={image!r} is not in the local Docker engine and is never pulled "
                      f"(one of Arbor's local images); {fallback}")
  try:
    client.images.pull(image)
  except Exception as e:  # docker.errors.APIError / ImageNotFound: no registry answers
    raise LookupError(f"image={image!r} is not in the local Docker engine and no registry "
                      f"answers a pull ({str(e)[:300]}); {fallback}") from e
  _PRESENT.add(key)


def read_folder(client, image: str, path: str, sink) -> None:
  """Streams the engine's tar archive of folder `path` of `image` into `sink(bytes)`.

  The archive comes from a container created from the image and never started (no code of
  the image runs; the engine reads the file system), removed afterwards. Its entries sit
  under the folder's own name (`testbed/...`); nothing here parses them.

  Raises:
    LookupError: the image has no such folder (the message names image and path).
  """
  import docker
  source = client.containers.create(image, ["true"], network_mode="none",
                                    labels={"arbor.sandbox": "seed"})
  try:
    try:
      chunks, _ = source.get_archive(path)
    except docker.errors.NotFound as e:
      raise LookupError(f"image={image!r} has no folder {path}: {str(e)[:200]}") from None
    for chunk in chunks:
      sink(chunk)
  finally:
    source.remove(force=True)
