"""Faults injected into training runs on a multi-node container cluster (trainer/container_cluster.py), each at a
moment it picks; a table says, for each, how soon the run named it and how, whether it carried on or stopped and
resumed from its last checkpoint once the part was back, the part's restart time, and what was left afterwards (must
be nothing).

    .venv/bin/python tests/faults.py                     # every fault (make faults), ~15 min on 2 cores
    .venv/bin/python tests/faults.py --only node_killed  # one (repeat --only for several)
    .venv/bin/python tests/faults.py --list

Detection must come within max(2 × the slowest step so far, 60 s); before the run's first step ends the bound is the
first step's rollout limit, ``generator.timeout_s`` (120 s). Detection is the first output line that names the fault
(the run carrying on, with the loss counted, or stopping with an error that names the part, its node and the step).
Every timeout involved is set once: docs/training/multi-node.md lists them.

The cluster's shared directory is a tmpfs of this host (1 GiB), so that the disk-full fault fills a real disk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import cluster_probe  # noqa: E402
from tiny import env_with_tests, tiny_model_dir  # noqa: E402

NAME = "envkit-faults"
SHARED = Path("/mnt/envkit-faults")  # a tmpfs under /tmp, bind-mounted into the nodes, broke Ray Client
RESULTS = ROOT / ".cache" / "faults" / "results.json"
PORT = 8100
"""Where a fault's own server (an env server, a judge) listens on worker2."""
TINY = ["inference.engine=vllm", "inference.kv_cache_gib=1", "trainer.save_every=1", "trainer.eval_tasks=0",
        "logging.progress=false", "generator.prompts_per_step=2", "generator.samples_per_prompt=4",
        "generator.max_tokens=16", "trainer.micro_batch_tokens=2048", "trainer.warmup_steps=0",
        "placement.env_workers=2", "generator.gateway_host=0.0.0.0", "+placement.trainer_resources.head=1",
        "+placement.replica_resources.worker1=1", "+placement.env_worker_resources.worker2=1"]


