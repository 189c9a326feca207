"""Multi-node with torchrun (lesson 08): two torchrun "nodes" on loopback (c10d rendezvous, one rank
each) run ``python -m minitrain train --strategy ddp``; rank 0 prints the JSON, the losses equal the
same run started by minitrain itself, and the checkpoint the two nodes wrote consolidates to its
weights.  Every process is killed whatever happens: torchrun starts each worker in a session of its
own, so the agent's whole tree is killed, not just its process group."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from minitrain import TrainConfig, train
from minitrain.checkpoint.consolidate import consolidate
from minitrain.runtime.launch import descendants
from minitrain.model import PRESETS

STEPS, BATCH = 4, 8
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and every process below it (torchrun's workers run in their own sessions)."""
    for pid in [*descendants(p.pid), p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def processes():
    """Started processes; each one's whole tree is killed at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        kill_tree(p)
        p.wait(10)


def torchrun_node(port: int, args: list[str]) -> subprocess.Popen:
    """One "node": a torchrun agent with one worker, joining the others at 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--local-addr", "127.0.0.1", "--max-restarts", "0", "-m", "minitrain", "train", *args]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(nodes: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each node; on a timeout every node's group is killed."""
    out = []
    for p in nodes:
        try:
            stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in nodes:
                kill_tree(q)
            stdout, stderr = p.communicate()
            pytest.fail(f"torchrun node did not finish in {TIMEOUT_S} s:\n{stderr[-3000:]}")
        out.append((p.returncode, stdout, stderr))
    return out


def test_two_torchrun_nodes_train_like_one_machine(processes, clusters, tmp_path):
    args = ["--strategy", "ddp", "--steps", str(STEPS), "--batch-size", str(BATCH), "--model",
            "nano", "--json", "--save-dir", str(tmp_path)]
    port = free_port()
    processes += [torchrun_node(port, args) for _ in range(2)]
    results = finish(processes)
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    printed = [stdout for _, stdout, _ in results if stdout.strip()]
    assert len(printed) == 1  # rank 0 prints, on whichever node it landed
    lines = [json.loads(line) for line in printed[0].splitlines()]
    losses = [line["loss"] for line in lines if "step" in line]
    summary = lines[-1]["summary"]
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"

    cfg = TrainConfig(strategy="ddp", world_size=2, steps=STEPS, batch_size=BATCH,
                      model=PRESETS["nano"])
    local = train(cfg, cluster=clusters(2), return_state=True)
    assert losses == pytest.approx(local.losses, rel=1e-5)

    state = consolidate(tmp_path)  # rank files written by the two nodes, meta.json by rank 0
    for key, value in local.state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6, msg=key)
