"""Shared fixtures: ranks are started once per world size and reused by every test that needs them."""

import os

import pytest

from minitrain import Cluster

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def clusters():
    """``clusters(n)`` returns a running Cluster of n ranks, started at most once per session."""
    live: dict[int, Cluster] = {}

    def get(n: int) -> Cluster:
        if n not in live:
            live[n] = Cluster(n, timeout=20, threads=1)
        return live[n].start()

    yield get
    for c in live.values():
        c.close()


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
