"""The deploy recipes (deploy/): parsed, rendered for every machine, and their commands dry-run for real.

Each recipe's shell part runs under bash as its platform would run it (SkyPilot's ``run`` with its
``SKYPILOT_*`` variables, each Kubernetes pod's ``args`` with its index and pod address, the SLURM
batch script with ``srun`` and ``etcd`` stood in for), with a ``python`` on PATH that passes the
launcher's command line to the real launcher with ``--dry-run``. So every argument the recipes give
the launcher goes through its real parser and checks, and the training script's arguments through
deploy/train.py's own parser.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import PYTHON, REPO

pytestmark = [pytest.mark.timeout(300)]

DEPLOY = REPO / "deploy"
ADDR = "127.0.0.1"  # the store's and every machine's address when rendered here: this machine owns it


@pytest.fixture(scope="module")
def shims(tmp_path_factory) -> Path:
    """A bin/ directory whose ``python`` dry-runs the launcher, and whose ``etcd`` and ``srun`` report and stand in."""
    bin_dir = tmp_path_factory.mktemp("shims")
    scripts = {
        "python": f"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = lightning_bamboo.launcher ]; then
  shift 2
  exec {shlex.quote(PYTHON)} -m lightning_bamboo.launcher --dry-run "$@"
fi
echo "not run: python $*"
""",
        "etcd": """#!/bin/bash
echo "etcd $*"
""",
        # every node of the allocation runs the step's command, with its SLURM_NODEID
        "srun": """#!/bin/bash
while [ "${1#-}" != "$1" ]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
""",
        "pip": """#!/bin/bash
echo "not run: pip $*"
""",
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def render(shims: Path, script: list[str], env: dict[str, str]) -> str:
    """Run a recipe's shell part with the shims first on PATH; its output (it must succeed)."""
    full = {"PATH": f"{shims}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": str(REPO), **env}
    proc = subprocess.run(["bash", *script], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{script}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def plans(output: str) -> dict[str, dict[str, object]]:
    """The dry-run plans in ``output``, by machine: workers, interface, job nodes, command."""
    found: dict[str, dict[str, object]] = {}
    for block in re.split(r"(?m)^(?=machine )", output):
        head = re.match(r"machine (\S+): (\d+) worker\(s\) bound to (\S+) \((\S+)\)", block)
        if head is None:
            continue
        nodes = re.search(r"(?m)^job nodes in rank order: (\S+);", block)
        command = re.search(r"(?m)^command: (.*)$", block)
        assert command is not None, block
        found[head[1]] = {"workers": int(head[2]), "interface": head[3], "addr": head[4],
                          "nodes": nodes[1].split(",") if nodes else [], "command": shlex.split(command[1]),
                          "ranks": re.findall(r"(?m)^  (\S+): rank (\d+) of (\d+)", block)}
    return found


@pytest.fixture(scope="module")
def train_parser():
    spec = importlib.util.spec_from_file_location("deploy_train", DEPLOY / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse


def job_nodes(prefix: str, machines: int, workers: int) -> list[str]:
    """The job's nodes in rank order, as the launcher's --workers names and orders them (every replica holder on
    another machine at every depth, where one order does it: 4 machines x 2 workers)."""
    from lightning_bamboo.topology.machines import machine_order

    names = [f"{prefix}{i}" for i in range(machines)]
    return machine_order(names, workers)


def check_training_command(command: list[str], train_parser) -> None:
    assert command[:2] == ["python", "deploy/train.py"], command
    train_parser(command[2:])  # the script's own parser accepts the recipe's arguments


def test_skypilot_recipe(shims, train_parser):
    task = yaml.safe_load((DEPLOY / "skypilot.yaml").read_text())
    assert task["resources"]["use_spot"] is True and task["workdir"] == "."
    assert "ETCD_ADDR" in task["envs"] and task["envs"]["ETCD_ADDR"] is None  # required at launch
    machines = task["num_nodes"]
    envs = {k: str(v) for k, v in task["envs"].items() if v is not None}
    seen = {}
    for rank in range(machines):
        env = {**envs, "ETCD_ADDR": ADDR, "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(machines),
               "SKYPILOT_TASK_ID": "sky-2026-11-24-bamboo", "WORKERS": "2"}
        seen.update(plans(render(shims, ["-c", task["run"]], env)))
    assert sorted(seen) == [f"vm{i}" for i in range(machines)]
    nodes = job_nodes("vm", machines, 2)
    for plan in seen.values():
        assert plan["workers"] == 2 and plan["addr"] == ADDR and plan["nodes"] == nodes
        check_training_command(plan["command"], train_parser)
    etcd_task = yaml.safe_load((DEPLOY / "skypilot-etcd.yaml").read_text())
    assert etcd_task["resources"]["use_spot"] is False and str(etcd_task["resources"]["ports"]) == "2379"
    out = render(shims, ["-c", etcd_task["run"]], {})
    assert re.search(r"--advertise-client-urls http://\d+\.\d+\.\d+\.\d+:2379", out), out


def test_kubernetes_recipe(shims, train_parser):
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert set(kinds) == {("Service", "bamboo-etcd"), ("StatefulSet", "bamboo-etcd"), ("Job", "bamboo"),
                          ("Deployment", "bamboo-standby")}
    service, job = kinds[("Service", "bamboo-etcd")], kinds[("Job", "bamboo")]
    assert service["spec"]["ports"][0]["port"] == 2379
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"]
    machines = job["spec"]["completions"]

    def pod_env(container: dict, **fields: str) -> dict[str, str]:
        env = {}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
            else:  # the downward API: the pod's address and name
                env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    assert trainer["command"] == ["bash", "-c"]
    seen = {}
    for index in range(machines):
        env = {**pod_env(trainer, **{"status.podIP": ADDR}), "JOB_COMPLETION_INDEX": str(index)}
        seen.update(plans(render(shims, ["-c", *trainer["args"]], env)))
    assert sorted(seen) == [f"m{i}" for i in range(machines)]
    for plan in seen.values():
        assert plan["nodes"] == job_nodes("m", machines, int(pod_env(trainer, **{"status.podIP": ADDR})["WORKERS"]))
        check_training_command(plan["command"], train_parser)
    (standby,) = kinds[("Deployment", "bamboo-standby")]["spec"]["template"]["spec"]["containers"]
    env = pod_env(standby, **{"status.podIP": ADDR, "metadata.name": "bamboo-standby-7d9c5-x2x8q"})
    (plan,) = plans(render(shims, ["-c", *standby["args"]], env)).values()
    assert plan["nodes"] == [] and plan["ranks"] == []  # a standby machine: no rank until admitted
    check_training_command(plan["command"], train_parser)


def test_slurm_recipe(shims, train_parser):
    script = DEPLOY / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    nodes = int(re.search(r"(?m)^#SBATCH --nodes=(\d+)$", script.read_text())[1])
    assert "#SBATCH --no-kill" in script.read_text()
    env = {"SLURM_NNODES": str(nodes), "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(REPO), "ETCD_ADDR": ADDR,
           "TMPDIR": "/tmp"}
    out = render(shims, [str(script)], env)
    assert f"--advertise-client-urls http://{ADDR}:2379" in out  # etcd on the batch host
    seen = plans(out)
    assert sorted(seen) == [f"n{i}" for i in range(nodes)]
    for plan in seen.values():
        assert plan["nodes"] == job_nodes("n", nodes, 1) and plan["addr"] == ADDR  # --addr auto: the route to etcd
        check_training_command(plan["command"], train_parser)


def test_a_recipe_command_with_a_bad_argument_fails_the_dry_run(shims):
    # the shim passes the launcher's real errors through: a recipe that named a machine twice would fail here
    out = subprocess.run(
        ["bash", "-c", "python -m lightning_bamboo.launcher --store etcd://127.0.0.1:2379 --node m0 --peers m0,m0 "
                       "--addr 127.0.0.1 -- python deploy/train.py"],
        cwd=REPO, env={"PATH": f"{shims}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120)
    assert out.returncode == 2 and "names a machine twice" in out.stderr
