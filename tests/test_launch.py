"""launch/: dry-run outputs parsed and checked, boot scripts executed with a fake metadata server
and a fake trainer, the requeue loop driven by a fake gcloud, sweeps, and a local fleet; dry
runs start no process, bad flag and config values are one line naming the flag or field and
the value, and the README's launch commands pass as written.

Nothing here reaches Google Cloud: gcloud is never installed on the test machines.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from launch import common, config_check, fleet, local_fleet, tpu, xm
from launch.common import LaunchError

REPO = common.REPO_ROOT
TPU_ARGS = ["--config=configs/smoke.py:tiny-dense", "--tpu=v5p-128", "--zone", "us-east5-a",
            "--project", "my-proj", "--workdir", "gs://bucket/run", "--config.seed=3"]


def run_main(module, argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = module.main(list(argv))
  return rc, out.getvalue(), err.getvalue()


def split_dry_run(text: str) -> tuple[str, list[list[str]]]:
  """(the boot script, the gcloud commands as argv lists) of a dry-run listing."""
  m = re.search(r"# ---- boot script[^\n]*\n(.*?)\n# ---- end of boot script[^\n]*", text, re.S)
  assert m, text
  after = text[m.end():]
  commands = [shlex.split(line) for line in after.splitlines()
              if line.strip() and not line.startswith("#")]
  return m.group(1) + "\n", commands


def heredoc(script: str, target: str) -> str:
  m = re.search(r"cat > " + re.escape(target) + r" <<'ARBOR_EOF'\n(.*?)\nARBOR_EOF", script, re.S)
  assert m, f"no heredoc for {target}"
  return m.group(1) + "\n"


def bash_syntax_ok(script: str) -> None:
  r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
  assert r.returncode == 0, r.stderr


def flags(argv: list[str]) -> dict[str, str]:
  return {a.split("=", 1)[0]: (a.split("=", 1)[1] if "=" in a else "") for a in argv
          if a.startswith("--")}


def spaced_flags(argv: list[str]) -> dict[str, str]:
  """Flags written `--FLAG VALUE` (a flag followed by another flag has the value "")."""
  nxt = argv[1:] + [""]
  return {a: ("" if v.startswith("--") else v) for a, v in zip(argv, nxt) if a.startswith("--")}


# ---------------------------------------------------------------------------------------------
# Flags of every launcher

HELP_FLAGS = {
    tpu: ["--config", "--detach", "--dry_run", "--git_ref", "--git_url", "--internal_ips",
          "--libtpu_init_args", "--logs_worker", "--max_requeues", "--name", "--network",
          "--project", "--runtime_version", "--secret", "--service_account",
          "--skip_config_check", "--spot", "--subnetwork", "--teardown", "--tpu", "--workdir",
          "--zone"],
    xm: ["--config", "--dry_run", "--executor", "--name", "--project", "--secret", "--spot",
         "--sweep", "--title", "--tpu", "--workdir", "--zone"],
    fleet: ["--allow_plaintext_redis", "--chat", "--concurrency", "--default_environment",
            "--dry_run", "--env_from", "--grace",
            "--group_size", "--image", "--keep_dir", "--local", "--machine_type",
            "--max_sandboxes", "--name",
            "--network", "--policy_token_file", "--policy_token_secret", "--policy_url",
            "--project", "--queue_prefix", "--ready_file", "--redis", "--redis_ca_secret",
            "--redis_password_file", "--redis_password_secret", "--sandbox_backend",
            "--sandbox_servers", "--sandbox_token_secret", "--service_account", "--spot",
            "--staging", "--subnet", "--tasks", "--teardown", "--tokenizer", "--warm",
            "--workers", "--zone"],
}


@pytest.mark.parametrize("module", [tpu, xm, fleet], ids=["tpu", "xm", "fleet"])
def test_help_lists_every_flag(module):
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
    module.main(["--help"])
  assert e.value.code == 0
  listed = re.findall(r"^  (--[a-z_]+)", out.getvalue(), re.M)
  assert sorted(set(listed) - {"--help"}) == HELP_FLAGS[module]


@pytest.mark.parametrize("module,argv,defaults", [
    (tpu, ["--tpu=v5p-8", "--zone=z", "--project=p"],
     {"name": None, "spot": False, "secret": [], "service_account": "", "network": "",
      "teardown": False, "dry_run": False}),
    (xm, ["--config=c", "--workdir=w"],
     {"zone": "", "project": "", "name": "", "spot": False, "secret": [], "dry_run": False}),
    (fleet, [],
     {"name": "arbor-fleet", "project": "", "zone": "", "network": "default",
      "service_account": "", "spot": False, "teardown": False, "dry_run": False}),
], ids=["tpu", "xm", "fleet"])
def test_cloud_flag_defaults(module, argv, defaults):
  args = vars(module.build_parser().parse_known_args(argv)[0])
  assert {k: args[k] for k in defaults} == defaults


def test_tpu_zone_and_project_are_required():
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
    tpu.build_parser().parse_args(["--tpu=v5p-8", "--zone=z"])
  assert e.value.code == 2 and "--project" in err.getvalue()


# ---------------------------------------------------------------------------------------------
# launch.tpu


@pytest.mark.parametrize("tpu_type,chips,hosts", [
    ("v5p-8", 4, 1), ("v5p-16", 8, 2), ("v5p-128", 64, 16), ("v5p-1024", 512, 128),
    ("v4-32", 16, 4), ("v5litepod-8", 8, 1), ("v5litepod-16", 16, 4), ("v6e-4", 4, 1),
    ("v6e-8", 8, 1), ("v6e-16", 16, 4), ("v6e-256", 256, 64)])
def test_accelerator_hosts(tpu_type, chips, hosts):
  s = tpu.parse_accelerator(tpu_type)
  assert (s.chips, s.hosts) == (chips, hosts)


@pytest.mark.parametrize("bad,words", [
    ("v5p-12", "4-chip hosts"), ("v5p-7", "multiple of 2"), ("v6e-12", "valid"),
    ("v7-8", "expected TYPE-N"), ("tpu", "expected TYPE-N"), ("v5p-20000", "largest")])
def test_accelerator_errors_name_flag(bad, words):
  with pytest.raises(LaunchError, match=r"--tpu=") as e:
    tpu.parse_accelerator(bad)
  assert words in str(e.value)


def test_tpu_dry_run_commands_well_formed():
  rc, out, _ = run_main(tpu, TPU_ARGS + ["--spot", "--secret", "hf=hf-token", "--dry_run"])
  assert rc == 0
  script, cmds = split_dry_run(out)
  assert all(c[0] == "gcloud" for c in cmds), cmds
  by_verb = {" ".join(c[1:5]): c for c in cmds}
  create = by_verb["compute tpus queued-resources create"]
  f = flags(create)
  assert create[5] == f["--node-id"] == "arbor-smoke-v5p-128"
  assert f["--accelerator-type"] == "v5p-128" and f["--runtime-version"] == "v2-alpha-tpuv5"
  assert f["--zone"] == "us-east5-a" and f["--project"] == "my-proj" and "--spot" in f
  assert f["--metadata-from-file"].startswith("startup-script=")
  ssh = [c for c in cmds if c[1:4] == ["compute", "tpus", "tpu-vm"]]
  start = [c for c in ssh if "--worker=all" in c]
  assert len(start) == 1 and "startup-script" in flags(start[0])["--command"]
  assert any(c[1:3] == ["storage", "cp"] and c[-1] == "gs://bucket/run/code/arbor-src.tar.gz"
             for c in cmds)
  assert "--force" in out and "queued-resources delete" in out  # the requeue / teardown path
  bash_syntax_ok(script)
  assert "gcloud secrets versions access latest --secret=hf-token --project=my-proj " \
         "--out-file=/run/arbor/secrets/hf" in script
  assert "umask 077" in script


def test_tpu_on_demand_has_no_spot():
  rc, out, _ = run_main(tpu, TPU_ARGS + ["--dry_run"])
  _, cmds = split_dry_run(out)
  create = next(c for c in cmds if c[1:5] == ["compute", "tpus", "queued-resources", "create"])
  assert "--spot" not in create


def test_tpu_unit_lets_sigterm_reach_python():
  _, out, _ = run_main(tpu, TPU_ARGS + ["--spot", "--dry_run"])
  script, _ = split_dry_run(out)
  unit = heredoc(script, "/etc/systemd/system/arbor-train.service")
  for line in ("ExecStart=/opt/arbor/train.sh", "KillMode=mixed", "KillSignal=SIGTERM",
               "After=network-online.target", "Restart=no"):
    assert line in unit.splitlines()
  wrapper = heredoc(script, "/opt/arbor/train.sh")
  bash_syntax_ok(wrapper)
  last = wrapper.strip().splitlines()[-1]
  assert last.startswith("exec ")  # no shell left between systemd and Python
  argv = shlex.split(last)[1:]
  assert argv[:3] == ["/opt/arbor/venv/bin/python", "-m", "trainer.main"]
  assert argv[3:] == ["--config=configs/smoke.py:tiny-dense", "--config.seed=3",
                      "--workdir=gs://bucket/run"]


def _fake_worker_env(tmp_path, wrapper: str, worker: int, endpoints: str, python_body: str):
  """Run the wrapper with curl answering like the TPU metadata server and a fake Python."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "curl").write_text(textwrap.dedent(f"""\
      #!/bin/bash
      case "${{@: -1}}" in
        */agent-worker-number) echo {worker} ;;
        */worker-network-endpoints) echo '{endpoints}' ;;
        *) exit 22 ;;
      esac
      """))
  python = tmp_path / "python"
  python.write_text("#!/bin/bash\n" + python_body)
  for p in (bin_dir / "curl", python):
    p.chmod(0o755)
  text = wrapper.replace(tpu.VENV + "/bin/python", str(python)).replace(
      f"cd {tpu.SRC}", f"cd {tmp_path}")
  path = tmp_path / f"train-{worker}.sh"
  path.write_text(text)
  path.chmod(0o755)
  env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / f"out-{worker}")}
  return path, env


def test_tpu_every_worker_gets_multihost_env(tmp_path):
  _, out, _ = run_main(tpu, TPU_ARGS + ["--dry_run"])
  wrapper = heredoc(split_dry_run(out)[0], "/opt/arbor/train.sh")
  endpoints = ",".join(f"t1v-n-abc-w-{i}:{i}:10.0.0.{10 + i}" for i in range(16))
  body = 'env | grep -E "^(JAX_|ARBOR_)" | sort > "$OUT"; echo "ARGV $*" >> "$OUT"\n'
  for worker in range(16):
    path, env = _fake_worker_env(tmp_path, wrapper, worker, endpoints, body)
    r = subprocess.run([str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    got = dict(line.split("=", 1) for line in open(env["OUT"]).read().splitlines()
               if "=" in line and not line.startswith("ARGV"))
    assert got == {"JAX_COORDINATOR_ADDRESS": "10.0.0.10:8476", "ARBOR_NUM_PROCESSES": "16",
                   "ARBOR_PROCESS_ID": str(worker), "JAX_PLATFORMS": "tpu"}
    assert "-m trainer.main --config=configs/smoke.py:tiny-dense" in open(env["OUT"]).read()
  # A slice whose metadata lists another number of workers than the table refuses to start.
  path, env = _fake_worker_env(tmp_path, wrapper, 0, "a,b,c", body)
  r = subprocess.run([str(path)], env=env, capture_output=True, text=True, timeout=30)
  assert r.returncode == 1 and "should have 16 workers" in r.stderr


def test_tpu_wrapper_execs_so_sigterm_reaches_trainer(tmp_path):
  _, out, _ = run_main(tpu, TPU_ARGS + ["--dry_run"])
  wrapper = heredoc(split_dry_run(out)[0], "/opt/arbor/train.sh")
  endpoints = "w0,w1,w2,w3,w4,w5,w6,w7,w8,w9,w10,w11,w12,w13,w14,w15"
  body = textwrap.dedent("""\
      trap 'echo "TERM in $$" >> "$OUT"; exit 0' TERM
      echo "ready $$" > "$OUT.ready"
      while true; do sleep 0.05; done
      """)
  path, env = _fake_worker_env(tmp_path, wrapper, 3, endpoints, body)
  proc = subprocess.Popen([str(path)], env=env)
  deadline = time.monotonic() + 20
  while not os.path.exists(env["OUT"] + ".ready") and time.monotonic() < deadline:
    time.sleep(0.02)
  assert open(env["OUT"] + ".ready").read().split() == ["ready", str(proc.pid)]  # exec'd
  proc.send_signal(signal.SIGTERM)  # what systemd sends the unit's main process
  assert proc.wait(10) == 0
  assert open(env["OUT"]).read().strip() == f"TERM in {proc.pid}"


def test_tpu_single_host_has_no_coordinator():
  _, out, _ = run_main(tpu, ["--config=configs/smoke.py", "--tpu=v6e-8", "--zone=us-east5-a",
                             "--project=my-proj", "--workdir=gs://bkt/r", "--dry_run"])
  wrapper = heredoc(split_dry_run(out)[0], "/opt/arbor/train.sh")
  assert "JAX_COORDINATOR_ADDRESS" not in wrapper
  assert "export ARBOR_NUM_PROCESSES=1 ARBOR_PROCESS_ID=0" in wrapper


def test_tpu_git_mode_and_teardown():
  _, out, _ = run_main(tpu, TPU_ARGS + ["--git_url=https://example.com/arbor.git",
                                        "--git_ref=v1", "--dry_run"])
  script, cmds = split_dry_run(out)
  assert not any(c[1:3] == ["storage", "cp"] for c in cmds)
  assert "git -C /opt/arbor/src checkout --quiet v1" in script
  rc, out, _ = run_main(tpu, ["--tpu=v5p-128", "--zone=us-east5-a", "--project=my-proj",
                              "--name=my-run", "--teardown", "--dry_run"])
  cmds = [shlex.split(l) for l in out.splitlines() if l and not l.startswith("#")]
  assert rc == 0 and cmds == [["gcloud", "compute", "tpus", "queued-resources", "delete",
                               "my-run", "--zone=us-east5-a", "--project=my-proj", "--force",
                               "--quiet"]]


@pytest.mark.parametrize("argv,words", [
    (["--workdir", "/local/dir"], "--workdir='/local/dir'"),
    (["--name", "Bad_Name"], "--name='Bad_Name'"),
    (["--config.nope=1"], "'nope' is not a field of configs/smoke.py"),
    (["--bogus=1"], "unknown argument '--bogus=1'"),
    (["--secret", "hf"], "--secret='hf'"),
    (["--max_requeues=-1"], "--max_requeues=-1"),
])
def test_tpu_bad_flags_clear_errors(argv, words):
  base = [a for a in TPU_ARGS if a not in ("--workdir", "gs://bucket/run")]
  if not any(a.startswith("--workdir") for a in argv):
    base += ["--workdir", "gs://bucket/run"]
  rc, out, err = run_main(tpu, base + argv + ["--dry_run"])
  assert rc == 2 and words in err and out == ""


def test_tpu_missing_config_file():
  rc, _, err = run_main(tpu, ["--config=configs/nope.py", "--tpu=v5p-8", "--zone=us-east5-a",
                              "--project=my-proj", "--workdir=gs://bkt/r", "--dry_run"])
  assert rc == 2 and "--config='configs/nope.py': no such file" in err


FAKE_GCLOUD = """#!/bin/bash
# Records every call; describe answers from a list of states, one per call.
echo "$*" >> "$GCLOUD_LOG"
if [ "$3" = "queued-resources" ] && [ "$4" = "describe" ]; then
  n=$(grep -c " describe " "$GCLOUD_LOG")
  sed -n "${n}p" "$GCLOUD_STATES" | grep . || tail -1 "$GCLOUD_STATES"
