"""The fleet's docker sandbox backend: the engine, the images and their boot-script steps.

    python -m launch.fleet ... --sandbox_backend docker \\
        --image arbor-env:0123abcd=gs://B/images/arbor-env-0123abcd.tar.gz \\
        --image swebench/sweb.eval.x86_64.django_1776_django-11099:latest

Images reach the VMs one of two ways, per `--image`:
  REF=gs://BUCKET/PATH.tar.gz   a saved image in a bucket, shipped once from a machine that has
                                it (an environment built by `python -m envs.environments`):
                                    docker save REF | gzip > IMAGE.tar.gz
                                    gcloud storage cp IMAGE.tar.gz gs://BUCKET/PATH.tar.gz
                                and loaded at boot (`docker load`); the tarball must hold REF;
  REF                           pulled at boot from its registry (the VMs reach registries
                                through Cloud NAT; they have no external address).
An image already in the VM's engine (a reboot) is not fetched again. The list is the sandbox
servers' allow-list (`--image` of `envs.sandbox_server`), the first the default.

The engine: Debian's docker.io, whose own units are masked before it is installed (they would
start dockerd with its default bridge network and firewall rules), started instead by the unit
arbor-dockerd with the arguments `envs.sandbox.docker_engine` uses (no bridge, iptables left
alone), so no container can be given a network. The sandbox server's unit requires it.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from envs.sandbox.docker_engine import DOCKERD_ARGS, PIDFILE
from launch import common
from launch.common import LaunchError

DOCKERD = "/usr/sbin/dockerd"
IMAGES_DIR = "/var/lib/arbor/images"
UNIT = "arbor-dockerd.service"
# A Docker image reference: [registry[:port]/]path[:tag][@digest], lower-case path components.
_REF = re.compile(r"^[a-z0-9][a-z0-9._-]*(:[0-9]+)?(/[a-z0-9][a-z0-9._-]*)*"
                  r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")


@dataclasses.dataclass(frozen=True)
class FleetImage:
  """One image of the fleet's sandbox servers.

  Attributes:
    ref: the image reference the servers allow (`--image` of `envs.sandbox_server`).
    tarball: gs:// URL of `docker save REF | gzip`; "" to pull REF from its registry.
  """

  ref: str
  tarball: str = ""


def parse_image(flag: str, value: str) -> FleetImage:
  """A `--image` value: "REF=gs://BUCKET/PATH.tar.gz" or "REF".

  Raises:
    LaunchError: REF is not an image reference, or the URL is not a gs:// .tar.gz file; the
      message names the flag and the value.
  """
  ref, sep, url = value.partition("=")
  if not _REF.match(ref):
    raise LaunchError(f"{flag}={value!r}: {ref!r} is not an image reference "
                      "([registry/]name[:tag], lower-case name)")
  if not sep:
    return FleetImage(ref)
  common.check_gcs(flag, url)
  if not url.endswith((".tar.gz", ".tgz")):
    raise LaunchError(f"{flag}={value!r}: expected REF=gs://BUCKET/PATH.tar.gz (the output of "
                      "`docker save REF | gzip`)")
  return FleetImage(ref, url)


def dockerd_unit() -> str:
  """The systemd unit of the engine: `dockerd` with `docker_engine.DOCKERD_ARGS`."""
  argv = [DOCKERD, *DOCKERD_ARGS, f"--pidfile={PIDFILE}"]
  return "\n".join([
      "[Unit]", "Description=Docker engine of the Arbor sandboxes (no bridge, no iptables)",
      "After=containerd.service", "[Service]", "ExecStart=" + shlex.join(argv),
      "Delegate=yes", "KillMode=process", "LimitNOFILE=1048576", "TasksMax=infinity",
      "Restart=always", "RestartSec=2", "TimeoutStartSec=0", "[Install]",
      "WantedBy=multi-user.target"])


def boot_lines(images: tuple[FleetImage, ...]) -> list[str]:
  """The boot script's lines that install and start the engine and bring in `images`."""
  q = shlex.quote
  lines = [
      "# the Docker engine: Debian's units masked before the package could start them (a",
      "# bridge network and firewall rules); ours runs dockerd without either",
      "systemctl mask docker.service docker.socket",
      "apt-get -qq install -y docker.io",
      f"cat > /etc/systemd/system/{UNIT} <<'ARBOR_EOF'", dockerd_unit(), "ARBOR_EOF",
      "systemctl daemon-reload",
      f"systemctl enable --now {UNIT}",
      "for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 1; done",
      "docker info >/dev/null",
      "# the images (kept across reboots by the engine: fetched only when absent)",
      f"install -d -m 0700 {IMAGES_DIR}",
  ]
  for i, image in enumerate(images):
    ref = q(image.ref)
    if image.tarball:
      file = f"{IMAGES_DIR}/{i}.tar.gz"
      lines += [f"if ! docker image inspect {ref} >/dev/null 2>&1; then",
                f"  gcloud storage cp {q(image.tarball)} {file}",
                f"  gunzip -c {file} | docker load",
                f"  rm -f {file}",
                f"  docker image inspect {ref} >/dev/null  # the tarball must hold {ref}",
                "fi"]
    else:
      lines.append(f"docker image inspect {ref} >/dev/null 2>&1 || docker pull {ref}")
  return lines


def server_flags(images: tuple[FleetImage, ...]) -> list[str]:
  """The sandbox server's flags of the docker backend: its image allow-list."""
  return ["--backend=docker", *(f"--image={i.ref}" for i in images)]