class Run:
    """One `python -m trainer` on the cluster; its output lines, timestamped as they come."""

    def __init__(self, out: Path, overrides: list[str], env: dict[str, str]) -> None:
        self.out = out
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trainer", "placement.backend=ray", f"placement.address={env['ENVKIT_CLUSTER']}",
             f"trainer.output_dir={out}", f"model.path={tiny_model_dir()}", *TINY, *overrides],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.namespace = f"envkit-{self.process.pid}"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, pattern: str, after: float = 0.0, timeout: float = 900.0) -> tuple[float, str] | None:
        """The first line matching ``pattern`` printed after ``after``, or None if the run ended or ``timeout``
        passed without one."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            lines = self.lines[seen:]
            seen += len(lines)
            for t, line in lines:
                if t >= after and re.search(pattern, line):
                    return t, line
            if self.process.poll() is not None and seen == len(self.lines):
                time.sleep(0.2)  # the reader's last lines
                if seen == len(self.lines):
                    return None
            time.sleep(0.1)
        return None

    def finish(self, timeout: float = 900.0) -> int:
        """Its exit status (killed after ``timeout``)."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def save(self, path: Path, since: float) -> None:
        """The output, each line with its time in seconds from ``since`` (the injection)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{t - since:+8.1f} {line}\n" for t, line in self.lines))

    def slowest_step(self, before: float) -> float:
        """The slowest step the run had finished before ``before`` (0: none)."""
        steps = [float(m.group(1)) for t, line in self.lines if t < before
                 for m in [re.search(r"step \d+: reward .*, ([\d.]+) s$", line)] if m]
        return max(steps, default=0.0)


@dataclass
class Fault:
    """One fault: the run it hits, when and how it is injected, what names it, and how the part comes back."""

    name: str
    what: str
    inject: Callable[[Run, Cluster], float]
    """Waits for its moment, injects the fault, returns when (monotonic)."""
    detected: str
    """A regex for the output line that names it."""
    carries_on: bool
    overrides: list[str] = field(default_factory=list)
    restore: Callable[[Run, Cluster], float] | None = None
    """Brings the part back; returns how long that took (the restart time)."""
    restarted: str | None = None
    """For a fault the run carries on through: a regex for the line saying the part is back (its time: restart)."""
    steps: int = 4
    server: list[str] = field(default_factory=list)
    """A server the run uses, started on worker2 before it and stopped after: its argv (``PORT``: :data:`PORT`)."""


class Cluster:
    """The container cluster the faults run on, and the Docker client to reach its nodes."""

    def __init__(self) -> None:
        import docker

        self.docker = docker.from_env()
        self.env = env_with_tests()

    def cli(self, *argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "trainer.container_cluster", *argv, "--name", NAME], cwd=ROOT,
                              env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise SystemExit(f"trainer.container_cluster {argv[0]} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def up(self) -> None:
        SHARED.mkdir(parents=True, exist_ok=True)
        if not os.path.ismount(SHARED):
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(SHARED)], check=True)
        for left in SHARED.iterdir():  # an earlier run's (its filler too)
            shutil.rmtree(left) if left.is_dir() else left.unlink()
        self.cli("up", "--shared", str(SHARED))
        self.env.update(line.removeprefix("export ").split("=", 1) for line in self.cli("env").splitlines())

    def down(self) -> None:
        self.cli("down")
        subprocess.run(["umount", "--lazy", str(SHARED)], check=False)  # Docker may hold it a moment longer

    def node(self, role: str) -> Any:
        return self.docker.containers.get(f"{NAME}-{role}")

    def ip(self, role: str) -> str:
        node = self.node(role)
        node.reload()
        return node.attrs["NetworkSettings"]["Networks"][NAME]["IPAddress"]

    def rejoin(self, role: str) -> float:
        """Start the node ``role`` again and wait until the cluster counts it; the seconds that took."""
        from trainer.container_cluster import fence, wait_joined

        began = time.monotonic()
        self.node(role).start()
        wait_joined(self.docker, NAME, 3)
        fence(self.docker, NAME)  # a restarted node has a fresh network namespace
        return time.monotonic() - began

    def serve(self, argv: list[str]) -> None:
        """Start ``argv`` on worker2, in the background, and wait until it answers on :data:`PORT`."""
        from generators.engines.server import wait_healthy

        self.node("worker2").exec_run(argv, detach=True)
        url = f"http://{self.ip('worker2')}:{PORT}/health"

        def exited() -> None:
            if not any(" ".join(argv) in " ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"])):
                raise RuntimeError(f"{' '.join(argv)} exited on worker2 before it answered")

        # a vLLM server's start on 2 cores; a hang guard
        if not asyncio.run(wait_healthy(url, 300, check=exited)):
            raise RuntimeError(f"{' '.join(argv)} did not answer on {url}")

    def unserve(self, argv: list[str]) -> None:
        """Kill what :meth:`serve` started (and what it started: a vLLM server), stopped or not."""
        for p in psutil.process_iter(["cmdline"]):
            if " ".join(argv) in " ".join(p.info["cmdline"] or ()):
                for child in [*p.children(recursive=True), p]:
                    child.kill()

    def probe(self, *argv: str) -> Any:
        return cluster_probe.run(self.node("head"), *argv)


def run_processes(namespace: str) -> list[str]:
    """Processes of the run still alive on any node (this host sees theirs): its vLLM servers, agents, env servers."""
    from trainer.placement.groups import RUN_ENV

    left = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        if (p.info["environ"] or {}).get(RUN_ENV) == namespace:
            left.append(" ".join(p.info["cmdline"] or ())[:80])
    return left


def leftovers(run: Run, cluster: Cluster) -> list[str]:
    """What the run left: actors or placement groups of its namespace, processes, sandbox containers."""
    from sandboxes.docker import SANDBOX_LABEL

    time.sleep(5)  # a server's watchdog ends it a moment after its actor
    left = [f"actor {a}" for a in cluster.probe("actors", run.namespace)]
    left += [f"placement group {g}" for g in cluster.probe("groups", run.namespace)]
    left += [f"process {p}" for p in run_processes(run.namespace)]
    left += [f"container {c.name}" for c in cluster.docker.containers.list(all=True, ignore_removed=True, filters={
        "label": SANDBOX_LABEL, "network": f"{NAME}-sandboxes"})]
    return left


# ----------------------------------------------------------------------------------------------------- the faults


def _after_step(run: Run, step: int, delay: float = 0.0) -> float:
    found = run.wait_for(rf"step {step}: reward")
    if found is None:
        raise RuntimeError(f"the run ended before step {step}:\n{run.output()[-3000:]}")
    time.sleep(delay)
    return time.monotonic()


def kill_worker2(run: Run, cluster: Cluster) -> float:
    """docker kill worker2 (from the head, as soon as its env-worker-0 has episodes open: mid-step)."""
    _after_step(run, 1)
    killed_at = cluster.probe("kill-node", run.namespace, f"{NAME}-worker2")
    return time.monotonic() - (time.time() - killed_at)


def _runs(process: psutil.Process, what: str) -> bool:
    """Whether ``process`` is ``what`` itself (``python -m vllm...``, ``.../envkit serve``), not a process that has
    it in its arguments: the watchdog of a managed server (generators/engines/watchdog.py) carries its command."""
    return what in " ".join((process.info["cmdline"] or [])[:3])


def _weight_update(run: Run) -> psutil.Process:
    """The run's vLLM server the moment a weight file appears in its node's /dev/shm (the shared-memory transport):
    the server is loading new weights, and the call that sends them has not returned."""
    from trainer.placement.groups import RUN_ENV

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline", "environ"]):
            if ((p.info["environ"] or {}).get(RUN_ENV) == run.namespace
                    and _runs(p, "vllm.entrypoints.openai.api_server")):
                shm = Path(f"/proc/{p.pid}/root/dev/shm")
                while time.monotonic() < deadline:
                    try:
                        if any(f.name.startswith("envkit-weights") for f in shm.iterdir()):
                            return p
                    except OSError:
                        break
                    time.sleep(0.01)
        time.sleep(0.2)
    raise RuntimeError("no weight update seen")


def kill_vllm_in_weight_update(run: Run, cluster: Cluster) -> float:
    """SIGKILL the replica's vLLM server while it loads new weights."""
    _weight_update(run).kill()
    return time.monotonic()