fi
exit 0
"""


@pytest.mark.parametrize("states,requeues", [
    (["ACTIVE", "ACTIVE"], 0),  # runs to the end
    (["ACTIVE", "SUSPENDED", "ACTIVE", "ACTIVE"], 1),  # preempted once, requeued, finishes
])
def test_tpu_run_and_requeue_with_fake_gcloud(tmp_path, monkeypatch, states, requeues):
  (tmp_path / "gcloud").write_text(FAKE_GCLOUD)
  (tmp_path / "gcloud").chmod(0o755)
  (tmp_path / "states").write_text("\n".join(states) + "\n")
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  monkeypatch.setenv("GCLOUD_LOG", str(tmp_path / "log"))
  monkeypatch.setenv("GCLOUD_STATES", str(tmp_path / "states"))
  monkeypatch.setattr(tpu.time, "sleep", lambda s: None)
  rc, out, _ = run_main(tpu, TPU_ARGS + ["--spot", "--max_requeues=2"])
  assert rc == 0, out
  calls = [line.split() for line in open(tmp_path / "log").read().splitlines()]
  verbs = [" ".join(c[:4]) if c[0] != "storage" else "storage cp" for c in calls]
  one_run = ["compute tpus queued-resources create", "compute tpus queued-resources describe",
             "compute tpus tpu-vm ssh", "compute tpus tpu-vm ssh",
             "compute tpus queued-resources describe"]
  expected = ["storage cp"] + one_run
  for _ in range(requeues):
    expected += ["compute tpus queued-resources delete"] + one_run
  assert verbs == expected


# ---------------------------------------------------------------------------------------------
# launch.xm


def test_sweep_expansion_count_and_overrides():
  rc, out, _ = run_main(xm, ["--config=configs/smoke.py", "--workdir=/tmp/sw", "--dry_run",
                             "--sweep=seed=0,1;model.preset=tiny-dense,tiny-qwen3",
                             "--config.batch=1"])
  assert rc == 0
  jobs = [shlex.split(l) for l in out.splitlines() if l and not l.startswith("#")]
  assert len(jobs) == 4
  points = []
  for argv in jobs:
    assert argv[1:4] == ["-m", "trainer.main", "--config=configs/smoke.py"]
    f = flags(argv)
    assert f["--config.batch"] == "1"
    points.append((f["--config.seed"], f["--config.model.preset"]))
  assert points == [("0", "tiny-dense"), ("0", "tiny-qwen3"), ("1", "tiny-dense"),
                    ("1", "tiny-qwen3")]
  workdirs = [flags(a)["--workdir"] for a in jobs]
  assert len(set(workdirs)) == 4 and all(w.startswith("/tmp/sw/") for w in workdirs)


def test_sweep_values_verbatim_and_parse_errors():
  axes = xm.parse_sweep("optimizer.learning_rate=1e-4,3e-4; rl.loss=grpo,cispo")
  assert axes == [("optimizer.learning_rate", ["1e-4", "3e-4"]), ("rl.loss", ["grpo", "cispo"])]
  assert len(xm.expand(axes, [], "w")) == 4
  for bad in ("lr", "=1,2", "a=1,,2", "a=1;a=2", "a=1,1", "a b=1"):
    with pytest.raises(LaunchError, match="--sweep"):
      xm.parse_sweep(bad)


def test_sweep_unknown_key_and_duplicate_override():
  rc, _, err = run_main(xm, ["--config=configs/smoke.py", "--workdir=w", "--dry_run",
                             "--sweep=lr=1e-4,3e-4;loss=grpo,cispo"])
  assert rc == 2 and "'lr' is not a field of configs/smoke.py" in err
  rc, _, err = run_main(xm, ["--config=configs/smoke.py", "--workdir=w", "--dry_run",
                             "--sweep=seed=1,2", "--config.seed=3"])
  assert rc == 2 and "'seed' is also given" in err


def test_sweep_on_tpu_dry_run_one_slice_per_job():
  rc, out, _ = run_main(xm, ["--config=configs/smoke.py", "--workdir=gs://bkt/sweep",
                             "--executor=tpu", "--tpu=v5p-16", "--zone=us-east5-a",
                             "--project=my-proj", "--sweep=seed=0,1", "--dry_run"])
  assert rc == 0
  creates = [shlex.split(l) for l in out.splitlines()
             if l.startswith("gcloud compute tpus queued-resources create")]
  assert [c[5] for c in creates] == ["arbor-smoke-v5p-16-0", "arbor-smoke-v5p-16-1"]
  execs = [l for l in out.splitlines() if l.startswith("exec /opt/arbor/venv/bin/python")]
  assert len(execs) == 2
  for i, line in enumerate(execs):
    f = flags(shlex.split(line))
    assert f["--config.seed"] == str(i) and f["--workdir"].startswith(f"gs://bkt/sweep/{i}_")
  rc, _, err = run_main(xm, ["--config=configs/smoke.py", "--workdir=gs://bkt/s",
                             "--executor=tpu", "--dry_run"])
  assert rc == 2 and "--executor=tpu needs --tpu" in err


def test_xm_local_without_xmanager_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "xmanager", None)  # import fails as if not installed
  rc, _, err = run_main(xm, ["--config=configs/smoke.py", "--workdir=w", "--sweep=seed=1"])
  assert rc == 2 and "needs the xmanager package" in err and xm.XMANAGER_PIN in err


def test_xm_local_builds_one_work_unit_per_job(monkeypatch):
  """Against a stub with xmanager's API (xm.binary, xm.Job, xm_local.create_experiment)."""
  added, packaged = [], []

  class Experiment:
    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def package(self, packageables):
      packaged.extend(packageables)
      return ["executable"]

    def add(self, job):
      added.append(job)

  stub_xm = types.SimpleNamespace(
      binary=lambda executor_spec, path, **kw: ("binary", path, executor_spec),
      Job=lambda executable, executor, args: {"executable": executable, "args": args})
  stub_local = types.SimpleNamespace(create_experiment=lambda experiment_title: Experiment(),
                                     LocalSpec=lambda: "local-spec", Local=lambda: "local")
  module = types.ModuleType("xmanager")
  module.xm, module.xm_local = stub_xm, stub_local
  monkeypatch.setitem(sys.modules, "xmanager", module)
  rc, _, _ = run_main(xm, ["--config=configs/smoke.py", "--workdir=/tmp/w",
                           "--sweep=seed=0,1,2"])
  assert rc == 0 and packaged == [("binary", sys.executable, "local-spec")]
  assert [flags(j["args"])["--config.seed"] for j in added] == ["0", "1", "2"]
  assert all(j["args"][:2] == ["-m", "trainer.main"] for j in added)


