"""A throw-away local Slurm (slurmctld + 1-4 slurmd on this host, one per node name) for tests and trials."""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from slurm import local_processes as processes  # noqa: E402

# The CPU demo runs 4 ranks; CI machines may have 2 cores, so the node advertises at least this many
# CPUs (slurmd accepts more than it detects with SlurmdParameters=config_overrides).
MIN_CPUS = 8

CONF_TEMPLATE = """\
# Written by slurm/local_cluster.py: {nodes} node(s), one partition, no munge (auth/none), no accounting.
ClusterName=zero3dlocal
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
# A requeued job may start again only once its revoked credential has expired (120 s by default):
# short here, so a preempted test job restarts within seconds instead of failing "credential revoked".
AuthInfo=cred_expire=10
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool{node_suffix}
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd{node_suffix}.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd{node_suffix}.log
PlugStackConfig={dir}/plugstack.conf
# Containers and sandboxes rarely expose a writable cgroup tree: track processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# The main scheduling pass every 2 s, not Slurm's 60: a requeued job becomes eligible when its credential expires
# (above), an event that triggers no pass of its own, so it waited up to a minute for the periodic one.
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# No slurmdbd here, so no sacct: each job end (requeues included) is a line in jobcomp.log instead.
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
MpiDefault=none
ReturnToService=2
# Finished jobs stay visible to `scontrol show job` for 10 minutes.
MinJobAge=600
{first_job_id}SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout={slurmd_timeout}
{node_lines}
PartitionName=local Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and could not be installed."""


