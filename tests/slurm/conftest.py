"""The real local Slurm (slurm/local_cluster.py) the tier runs on: one per session, skipped with the reason."""
import os
import subprocess
import sys
import warnings

import pytest

from slurm.local_cluster import LocalCluster, SlurmUnavailable, ensure_installed


class SlurmSkipped(RuntimeWarning):
    """Shown in pytest's warnings summary, so a skipped Slurm test is never a silent pass."""


def _skip(reason: str):
    message = f"Slurm tests skipped: {reason}"
    print(message, file=sys.stderr)
    warnings.warn(SlurmSkipped(message))
    pytest.skip(message)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """slurmctld + slurmd on this host; never installs packages (`make slurm-setup` does)."""
    try:
        if os.geteuid() != 0:  # slurmd starts job steps as their owner: it runs as root
            raise SlurmUnavailable("the local slurmd needs root (run the tests as root, as CI does)")
        ensure_installed(install=False)
    except SlurmUnavailable as err:
        _skip(f"{err}; install Slurm with `make slurm-setup` (apt-get install -y slurm-wlm, as root)")
    local = LocalCluster(tmp_path_factory.mktemp("slurm"))
    try:
        local.start()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        local.stop()
        _skip(f"slurmctld/slurmd could not be started here: {str(err)[:2000]}")
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def cluster2(tmp_path_factory):
    """Two nodes (z3node1, z3node2: 2 tasks each, 127.0.0.11-12 through tagged /etc/hosts lines), one slurmd
    each on this host; skipped, naming why, where they cannot start."""
    try:
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local slurmd and the node names in /etc/hosts need root")
        ensure_installed(install=False)
    except SlurmUnavailable as err:
        _skip(f"{err}; install Slurm with `make slurm-setup` (apt-get install -y slurm-wlm, as root)")
    local = LocalCluster(tmp_path_factory.mktemp("slurm2"), nodes=2)
    try:
        local.start()  # a failed start stops what it started and removes its hosts lines itself
    except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
        _skip(f"a 2-node local Slurm could not be started here: {str(err)[:2000]}")
    try:
        yield local
    finally:
        local.stop()