# ---------------------------------------------------------------------------------------------
# launch.fleet (cloud)

FLEET_ARGS = ["--workers=64", "--machine_type=e2-standard-8", "--project=my-proj",
              "--zone=us-central1-a",
              "--redis=rediss://10.0.0.5:6378", "--redis_password_secret=arbor-redis",
              "--redis_ca_secret=arbor-redis-ca", "--policy_url=http://10.0.0.2:8000",
              "--policy_token_secret=arbor-policy", "--staging=gs://bkt/fleet",
              "--tokenizer=gs://bkt/tok/tokenizer.json", "--subnet=arbor-sub"]


def test_fleet_dry_run_template_group_and_boot_script():
  rc, out, _ = run_main(fleet, FLEET_ARGS + ["--dry_run"])
  assert rc == 0
  script, cmds = split_dry_run(out)
  bash_syntax_ok(script)
  template = next(c for c in cmds if c[1:4] == ["compute", "instance-templates", "create"])
  f = flags(template)
  assert "--no-address" in f and f["--machine-type"] == "e2-standard-8"
  assert f["--subnet"] == "arbor-sub" and f["--region"] == "us-central1"
  assert f["--metadata-from-file"].startswith("startup-script=")
  assert f["--metadata"] == "enable-oslogin=TRUE"  # nothing secret in metadata
  group = next(c for c in cmds if c[1:5] == ["compute", "instance-groups", "managed", "create"])
  assert flags(group)["--size"] == "64" and flags(group)["--template"] == template[4]
  for secret, name in (("arbor-policy", "policy.token"), ("arbor-redis", "redis.password"),
                       ("arbor-redis-ca", "redis-ca.pem")):
    assert (f"gcloud secrets versions access latest --secret={secret} --project=my-proj "
            f"--out-file=/run/arbor/secrets/{name}") in script
  worker_unit = heredoc(script, "/etc/systemd/system/arbor-worker.service")
  assert "User=arbor" in worker_unit.splitlines()
  for name in ("policy.token", "redis.password", "sandbox.token", "redis-ca.pem"):
    assert f"LoadCredential={name}:/run/arbor/secrets/{name}" in worker_unit
  exec_start = next(l for l in worker_unit.splitlines() if l.startswith("ExecStart="))
  wf = flags(shlex.split(exec_start[len("ExecStart="):]))
  assert wf["--queue"] == "rediss://10.0.0.5:6378"
  assert wf["--queue_password_file"] == "%d/redis.password"
  assert wf["--queue_ca_file"] == "%d/redis-ca.pem"
  assert wf["--policy_token_file"] == "%d/policy.token"
  assert wf["--sandbox"] == "remote" and wf["--sandbox_url"] == "http://127.0.0.1:8910"
  assert wf["--token_file"] == "%d/sandbox.token"
  sandbox_unit = heredoc(script, "/etc/systemd/system/arbor-sandbox.service")
  sf = flags(shlex.split(next(l for l in sandbox_unit.splitlines()
                              if l.startswith("ExecStart="))[len("ExecStart="):]))
  assert sf["--host"] == "127.0.0.1" and sf["--backend"] == "bwrap"
  assert "secrets.token_hex(32)" in script  # no --sandbox_token_secret: generated on the VM