def cut_worker1_in_weight_sync(run: Run, cluster: Cluster) -> float:
    """docker network disconnect worker1 (its replica's node) from the cluster's network while the replica loads
    step 2's weights."""
    _after_step(run, 1)
    _weight_update(run)
    cluster.cut = cluster.ip("worker1")  # type: ignore[attr-defined]
    cluster.docker.networks.get(NAME).disconnect(cluster.node("worker1"), force=True)
    return time.monotonic()


def reconnect_worker1(run: Run, cluster: Cluster) -> float:
    """Connect worker1 again at its address and restart it: Ray declared its node dead, so a fresh one joins."""
    from trainer.container_cluster import fence, wait_joined

    began = time.monotonic()
    node = cluster.node("worker1")
    cluster.docker.networks.get(NAME).connect(node, ipv4_address=cluster.cut)  # type: ignore[attr-defined]
    node.restart(timeout=5)
    wait_joined(cluster.docker, NAME, 3)
    fence(cluster.docker, NAME)
    return time.monotonic() - began


def oom_kill_a_sandbox(run: Run, cluster: Cluster) -> float:
    """OOM-kill one of the run's sandbox containers that serves its env (tests/oom.py), mid-run."""
    import httpx
    from oom import oom_kill

    from sandboxes.base import SERVER_PORT
    from sandboxes.docker import SANDBOX_LABEL

    _after_step(run, 1)
    for container in cluster.docker.containers.list(filters={"label": SANDBOX_LABEL,
                                                             "network": f"{NAME}-sandboxes"}):
        ip = container.attrs["NetworkSettings"]["Networks"][f"{NAME}-sandboxes"]["IPAddress"]
        try:
            serving = httpx.get(f"http://{ip}:{SERVER_PORT}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            serving = False  # still starting
        if serving:
            oom_kill(container)
            return time.monotonic()
    raise RuntimeError("no sandbox of the run is serving")


def fill_the_disk(run: Run, cluster: Cluster) -> float:
    _after_step(run, 1)
    with open(SHARED / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(2**20))
                f.flush()
        except OSError:  # full: every later write on that disk fails (a few bytes may still fit a metadata block)
            pass
    return time.monotonic()


def free_the_disk(run: Run, cluster: Cluster) -> float:
    (SHARED / "filler").unlink()
    return 0.0


def silence_the_agent(run: Run, cluster: Cluster) -> float:
    _after_step(run, 1)
    (SHARED / "silent").touch()
    return time.monotonic()


def stop_env_server(run: Run, cluster: Cluster) -> float:
    _after_step(run, 1, delay=0.5)
    return _stop_server(cluster, "envkit serve")


def stop_judge(run: Run, cluster: Cluster) -> float:
    _after_step(run, 1)
    return _stop_server(cluster, "vllm.entrypoints.openai.api_server")


def _stop_server(cluster: Cluster, what: str) -> float:
    """SIGSTOP the process of the fault's server (on worker2; this host sees its processes) whose command line says
    ``what``."""
    for p in psutil.process_iter(["cmdline"]):
        if _runs(p, what) and f"--port {PORT}" in " ".join(p.info["cmdline"] or ()):
            p.send_signal(signal.SIGSTOP)
            cluster.stopped = p  # type: ignore[attr-defined]
            return time.monotonic()
    raise RuntimeError(f"no {what} on port {PORT} is running")


def continue_server(run: Run, cluster: Cluster) -> float:
    cluster.stopped.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
    return 0.0


def restart_worker2(run: Run, cluster: Cluster) -> float:
    return cluster.rejoin("worker2")


FAULTS = [
    Fault("node_killed", "worker node killed mid-step (docker kill; its env workers pinned to it)", kill_worker2,
          r"step \d+: env worker \S+ (was not placed|died before it started).* worker2", carries_on=False,
          restore=restart_worker2,
          steps=6),
    Fault("node_cut_off_in_weight_sync", "worker node cut off the network (docker network disconnect) while its "
          "replica loads new weights", cut_worker1_in_weight_sync,
          r"inference replica \d+ failed to load weights v\d+ .* on worker1", carries_on=False,
          restore=reconnect_worker1),
    Fault("env_server_stopped", "a remote env server stopped (SIGSTOP) mid-episode", stop_env_server,
          r"step \d+: \d+ of \d+ rollouts failed .*(rollout exceeded|Timeout|timed out)", carries_on=True,
          restore=continue_server, overrides=[f"env.name=ws://WORKER2:{PORT}/arithmetic"],
          server=["envkit", "serve", "arithmetic", "--host", "0.0.0.0", "--port", str(PORT)]),
    Fault("replica_killed_in_weight_update", "vLLM server killed while it loads new weights",
          kill_vllm_in_weight_update, r"vLLM server (died|crashed) .*restarting it", carries_on=True,
          restarted=r"vLLM server restarted in"),
    Fault("sandbox_oom_killed", "a sandbox container OOM-killed (the kernel's OOM killer, at its memory limit)",
          oom_kill_a_sandbox, r"sandbox container \S+ .*on worker2 was OOM-killed", carries_on=True,
          overrides=["env.sandbox=docker"]),
    Fault("checkpoint_disk_full", "the checkpoint disk full (a 1 GiB tmpfs, filled)", fill_the_disk,
          r"writing its checkpoint to .* failed: No space left on device", carries_on=False, restore=free_the_disk),
    Fault("judge_silent", "the judge's endpoint stops answering (SIGSTOP), a group rubric calling it", stop_judge,
          r"step \d+: \d+ of \d+ rollouts failed .*did not score within .*its judge: http://\S+:8100",
          carries_on=True, restore=continue_server,
          overrides=["generator.group_rubric=rubric_parts:relative", "judge.engine=openai",
                     f"judge.url=http://WORKER2:{PORT}/v1", "judge.model=judge"],
          server=[sys.executable, str(ROOT / "tests" / "judge_server.py"), str(PORT), str(SHARED / "judge.log")]),
    Fault("agent_silent", "an agent that never calls the gateway", silence_the_agent,
          r"step \d+: \d+ of \d+ rollouts failed .*rollout exceeded", carries_on=True,
          overrides=[f'env.mixture=[{{name: "agent_envs:sums_until", kwargs: {{flag: "{SHARED}/silent"}}}}]']),
]


def run_fault(fault: Fault, cluster: Cluster) -> dict[str, Any]:
    """One fault's run (and its resume): the table's row."""
    out = SHARED / fault.name
    overrides = [o.replace("WORKER2", cluster.ip("worker2")) for o in fault.overrides]
    if fault.server:
        cluster.serve(fault.server)
    try:
        return _run_fault(fault, cluster, out, overrides)
    finally:
        if fault.server:
            cluster.unserve(fault.server)


def _run_fault(fault: Fault, cluster: Cluster, out: Path, overrides: list[str]) -> dict[str, Any]:
    run = Run(out, [f"trainer.steps={fault.steps}", *overrides], cluster.env)
    row: dict[str, Any] = {"fault": fault.name, "what": fault.what, "carries_on": fault.carries_on}
    injected = fault.inject(run, cluster)
    bound = max(2 * run.slowest_step(injected), 60.0) if run.slowest_step(injected) else 120.0
    found = run.wait_for(fault.detected, after=injected - 1)
    row.update(detect_s=round(found[0] - injected, 1) if found else None, bound_s=bound,
               error=found[1].strip()[:300] if found else None)
    restart = None
    if fault.restarted:
        back = run.wait_for(fault.restarted, after=injected)
        restart = round(back[0] - injected, 1) if back else None
    if fault.carries_on and fault.restore is not None:
        fault.restore(run, cluster)
    code = run.finish()
    run.save(RESULTS.with_name(f"{fault.name}.log"), injected)
    row["exit"] = code
    row["outcome"] = "carried on" if code == 0 else f"stopped (exit {code})"
    if not fault.carries_on and fault.restore is not None:
        restart = round(fault.restore(run, cluster), 1)
        checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
        resumed = Run(out, [f"trainer.steps={fault.steps}", *overrides, "trainer.resume=latest"], cluster.env)
        code = resumed.finish()
        resumed.save(RESULTS.with_name(f"{fault.name}.resumed.log"), injected)
        first = resumed.wait_for(r"step (\d+): reward", timeout=1)
        step = re.search(r"step (\d+)", first[1])[1] if first else None  # type: ignore[index]
        row["outcome"] += (f"; resumed from {checkpoints[-1]} (its first step: {step}), exit {code}" if first
                           else f"; resume failed (exit {code})")
        row.update(resume_exit=code, resumed_from=checkpoints[-1], resumed_at=int(step) if step else None)
        row["left"] = leftovers(resumed, cluster) + leftovers(run, cluster)
        if code:
            row["resume_output"] = resumed.output()[-2000:]
    else:
        row["left"] = leftovers(run, cluster)
    row["restart_s"] = restart
    if found is None:
        row["output"] = run.output()[-3000:]
    return row


def _plain(line: str | None) -> str:
    """An output line without its colours and Ray's ``(Actor pid=…, ip=…)`` prefix, for the table."""
    line = re.sub(r"(\x1b|\\x1b)\[[0-9;]*m", "", line or "")  # colours, also as a list's repr writes them
    return re.sub(r"^\(\w+ pid=\d+(, ip=[\d.]+)?\)\s*", "", line).replace("|", "/")


def table(rows: list[dict[str, Any]]) -> str:
    head = "| fault | detected in | bound | how | outcome | restart | left |\n|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['fault']} | {r['detect_s'] if r['detect_s'] is not None else 'NOT DETECTED'} s | {r['bound_s']:.0f} s "
        f"| `{_plain(r['error'])[:260]}` | {r['outcome']} | "
        f"{r['restart_s'] if r['restart_s'] is not None else '-'} s | {', '.join(r['left']) or 'nothing'} |\n"
        for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[f.name for f in FAULTS])
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        for fault in FAULTS:
            print(f"{fault.name}: {fault.what}")
        return 0
    cluster = Cluster()
    cluster.up()
    rows = []
    try:
        for fault in FAULTS:
            if args.only and fault.name not in args.only:
                continue
            print(f">> {fault.name}: {fault.what}", flush=True)
            try:
                rows.append(run_fault(fault, cluster))
            except Exception as e:  # the harness's own failure: the next faults still run
                rows.append({"fault": fault.name, "what": fault.what, "detect_s": None, "bound_s": 0.0,
                             "error": f"harness: {type(e).__name__}: {e}"[:300], "outcome": "-",
                             "restart_s": None, "left": []})
            print(json.dumps(rows[-1], indent=1)[:3000], flush=True)
    finally:
        cluster.down()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    ran = {r["fault"] for r in rows}  # a run of some faults keeps the others' latest rows
    RESULTS.write_text(json.dumps([r for r in earlier if r["fault"] not in ran] + rows, indent=1))
    print(table(rows))
    wrong = {r["fault"]: problems(r) for r in rows if problems(r)}
    for fault, why in wrong.items():
        print(f"{fault}: {'; '.join(why)}", file=sys.stderr)
    return 1 if wrong else 0