def tool(name: str):
    """Full path of a Slurm program; the daemons live in sbin, which a non-root PATH may lack."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
    return shutil.which(name, path=path)


def ensure_installed(install: bool = True) -> None:
    """Install Debian's slurm-wlm when slurmctld is missing (needs root and apt-get)."""
    if all(tool(name) for name in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        return
    if not install or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld/slurmd/sbatch not found and apt-get is unavailable")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    if not tool("slurmctld"):
        raise SlurmUnavailable("apt-get installed slurm-wlm but slurmctld is still not on PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_resources() -> tuple[int, int]:
    """(CPUs, RealMemory MB) as `slurmd -C` reports them."""
    out = subprocess.run([tool("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    cpus = int(re.search(r"\bCPUs=(\d+)", out).group(1))
    memory = int(re.search(r"\bRealMemory=(\d+)", out).group(1))
    return cpus, memory


# Nodes of a multi-node cluster: names that resolve (through /etc/hosts lines this cluster adds at start and
# removes at stop, each tagged with HOSTS_MARKER and the cluster's directory) to loopback addresses of their own.
NODE_PREFIX = "z3node"
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "# zero3d-local-cluster"
CPUS_PER_NODE = 2  # each node: 2 CPU "GPUs", one task each
MAX_NODES = 4
FIRST_JOB_ID = 5001


def node_address(index: int) -> str:
    """Node i (1-based) of a multi-node cluster listens on 127.0.0.(10 + i): loopback, one address per node."""
    return f"127.0.0.{10 + index}"


class LocalCluster:
    """slurmctld + `nodes` slurmd started from a config in `root`; every client call needs env() (SLURM_CONF).

    nodes=1: one slurmd named after this host at 127.0.0.1 (no names added anywhere). nodes=2..4: slurmd
    per node (`slurmd -N z3nodeI`, a Port each) with NodeAddr 127.0.0.(10+I), the names in /etc/hosts, each
    slurmd (and so its ranks) in a UTS namespace whose host name is the node's where `unshare` allows it."""

    def __init__(self, root: str | Path, nodes: int = 1):
        if not (isinstance(nodes, int) and 1 <= nodes <= MAX_NODES):
            raise ValueError(f"nodes = {nodes!r} is not a node count 1..{MAX_NODES}")
        self.root = Path(root).resolve()
        self.nodes = nodes
        self.conf = self.root / "slurm.conf"
        self.pid_file = self.root / "daemons.json"

    @property
    def node_names(self) -> list[str]:
        if self.nodes == 1:
            return [socket.gethostname().split(".")[0]]
        return [f"{NODE_PREFIX}{i}" for i in range(1, self.nodes + 1)]

    @property
    def marker(self) -> str:
        return f"{HOSTS_MARKER} {self.root}"

    def env(self, base=None) -> dict:
        return dict(os.environ if base is None else base, SLURM_CONF=str(self.conf))

    def write_config(self) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "plugstack.conf").write_text("")  # keep the host's SPANK plugins out
        cpus, memory = node_resources()
        # slurmctld must run as the SlurmUser: root when we are root, else whoever starts it.
        user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
        if self.nodes == 1:
            host = self.node_names[0]
            lines = [f"NodeName={host} NodeAddr=127.0.0.1 CPUs={max(cpus, MIN_CPUS)} RealMemory={memory} "
                     "State=UNKNOWN"]
            suffix, timeout, first = "", 60, ""
        else:  # one slurmd per node on this host: per-node spool, pid and log files (%n: the node's name)
            for name in self.node_names:
                (self.root / f"spool-{name}").mkdir(parents=True, exist_ok=True)
            lines = [f"NodeName={name} NodeAddr={node_address(i)} Port={_free_port()} CPUs={CPUS_PER_NODE} "
                     f"RealMemory={memory // self.nodes} State=UNKNOWN"
                     for i, name in enumerate(self.node_names, 1)]
            suffix, timeout = "-%n", 10  # a killed node is marked down within seconds, not a minute
            # Job ids (and so the jobs' rendezvous ports, 20000 + id % 10000) apart from a one-node cluster's.
            first = f"FirstJobId={FIRST_JOB_ID}\n"
        self.conf.write_text(CONF_TEMPLATE.format(
            nodes=self.nodes, host=socket.gethostname().split(".")[0], ctld_port=_free_port(),
            slurmd_port=_free_port(), dir=self.root, user=user, node_suffix=suffix, slurmd_timeout=timeout,
            node_lines="\n".join(lines), node_names=",".join(self.node_names), first_job_id=first))

    def start(self, timeout: float = 60.0, attempts: int = 3) -> None:
        """Write the config (and the node names), start the daemons in the foreground mode (-D) and wait until
        every node is idle; a start that fails leaves nothing behind (daemons stopped, names removed). The
        free ports are chosen before the daemons bind them: one taken meanwhile is retried with new ports."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout)
            except RuntimeError as err:
                if attempt == attempts or "Address already in use" not in str(err):
                    raise

    def _start(self, timeout: float) -> None:
        try:
            self.write_config()
            if self.nodes > 1:
                self._add_hosts()
            self._spawn("slurmctld", ["-c", "-i"])  # fresh state, ignore stale files
            self._wait(lambda: "UP" in self._run(["scontrol", "ping"]), timeout, "slurmctld to answer")
            for name in self.node_names:
                self.start_node(name, wait=0)
            self._wait(self._all_idle, timeout, "every node to register as idle")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, daemon: str, args: list[str], node: str = "") -> None:
        key = f"slurmd:{node}" if node else daemon
        log = open(self.root / f"{key.replace(':', '-')}.stdout", "ab")
        cmd = [tool(daemon), "-D", "-f", str(self.conf), *args]
        if node and _uts_namespaces():
            # The node's own host name, in a UTS namespace of its own (gone with its last process): its
            # ranks' gethostname() is the node's name, so gloo binds to the node's address as on real hosts.
            cmd = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', node, *cmd]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        log.close()
        pids = self._pids()
        pids[key] = proc.pid
        self.pid_file.write_text(json.dumps(pids))

    def start_node(self, name: str, wait: float = 60.0) -> None:
        """(Re)start one node's slurmd; with wait > 0, resume the node and wait until Slurm has it idle."""
        if name not in self.node_names:
            raise ValueError(f"node {name!r} is not one of this cluster's nodes {self.node_names}")
        self._spawn("slurmd", ["-N", name] if self.nodes > 1 else [], node=name if self.nodes > 1 else "")
        if wait:
            self._wait(lambda: self._node_state(name) in ("idle", "down", "down*", "mix", "alloc"),
                       wait, f"{name} to register")
            if self._node_state(name).startswith("down"):
                self._run(["scontrol", "update", f"nodename={name}", "state=resume"])
            self._wait(lambda: self._node_state(name) in ("idle", "mix", "alloc"), wait, f"{name} to be idle")

    def kill_node(self, name: str) -> list[int]:
        """A node lost at once, as by a power cut: SIGKILL its slurmd, then its step daemons and its tasks
        (the processes whose environment names this cluster and node, and their slurmstepd parents);
        returns the pids killed."""
        if self.nodes == 1 or name not in self.node_names:
            raise ValueError(f"node {name!r} is not one of this multi-node cluster's nodes {self.node_names}")
        pids = self._pids()
        slurmd = pids.pop(f"slurmd:{name}", None)
        self.pid_file.write_text(json.dumps(pids))
        targets = [slurmd] if slurmd is not None and processes.alive(slurmd) else []
        for pid in targets:
            os.kill(pid, signal.SIGKILL)
        return targets[:1] + self._kill_job_processes(lambda env: env.get("SLURMD_NODENAME") == name)

    def _kill_job_processes(self, which) -> list[int]:
        """SIGKILL this cluster's job processes (a job's environment names this cluster's SLURM_CONF) for
        which `which(environment)` holds, and their slurmstepd parents; returns the pids killed."""
        tasks = [proc for proc, env in processes.environments()
                 if env.get("SLURM_CONF") == str(self.conf) and "SLURM_JOB_ID" in env and which(env)]
        targets = sorted({processes.parent(t) for t in tasks if processes.comm(processes.parent(t)) == "slurmstepd"}) + tasks
        mine, killed = processes.ancestors(), []
        for proc in targets:
            if proc in mine:
                continue
            try:
                os.kill(proc, signal.SIGKILL)
                killed.append(proc)
            except ProcessLookupError:
                pass
        return killed

    def _node_state(self, name: str) -> str:
        return self._run(["sinfo", "-h", "-n", name, "-o", "%t"]).strip()

    def _all_idle(self) -> bool:
        states = self._run(["sinfo", "-h", "-N", "-o", "%N %t"]).split()
        got = dict(zip(states[::2], states[1::2]))
        return all(got.get(name) in ("idle", "mix", "alloc") for name in self.node_names)

    def _add_hosts(self) -> None:
        """The node names → their addresses in /etc/hosts, tagged; stale tags of dead clusters dropped first."""
        text = HOSTS_FILE.read_text()
        kept = [line for line in text.splitlines() if not _stale_hosts_line(line)]
        for i, name in enumerate(self.node_names, 1):
            if any(line.split()[1:2] == [name] for line in kept if not line.startswith("#") and line.split()):
                raise RuntimeError(f"{HOSTS_FILE} already names {name} (another local cluster is running?)")
            kept.append(f"{node_address(i)} {name} {self.marker}")
        _write_in_place(HOSTS_FILE, "\n".join(kept) + "\n")

    def _remove_hosts(self) -> None:
        if not HOSTS_FILE.is_file():
            return
        lines = HOSTS_FILE.read_text().splitlines()
        kept = [line for line in lines if not line.endswith(self.marker)]
        if kept != lines:
            _write_in_place(HOSTS_FILE, "\n".join(kept) + "\n")

    def _run(self, cmd: list[str]) -> str:
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            self._check_alive()
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")

    def _check_alive(self) -> None:
        for daemon, pid in self._pids().items():
            if not processes.alive(pid):
                raise RuntimeError(f"{daemon} (pid {pid}) exited during start-up\n{self.logs()}")

    def _pids(self) -> dict:
        return json.loads(self.pid_file.read_text()) if self.pid_file.is_file() else {}

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.root.glob("slurm*.log")) + sorted(self.root.glob("slurm*.stdout")):
            parts.append(f"--- {path}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the daemons this cluster started (by pid, recorded at start), then any step daemon or task
        still running for it; remove its node names. Safe to call twice, or after a failed start."""
        pids = self._pids()
        for daemon in sorted(pids, key=lambda d: d == "slurmctld"):  # the nodes first
            pid = pids[daemon]
            if not processes.alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while processes.alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if processes.alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._kill_job_processes(lambda env: True)
        if self.pid_file.is_file():
            self.pid_file.unlink()
        self._remove_hosts()




def _uts_namespaces() -> bool:
    """Whether this process may give a child a host name of its own (`unshare --uts`: root, a kernel that allows it)."""
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--uts", "--", "true"], capture_output=True).returncode == 0








def _stale_hosts_line(line: str) -> bool:
    """A line an earlier local cluster added whose daemons are gone (stopped without cleanup, or crashed)."""
    if HOSTS_MARKER not in line:
        return False
    root = Path(line.split(HOSTS_MARKER, 1)[1].strip())
    pid_file = root / "daemons.json"
    try:
        pids = json.loads(pid_file.read_text()).values()
    except (OSError, ValueError):
        return True
    return not any(processes.alive(pid) for pid in pids)


def _write_in_place(path: Path, text: str) -> None:
    """Rewrite without replacing the inode: /etc/hosts is often a bind mount that a rename cannot replace."""
    with open(path, "r+") as f:
        f.seek(0)
        f.write(text)
        f.truncate()




def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--nodes", type=int, default=1, help=f"slurmd nodes, 1..{MAX_NODES} (2 CPU tasks each when > 1)")
    parser.add_argument("--dir", default="/tmp/zero3d-slurm", help="config, state, spool and logs")
    parser.add_argument("--no-install", action="store_true", help="fail instead of apt-get installing slurm-wlm")
    # (the test tier never installs: tests/slurm/conftest.py skips, naming `make slurm-setup`)
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= MAX_NODES:
        parser.error(f"--nodes {args.nodes} is not a node count 1..{MAX_NODES}")
    cluster = LocalCluster(args.dir, nodes=args.nodes)
    if args.action == "start":
        ensure_installed(install=not args.no_install)
        cluster.start()
        print(f"local Slurm is up: {args.nodes} node(s) {','.join(cluster.node_names)}; point the clients at it "
              f"with:\n  export SLURM_CONF={cluster.conf}")
    elif args.action == "stop":
        cluster.stop()
        print("local Slurm stopped")
    else:
        print(json.dumps({d: (pid, processes.alive(pid)) for d, pid in cluster._pids().items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