def test_fleet_docker_backend_boot_script():
  """--sandbox_backend docker: Debian's docker units masked before docker.io is installed, the
  engine started as envs.sandbox.docker_engine starts it (no bridge, no iptables), each image
  loaded from its tarball or pulled only when absent, the sandbox server on the docker backend
  with the images as its allow-list, after the engine."""
  from envs.sandbox import docker_engine
  images = ["arbor-env:0123abcd=gs://bkt/images/env.tar.gz",
            "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"]
  rc, out, _ = run_main(fleet, FLEET_ARGS + ["--sandbox_backend=docker", "--dry_run"] +
                        [f"--image={i}" for i in images])
  assert rc == 0
  script, _ = split_dry_run(out)
  bash_syntax_ok(script)
  lines = script.splitlines()
  mask = lines.index("systemctl mask docker.service docker.socket")
  assert mask < lines.index("apt-get -qq install -y docker.io")
  unit = heredoc(script, "/etc/systemd/system/arbor-dockerd.service")
  dockerd = shlex.split(next(l for l in unit.splitlines() if l.startswith("ExecStart="))
                        [len("ExecStart="):])
  assert dockerd[0] == "/usr/sbin/dockerd" and tuple(dockerd[1:4]) == docker_engine.DOCKERD_ARGS
  assert "--bridge=none" in dockerd and "--iptables=false" in dockerd
  start = lines.index("systemctl enable --now arbor-dockerd.service")
  load = lines.index("  gunzip -c /var/lib/arbor/images/0.tar.gz | docker load")
  assert mask < start < load < lines.index("systemctl enable --now arbor-sandbox.service")
  assert ("if ! docker image inspect arbor-env:0123abcd >/dev/null 2>&1; then" in lines and
          "  gcloud storage cp gs://bkt/images/env.tar.gz /var/lib/arbor/images/0.tar.gz"
          in lines)
  ref = images[1]
  assert f"docker image inspect {ref} >/dev/null 2>&1 || docker pull {ref}" in lines
  assert not any(w in script for w in ("docker run", "--network", "daemon.json", "docker0"))
  sandbox_unit = heredoc(script, "/etc/systemd/system/arbor-sandbox.service")
  assert "Requires=arbor-dockerd.service" in sandbox_unit.splitlines()
  argv = shlex.split(next(l for l in sandbox_unit.splitlines() if l.startswith("ExecStart="))
                     [len("ExecStart="):])
  assert "--backend=docker" in argv and "--host=127.0.0.1" in argv
  assert [a for a in argv if a.startswith("--image=")] == [
      "--image=arbor-env:0123abcd", f"--image={ref}"]
  assert not any(a.startswith(("--env_from", "--default_environment"))
                 for a in worker_command(script))
  rc, out, _ = run_main(fleet, FLEET_ARGS + ["--dry_run"])  # bwrap: no engine at all
  assert rc == 0 and "docker" not in split_dry_run(out)[0]
  # the workers give tasks their environments, whose images the servers are asked for
  rc, out, _ = run_main(fleet, FLEET_ARGS + ["--sandbox_backend=docker", "--dry_run",
                                             f"--image={images[0]}", "--env_from=repository",
                                             "--default_environment=bookworm-pytest"])
  assert rc == 0
  argv = worker_command(split_dry_run(out)[0])
  assert "--env_from=repository" in argv and "--default_environment=bookworm-pytest" in argv
  rc, _, err = run_main(fleet, FLEET_ARGS + ["--sandbox_backend=docker", "--dry_run",
                                             f"--image={images[0]}",
                                             "--default_environment=nope.toml"])
  assert rc != 0 and "--default_environment='nope.toml'" in err
  rc, _, err = run_main(fleet, FLEET_ARGS + ["--dry_run", "--env_from=repository"])
  assert rc != 0 and "use --sandbox_backend docker" in err