def problems(row: dict[str, Any]) -> list[str]:
    """How a fault's row differs from what it must show (none: as expected): named within its bound; a fault the
    run survives left it running to its end (exit 0), one it cannot survive stopped it and a resume ran to the end
    from the step after its last checkpoint; nothing left behind."""
    found = []
    if (row.get("error") or "").startswith("harness:"):
        return [f"the harness failed: {row['error']}"]
    if row["detect_s"] is None:
        found.append("not detected")
    elif row["detect_s"] > row["bound_s"]:
        found.append(f"detected in {row['detect_s']} s, past its {row['bound_s']:.0f} s bound")
    if row["carries_on"] and row["exit"] != 0:
        found.append(f"the run should have carried on, and stopped (exit {row['exit']})")
    if not row["carries_on"]:
        if row["exit"] == 0:
            found.append("the run should have stopped on it, and carried on")
        after = int(row.get("resumed_from", "step--1").rsplit("-", 1)[1]) + 1
        if row.get("resume_exit") != 0 or row.get("resumed_at") != after:
            found.append(f"the resume did not run to the end from the step after its last checkpoint "
                         f"({row['outcome']})")
    if row["left"]:
        found.append(f"left behind: {', '.join(row['left'])}")
    return found


if __name__ == "__main__":
    sys.exit(main())
