"""A throw-away single-node Slurm (slurmctld + slurmd on this host) for tests and local trials."""
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

# The CPU demo runs 4 ranks; CI machines may have 2 cores, so the node advertises at least this many
# CPUs (slurmd accepts more than it detects with SlurmdParameters=config_overrides).
MIN_CPUS = 8

CONF_TEMPLATE = """\
# Written by slurm/local_cluster.py: one node, one partition, no munge (auth/none), no accounting.
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
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
# Containers and sandboxes rarely expose a writable cgroup tree: track processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# No slurmdbd here, so no sacct: each job end (requeues included) is a line in jobcomp.log instead.
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
MpiDefault=none
ReturnToService=2
# Finished jobs stay visible to `scontrol show job` for 10 minutes.
MinJobAge=600
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP
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


class LocalCluster:
    """slurmctld + slurmd started from a config in `root`; every client call needs env() (SLURM_CONF)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.conf = self.root / "slurm.conf"
        self.pid_file = self.root / "daemons.json"

    def env(self, base=None) -> dict:
        return dict(os.environ if base is None else base, SLURM_CONF=str(self.conf))

    def write_config(self) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "plugstack.conf").write_text("")  # keep the host's SPANK plugins out
        cpus, memory = node_resources()
        # slurmctld must run as the SlurmUser: root when we are root, else whoever starts it.
        user = "root" if os.geteuid() == 0 else os.environ.get("USER", "root")
        self.conf.write_text(CONF_TEMPLATE.format(
            host=socket.gethostname().split(".")[0], ctld_port=_free_port(), slurmd_port=_free_port(),
            dir=self.root, user=user, cpus=max(cpus, MIN_CPUS), memory=memory))

    def start(self, timeout: float = 60.0) -> None:
        """Write the config, start both daemons in the foreground mode (-D) and wait until the node is idle."""
        self.write_config()
        pids = {}
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.root / f"{daemon}.stdout", "wb")
            extra = ["-c", "-i"] if daemon == "slurmctld" else []  # fresh state, ignore stale files
            proc = subprocess.Popen([tool(daemon), "-D", "-f", str(self.conf), *extra], stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
            pids[daemon] = proc.pid
            self.pid_file.write_text(json.dumps(pids))
            if daemon == "slurmctld":
                self._wait(lambda: "UP" in self._run(["scontrol", "ping"]), timeout, "slurmctld to answer")
        self._wait(lambda: self._run(["sinfo", "-h", "-o", "%t"]).strip() in ("idle", "mix", "alloc"),
                   timeout, "the node to register as idle")

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
            if not _alive(pid):
                raise RuntimeError(f"{daemon} (pid {pid}) exited during start-up\n{self.logs()}")

    def _pids(self) -> dict:
        return json.loads(self.pid_file.read_text()) if self.pid_file.is_file() else {}

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmctld.stdout", "slurmd.log", "slurmd.stdout"):
            path = self.root / name
            if path.is_file():
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the daemons this cluster started (by pid, recorded at start); jobs die with slurmd."""
        pids = self._pids()
        for daemon in ("slurmd", "slurmctld"):
            pid = pids.get(daemon)
            if pid is None or not _alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.pid_file.is_file():
            self.pid_file.unlink()


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap our own child so it does not linger as a zombie
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child (started by an earlier `start` command): fall back to a signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--dir", default="/tmp/zero3d-slurm", help="config, state, spool and logs")
    parser.add_argument("--no-install", action="store_true", help="fail instead of apt-get installing slurm-wlm")
    # (the test tier never installs: tests/slurm/conftest.py skips, naming `make slurm-setup`)
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.dir)
    if args.action == "start":
        ensure_installed(install=not args.no_install)
        cluster.start()
        print(f"local Slurm is up; point the clients at it with:\n  export SLURM_CONF={cluster.conf}")
    elif args.action == "stop":
        cluster.stop()
        print("local Slurm stopped")
    else:
        print(json.dumps({d: (pid, _alive(pid)) for d, pid in cluster._pids().items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