def worker_command(script: str) -> list[str]:
  """The rollout worker unit's argv in a boot script."""
  unit = heredoc(script, "/etc/systemd/system/arbor-worker.service")
  return shlex.split(next(l for l in unit.splitlines() if l.startswith("ExecStart="))
                     [len("ExecStart="):])


@pytest.mark.parametrize("extra,words", [
    (["--sandbox_backend=docker"], "--sandbox_backend docker needs --image"),
    (["--image=arbor-env:x"], "--image: only --sandbox_backend docker"),
    (["--sandbox_backend=docker", "--image=Bad Ref"], "--image='Bad Ref'"),
    (["--sandbox_backend=docker", "--image=a:b=gs://bkt/x.zip"], "PATH.tar.gz"),
    (["--sandbox_backend=docker", "--image=a:b=/local/x.tar.gz"], "--image='/local/x.tar.gz'"),
    (["--sandbox_backend=local"], "--sandbox_backend=local: a cloud fleet runs bwrap or docker"),
])
def test_fleet_docker_flag_errors(extra, words):
  rc, _, err = run_main(fleet, FLEET_ARGS + extra + ["--dry_run"])
  assert rc == 2 and words in err, err


def test_fleet_teardown():
  rc, out, _ = run_main(fleet, ["--teardown", "--name=arbor-fleet", "--project=my-proj",
                                "--zone=us-east5-a", "--dry_run"])
  cmds = [shlex.split(l) for l in out.splitlines() if l and not l.startswith("#")]
  assert rc == 0 and [c[1:5] for c in cmds] == [
      ["compute", "instance-groups", "managed", "delete"],
      ["compute", "instance-templates", "delete", "arbor-fleet-tpl"]]


def test_fleet_redis_password_never_echoed():
  password = secrets.token_hex(12)
  args = [a if not a.startswith("--redis=") else f"--redis=rediss://:{password}@10.0.0.5:6378"
          for a in FLEET_ARGS]
  rc, out, err = run_main(fleet, args + ["--dry_run"])
  assert rc == 2 and "--redis_password_secret" in err
  assert password not in out + err


@pytest.mark.parametrize("change,words", [
    ("--redis=redis://10.0.0.5:6379", "must use TLS (rediss://)"),
    ("--policy_url=ftp://x", "--policy_url='ftp://x'"),
    ("--staging=/local", "--staging='/local'"),
    ("--workers=0", "--workers=0"),
    ("--policy_token_secret=", "--policy_token_secret is required"),
    ("--tasks=../outside.jsonl", "--tasks='../outside.jsonl'"),
])
def test_fleet_bad_flags(change, words):
  key = change.split("=", 1)[0]
  args = [a for a in FLEET_ARGS if not a.startswith(key + "=")] + [change]
  rc, _, err = run_main(fleet, args + ["--dry_run"])
  assert rc == 2 and words in err


def test_fleet_plaintext_redis_when_allowed():
  args = [a for a in FLEET_ARGS if not a.startswith(("--redis=", "--redis_ca_secret"))]
  rc, out, _ = run_main(fleet, args + ["--redis=redis://10.0.0.5:6379",
                                       "--allow_plaintext_redis", "--dry_run"])
  assert rc == 0 and "--queue=redis://10.0.0.5:6379" in out


# ---------------------------------------------------------------------------------------------
# launch.fleet --local


@pytest.mark.skipif(not (shutil.which("redis-server") and shutil.which("bwrap")),
                    reason="needs redis-server and bwrap (make test installs them)")
def test_fleet_local_smoke(tmp_path):
  ready = tmp_path / "ready.json"
  proc = subprocess.Popen(
      [sys.executable, "-m", "launch.fleet", "--local", "--workers=0", "--sandbox_servers=1",
       f"--ready_file={ready}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  try:
    deadline = time.monotonic() + 60
    while not ready.exists():
      assert proc.poll() is None, proc.stdout.read()
      assert time.monotonic() < deadline
      time.sleep(0.05)
    info = json.loads(ready.read_text())
    assert oct(os.stat(info["dir"]).st_mode & 0o777) == "0o700"
    for f in (info["redis_password_file"], info["sandbox_token_file"]):
      assert os.stat(f).st_mode & 0o777 == 0o600
    token = open(info["sandbox_token_file"]).read().strip()
    password = open(info["redis_password_file"]).read().strip()
    url = info["sandbox_urls"][0]
    assert url.startswith("http://127.0.0.1:") and info["redis"].startswith("redis://127.0.0.1:")
    assert local_fleet.http_health(url, info["sandbox_token_file"])["ok"] is True
    wrong = tmp_path / "wrong"
    wrong.write_text("x" * 32)
    with pytest.raises(OSError, match="401"):
      local_fleet.http_health(url, str(wrong))
    port = int(info["redis"].rsplit(":", 1)[1])
    assert local_fleet.redis_ping(port, info["redis_password_file"])
    assert not local_fleet.redis_ping(port, str(wrong))
    cmdline = open(f"/proc/{info['pids']['redis']}/cmdline", "rb").read()
    assert password.encode() not in cmdline  # the password lives in a 0600 config file
  finally:
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
  assert proc.returncode == 0, output
  assert "stopped" in output and token not in output and password not in output
  for pid in info["pids"].values():
    assert not os.path.exists(f"/proc/{pid}") or \
        open(f"/proc/{pid}/stat").read().split()[2] == "Z"
  assert not os.path.exists(info["dir"])


def test_fleet_local_flag_errors():
  rc, _, err = run_main(fleet, ["--local", "--workers=2"])
  assert rc == 2 and "needs --policy_url" in err
  rc, _, err = run_main(fleet, ["--local", "--workers=1", "--policy_url=http://127.0.0.1:1",
                                "--tokenizer=t", "--sandbox_servers=0"])
  assert rc == 2 and "--sandbox_servers=0" in err


# ---------------------------------------------------------------------------------------------
# Dry runs start nothing


SERVICES = re.compile(r"redis-server|sandbox_server|rollout_worker|trainer\.main|gcloud")


def session_processes(sid: int) -> list[tuple[int, str]]:
  """(pid, command line) of every process in session `sid`."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # exited meanwhile
      continue
    if int(stat[stat.rindex(")") + 2:].split()[3]) == sid:  # state, ppid, pgrp, session
      found.append((int(pid), cmdline))
  return found


def run_cli(argv: list[str], tmp_path, timeout: float = 60.0):
  """Runs `python -m ARGV` in a session of its own, watching the session's processes.

  Returns:
    (exit status, stdout, stderr, the command lines of the other processes seen in the session
    while it ran, those left after it exited, the files written to its TMPDIR).
  """
  tmpdir = tmp_path / "tmpdir"
  tmpdir.mkdir(exist_ok=True)
  env = dict(os.environ, TMPDIR=str(tmpdir))
  proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
  seen, deadline = set(), time.monotonic() + timeout
  try:
    while proc.poll() is None and not any(SERVICES.search(c) for c in seen):
      seen |= {c for pid, c in session_processes(proc.pid) if pid != proc.pid}
      assert time.monotonic() < deadline, f"{argv} still running after {timeout} s: {seen}"
      time.sleep(0.01)
    left = [c for pid, c in session_processes(proc.pid) if pid != proc.pid]
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)  # whatever a broken dry run started
    out, err = proc.communicate()
  return proc.returncode, out, err, sorted(seen), left, sorted(os.listdir(tmpdir))


def _dry_run_argv(name: str, tmp_path) -> list[str]:
  tokenizer = tmp_path / "tokenizer.json"
  tokenizer.write_text("{}")
  return {
      "fleet --local": ["launch.fleet", "--local", "--workers=2",
                        "--policy_url=http://127.0.0.1:8000", f"--tokenizer={tokenizer}"],
      "fleet": ["launch.fleet", *FLEET_ARGS],
      "tpu": ["launch.tpu", *TPU_ARGS],
      "xm": ["launch.xm", "--config=configs/smoke.py", f"--workdir={tmp_path}/sweep",
             "--sweep=seed=0,1", "--executor=subprocess"],
  }[name] + ["--dry_run"]


@pytest.mark.parametrize("name", ["fleet --local", "fleet", "tpu", "xm"])
def test_dry_run_starts_no_process(tmp_path, name):
  rc, out, err, seen, left, written = run_cli(_dry_run_argv(name, tmp_path), tmp_path)
  assert not [c for c in seen if SERVICES.search(c)], seen
  assert rc == 0 and left == [] and written == [], err
  if name == "fleet --local":  # it prints what it would run instead, secrets as file names
    commands = [shlex.split(l) for l in out.splitlines() if l and not l.startswith("#")]
    assert [c[0] if c[0] == "redis-server" else c[2] for c in commands] == [
        "redis-server", "envs.sandbox_server", "envs.sandbox_server", "envs.rollout_worker",
        "envs.rollout_worker"]
    workers = [spaced_flags(c) for c in commands if c[2:3] == ["envs.rollout_worker"]]
    assert [w["--sandbox_url"] for w in workers] == [
        "http://127.0.0.1:SANDBOX_0_PORT", "http://127.0.0.1:SANDBOX_1_PORT"]
    assert all(w["--queue_password_file"].endswith("/redis.password") for w in workers)
    assert "requirepass" not in out


def test_fleet_local_plan_is_what_start_runs():
  f = local_fleet.LocalFleet(workers=1, sandbox_servers=1, policy_url="http://127.0.0.1:1",
                             tokenizer="t.json", policy_token_file="/secrets/policy")
  plan = [list(c.argv) for c in f.plan()]
  assert plan[1] == f.sandbox_argv(0, f"{local_fleet.PLAN_DIR}/sandbox-0.port",
                                   f"{local_fleet.PLAN_DIR}/sandbox.token")
  assert spaced_flags(plan[2])["--policy_token_file"] == "/secrets/policy"
  assert f.dir == "" and f.procs == []  # nothing made


# ---------------------------------------------------------------------------------------------
# Values checked before anything starts

RL_ARGS = ["--config=configs/rl.py", "--tpu=v5p-64", "--zone=us-east5-a", "--project=my-proj",
           "--workdir=gs://bkt/run", "--config.metrics.dir=/tmp/arbor_metrics",
           "--config.model.init=hf:gs://bkt/qwen", "--config.rl.tasks=gs://bkt/tasks.jsonl",
           "--config.rl.queue_url=redis://10.0.0.5:6379", "--config.mesh.tensor=2",
           "--config.data.rows_per_batch=16"]


def changed(base: list[str], *changes: str) -> list[str]:
  """`base` with each change's flag replaced (a change "-FLAG" drops FLAG)."""
  keys = {c.lstrip("-").split("=", 1)[0] for c in changes}
  kept = [a for a in base if a.lstrip("-").split("=", 1)[0] not in keys]
  return kept + [c for c in changes if not c.startswith("-" * 3)]


def test_rl_template_on_a_slice_copies_its_gs_inputs():
  rc, out, err = run_main(tpu, RL_ARGS + ["--dry_run"])
  assert rc == 0, err
  script, _ = split_dry_run(out)
  bash_syntax_ok(script)
  assert ("mkdir -p /opt/arbor/inputs/0 && gcloud storage cp -r gs://bkt/qwen "
          "/opt/arbor/inputs/0/") in script.splitlines()
  assert ("mkdir -p /opt/arbor/inputs/1 && gcloud storage cp -r gs://bkt/tasks.jsonl "
          "/opt/arbor/inputs/1/") in script.splitlines()
  trainer = flags(shlex.split(heredoc(script, "/opt/arbor/train.sh").splitlines()[-1]))
  assert trainer["--config.model.init"] == "hf:/opt/arbor/inputs/0/qwen"
  assert trainer["--config.rl.tasks"] == "/opt/arbor/inputs/1/tasks.jsonl"
  assert trainer["--config.mesh.tensor"] == "2" and trainer["--workdir"] == "gs://bkt/run"
  # A path inside the repository ships with the code: passed on as it is, nothing copied.
  rc, out, _ = run_main(tpu, changed(RL_ARGS, "--config.rl.tasks=envs/data/swe/tasks.jsonl")
                        + ["--dry_run"])
  script, _ = split_dry_run(out)
  assert rc == 0 and "gs://bkt/tasks.jsonl" not in script
  assert "--config.rl.tasks=envs/data/swe/tasks.jsonl" in script


def test_sft_sources_on_a_slice_keep_their_order():
  cfg = config_check.load("configs/sft.py:qwen3", [
      "--config.data.sources=('gs://bkt/a.jsonl', 'envs/data/problems.jsonl')",
      "--config.data.eval_sources=()", "--config.model.init=hf:gs://bkt/qwen3",
      "--config.metrics.dir=/tmp/m"])
  overrides, inputs = config_check.check_slice(cfg, [], 8, "--tpu=v5p-16")
  assert [(i.field, i.url, i.path) for i in inputs] == [
      ("model.init", "gs://bkt/qwen3", "/opt/arbor/inputs/0/qwen3"),
      ("data.sources", "gs://bkt/a.jsonl", "/opt/arbor/inputs/1/a.jsonl")]
  assert overrides == ("--config.model.init=hf:/opt/arbor/inputs/0/qwen3",
                       "--config.data.sources=('/opt/arbor/inputs/1/a.jsonl', "
                       "'envs/data/problems.jsonl')")


@pytest.mark.parametrize("change,words", [
    ("--tpu=v9-8", "--tpu='v9-8'"),  # unknown accelerator type
    ("--tpu=v5p-4", "--tpu='v5p-4'"),  # 2 chips: not a whole host
    ("--tpu=v5litepod-12", "--tpu='v5litepod-12'"),
    ("--tpu=v4-0", "--tpu='v4-0'"),
    ("--config.mesh.tensor=3", "config.mesh={'data': 1, 'expert': 1, 'fsdp': -1, 'sequence': 1, 'tensor': 3}"),
    ("--config.mesh.fsdp=8", "the 32 chips of --tpu=v5p-64"),  # 8 x 2 != 32, no -1
    ("--config.mesh.tensor=x", "--config.mesh.tensor=x"),
    ("--config.data.rows_per_batch=8", "config.data.rows_per_batch=8"),
    ("---config.model.init", "config.model.init='hf:/path/to/Qwen2.5-Coder-7B-Instruct'"),
    ("--config.rl.tasks=/path/to/tasks.jsonl", "config.rl.tasks='/path/to/tasks.jsonl'"),
    ("---config.rl.queue_url", "config.rl.queue_url='redis://REDIS_HOST:6379/0'"),
    ("--config.rl.queue_url=redis://x:1:2", "config.rl.queue_url"),
    ("--workdir=gs://Bad_Bucket/run", "--workdir='gs://Bad_Bucket/run'"),
    ("--workdir=gs:/bkt/run", "--workdir='gs:/bkt/run'"),
    ("--config.rl.tasks=gs://", "config.rl.tasks='gs://'"),
    ("--config.model.init=hf:gs://BUCKET/qwen", "config.model.init='gs://BUCKET/qwen'"),
    ("--config.model.init=qwen", "config.model.init='qwen'"),
    ("--config.rl.tasks=/home/me/tasks.jsonl", "config.rl.tasks='/home/me/tasks.jsonl'"),
    ("--config.rl.tasks=envs/data/nope.jsonl", "config.rl.tasks='envs/data/nope.jsonl'"),
    ("--config.rl.queue_password_file=/run/arbor/secrets/redis.password",
     "config.rl.queue_password_file='/run/arbor/secrets/redis.password': no --secret"),
    ("--config.metrics.dir=", "config.metrics.dir=''"),
    ("--zone=Z", "--zone='Z'"),
    ("--project=P", "--project='P'"),
    ("---workdir", "--workdir is required"),
])
def test_tpu_bad_values_one_line_naming_them(change, words):
  rc, out, err = run_main(tpu, changed(RL_ARGS, change) + ["--dry_run"])
  assert rc == 2 and out == "" and words in err, err
  assert err.count("\n") == 1 and err.startswith("launch.tpu: error: ")


def test_tpu_secret_file_and_disabled_queue_pass():
  rc, _, err = run_main(tpu, changed(
      RL_ARGS, "--secret=redis.password=arbor-redis",
      "--config.rl.queue_password_file=/run/arbor/secrets/redis.password") + ["--dry_run"])
  assert rc == 0, err
  # rl.queue_url is read only with rl.rollout_workers="queue": the template's placeholder stays.
  rc, _, err = run_main(tpu, changed(RL_ARGS, "---config.rl.queue_url",
                                     "--config.rl.rollout_workers=inprocess") + ["--dry_run"])
  assert rc == 0, err


XM_LOCAL = ["--config=configs/sft_demo.py", "--workdir=/tmp/arbor_sweep", "--dry_run"]


@pytest.mark.parametrize("argv,words", [
    (XM_LOCAL + ["--config.data.sources=('nope.jsonl',)"], "config.data.sources='nope.jsonl'"),
    (XM_LOCAL + ["--config.data.sources=('gs://bkt/a.jsonl',)"],
     "config.data.sources='gs://bkt/a.jsonl': the trainer opens it as a local file"),
    (["--config=configs/rl.py", "--workdir=/tmp/w", "--dry_run"],
     "config.model.init='hf:/path/to/Qwen2.5-Coder-7B-Instruct': a placeholder"),
    (["--config=configs/smoke.py", "--workdir=/path/to/sweep", "--dry_run"],
     "--workdir='/path/to/sweep'"),
    (XM_LOCAL + ["--sweep=tokenizer.path=envs/data,/path/to/tok"],
     "config.tokenizer.path='/path/to/tok'"),  # the second job's value
    (["--config=configs/sft_demo.py", "--workdir=gs://bkt/sw", "--executor=tpu", "--tpu=v5p-16",
      "--zone=us-east5-a", "--project=my-proj", "--config.metrics.dir=/tmp/m",
      "--config.data.rows_per_batch=8", "--sweep=mesh.tensor=2,3", "--dry_run"],
     "'tensor': 3}: the product of the fixed axes, 3, does not divide the 8 chips of "
     "--tpu=v5p-16"),
    (["--config=configs/smoke.py", "--workdir=gs://bkt/sw", "--executor=tpu", "--tpu=v5p-3",
      "--zone=us-east5-a", "--project=my-proj", "--dry_run"], "--tpu='v5p-3'"),
])
def test_xm_bad_values_one_line_naming_them(argv, words):
  rc, out, err = run_main(xm, argv)
  assert rc == 2 and out == "" and words in err, err
  assert err.count("\n") == 1


def test_xm_missing_workdir():
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
    xm.main(["--config=configs/smoke.py", "--dry_run"])
  assert e.value.code == 2 and "--workdir" in err.getvalue()


@pytest.mark.parametrize("change,words", [
    ("--redis=rediss://REDIS_HOST:6378", "--redis='rediss://REDIS_HOST:6378'"),
    ("--staging=gs://B/fleet", "--staging='gs://B/fleet'"),
    ("--tokenizer=gs://bkt", "--tokenizer='gs://bkt'"),  # a 3-letter bucket, no object
    ("--project=P", "--project='P'"),
    ("--zone=Z", "--zone='Z'"),
])
def test_fleet_bad_values(change, words):
  rc, _, err = run_main(fleet, changed(FLEET_ARGS, change) + ["--dry_run"])
  assert rc == 2 and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,words", [
    (["--tokenizer=nope.json"], "--tokenizer='nope.json': no such file"),
    (["--tokenizer=/path/to/tokenizer.json"], "--tokenizer='/path/to/tokenizer.json'"),
    (["--tokenizer=envs/data/problems.jsonl", "--tasks=nope.jsonl"], "--tasks='nope.jsonl'"),
    (["--tokenizer=envs/data/problems.jsonl", "--policy_url=http://POLICY_HOST:8000"],
     "--policy_url='http://POLICY_HOST:8000'"),
])
def test_fleet_local_bad_values(argv, words):
  rc, out, err = run_main(fleet, ["--local", "--workers=1", "--policy_url=http://127.0.0.1:1",
                                  "--dry_run", *argv])
  assert rc == 2 and out == "" and words in err, err


def readme_launch_commands() -> list[list[str]]:
  """Every `python -m launch.*` command of README.md (continuation lines joined), as argv."""
  text = open(os.path.join(REPO, "README.md")).read().replace("\\\n", " ")
  return [shlex.split(line, comments=True) for line in text.splitlines()
          if line.startswith("python -m launch.")]


def test_readme_launch_commands_pass_as_written(tmp_path):
  # The one input the README takes from an earlier command (the SFT demo's tokenizer).
  tokenizer = tmp_path / "tokenizer.json"
  tokenizer.write_text("{}")
  commands = readme_launch_commands()
  assert sorted(c[2] for c in commands) == ["launch.fleet", "launch.tpu", "launch.xm"]
  for argv in commands:
    argv = [a.replace("/tmp/arbor_sft_demo/tokenizer", str(tokenizer)) for a in argv[2:]]
    argv += [] if "--dry_run" in argv else ["--dry_run"]
    rc, out, err, seen, left, _ = run_cli(argv, tmp_path)
    assert rc == 0 and out, (argv, err)
    assert not [c for c in seen if SERVICES.search(c)] and left == []
