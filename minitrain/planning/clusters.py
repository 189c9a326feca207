"""The clusters a run is re-timed on: named presets, every number with its source.

A :class:`ClusterSpec` is devices (:class:`Device`: peak FLOP/s, memory, and what its kernels run at —
:class:`minitrain.planning.kernels.DeviceKernels`) in nodes, and two links (:class:`Link`: the bus
bandwidth a collective achieves, the latency α per ring step and per launch) — inside a node and
between nodes.  :func:`minitrain.planning.projection.project` replays a run's recorded events on one;
``minitrain clusters`` lists them.

Where the numbers come from (never tuned to make a lesson look good, never fitted to a published
training throughput):

* peak bf16 dense FLOP/s, SMs, memory and link speeds: the vendors' datasheets (NVIDIA A100 Tensor
  Core GPU datasheet, 2021; NVIDIA H100 Tensor Core GPU datasheet, 2023; NVIDIA DGX A100 and DGX
  H100 user guides: eight 200 Gb/s HDR / 400 Gb/s NDR InfiniBand ports, one per GPU);
* what a step's kernels take: :mod:`minitrain.planning.kernels` — matrix products at the measured
  Maximum Achievable Matmul FLOPS (S. Bekman, "Machine Learning Engineering Open Book") with tile
  and wave quantization, FlashAttention at its published throughput, memory-bound passes at a
  measured bandwidth, a launch floor per kernel;
* bus bandwidths: nccl-tests measurements — ring all-reduce busbw on 8 GPUs of one node 234.89 GB/s
  on A100 (78 % of NVLink 3's 300 GB/s) and 367.61 GB/s on H200 (NVLink 4, NVLS off; 82 % of 450),
  all-gather 361.4 and reduce-scatter 362.9 GB/s (Bekman, network chapter, "Inter-node speed
  depends on intra-node speed" and "SHARP"); between nodes 24 GB/s per 200 Gb/s InfiniBand NIC
  ("we usually consider 24GB/s is the peak performance per 200G NIC", S. Jeaugey, NVIDIA,
  nccl-tests issue #119), i.e. 96 % of line rate; NCCL over TCP reached no more than 60 % of wire
  speed (NVIDIA/nccl issue #209);
* latencies: NCCL's own latency model (src/graph/tuning.cc, ``baseLatencies`` and ``hwLatencies``,
  Ring, LL protocol): 6.6 µs per collective, 0.6 µs per ring step on NVLink, 1.0 on PCIe, 2.7 over
  the network;
* this machine: calibrated on the spot (:func:`calibrate_rank`): the α-β fit of lesson 01
  (:func:`minitrain.planning.costmodel.fit_alpha_beta`), each rank's FLOP rate on a matrix product
  and its kernels' rates (:func:`minitrain.planning.kernels.calibrate_kernels`) —
  after a run projected on "local" or "binder", or by ``minitrain clusters --calibrate``
  (:func:`calibrate_here`); Binder's numbers are derived from it (its one core, its 2 GB).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace

from .costmodel import collective_seconds, ring_steps, ring_volume
from .kernels import DEVICES, DeviceKernels, cpu_kernels
from ..device import now

__all__ = ["Device", "Link", "Host", "ClusterSpec", "PRESETS", "cluster_names", "get_cluster",
           "local_cluster", "calibrate_rank", "calibrate_here", "describe"]

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One device.  ``peak_flops``: bf16 dense (TF32 in ``peak_flops_fp32``), what MFU is taken
    against; ``kernels``: what its kernels run at (:mod:`minitrain.planning.kernels`);
    ``memory_bw``: bytes/s; ``cores``: for a CPU, the cores its ranks share (each rank gets
    ``min(1, cores / ranks on the node)`` of one)."""

    name: str
    peak_flops: float
    peak_flops_fp32: float
    memory_bw: float
    memory_gb: float
    source: str
    cores: int | None = None
    kernels: DeviceKernels | None = None

    def peak(self, precision: str = "bf16-mixed") -> float:
        """Peak FLOP/s at ``precision`` (fp32 on tensor cores: TF32)."""
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops

    def flop_rate(self, precision: str = "bf16-mixed", ranks_on_node: int = 1) -> float:
        """The fastest a matrix product runs here, per rank: the device's measured maximum
        achievable matmul FLOP/s (a CPU: its calibrated rate, shared by the ranks on its cores).
        Not a training step's rate: :mod:`minitrain.planning.kernels` prices a step."""
        rate = self.kernels.matmul_rate(precision) if self.kernels and not self.cores \
            else self.peak(precision)
        share = 1.0 if self.cores is None else min(1.0, self.cores / max(1, ranks_on_node))
        return rate * share


@dataclass(frozen=True)
class Link:
    """A link's collective performance: ``busbw`` bytes/s per rank (nccl-tests' bus bandwidth),
    ``alpha`` seconds per ring step, ``base`` seconds per collective."""

    name: str
    busbw: float
    alpha: float
    base: float
    source: str
    p2p_alpha: float | None = None  # a point-to-point message's latency, where it differs (gloo)
    per_op: tuple = ()  # ((op, alpha, beta), ...): where each collective was fitted on its own


@dataclass(frozen=True)
class Host:
    """A node's host side, where ZeRO-Offload puts the optimizer states and step: ``memory_gb``
    per node, ``pcie`` bytes/s between host and each device, ``adam_params_per_s`` the
    parameters per second the CPU's Adam step takes on each device's share of the host."""

    memory_gb: float
    pcie: float
    adam_params_per_s: float
    source: str


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` nodes of ``devices_per_node`` devices; ``intra`` links inside a node, ``inter``
    the network (per device: one NIC per GPU on the DGX nodes); ``host`` the host side of a node
    (None where no offload is priced)."""

    key: str
    title: str
    device: Device
    devices_per_node: int
    nodes: int
    intra: Link
    inter: Link | None
    notes: str = ""
    calibration: dict = field(default_factory=dict)
    host: Host | None = None

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def accelerator(self) -> bool:
        return self.device.cores is None

    def placement(self, world: int) -> list[int]:
        """The node of each of ``world`` ranks: spread evenly over ``min(nodes, world)`` nodes in
        contiguous blocks, as ``torchrun --nnodes K --nproc-per-node world/K`` places them."""
        if world > self.devices:
            raise ValueError(f"{world} ranks do not fit {self.title} ({self.devices} devices)")
        used = min(self.nodes, world)
        per = math.ceil(world / used)
        if per > self.devices_per_node:
            per = self.devices_per_node
        return [r // per for r in range(world)]

    def seconds(self, op: str, nbytes: float, nodes_of_members: list[int]) -> float:
        """Time of one collective (or, with two members, a send) over ranks on these nodes."""
        n = len(nodes_of_members)
        if n <= 1 and op not in ("send", "recv"):
            return 0.0
        counts: dict[int, int] = {}
        for node in nodes_of_members:
            counts[node] = counts.get(node, 0) + 1
        k, g = len(counts), max(counts.values())
        if k == 1 or self.inter is None:
            link = self.intra
            if op in ("send", "recv") and link.p2p_alpha is not None:
                return link.p2p_alpha + nbytes / link.busbw
            own = {o: (a, b) for o, a, b in link.per_op}
            if op in own:
                return collective_seconds(op, nbytes, n, own[op][0], own[op][1], link.base)
            return collective_seconds(op, nbytes, n, link.alpha, 1 / link.busbw, link.base)
        # across nodes: a ring whose node boundaries are crossed by the node's g NICs in parallel
        # (Bekman's "model 2", within 6 % of the 4-node measurement), and whose steps that cross a
        # node pay the network's latency (NCCL's tuning model: 2(k-1) of them for an all-reduce)
        busbw = min(self.intra.busbw if g > 1 else math.inf, g * self.inter.busbw)
        if op in ("send", "recv"):
            return self.inter.base + self.inter.alpha + nbytes / self.inter.busbw
        steps = ring_steps(op, n)
        crossing = min(steps, (2 if op in ("all_reduce", "barrier") else 1) * (k - 1))
        latency = (self.intra.base + (steps - crossing) * self.intra.alpha
                   + crossing * self.inter.alpha)
        return latency + ring_volume(op, nbytes, n) / busbw

    def row(self) -> dict:
        """The numbers, for ``minitrain clusters`` and the projection's summary."""
        d = self.device
        out = {"cluster": self.key, "title": self.title, "devices": self.devices,
               "devices_per_node": self.devices_per_node, "nodes": self.nodes,
               "device": d.name, "peak_tflops": d.peak_flops / 1e12,
               "memory_gb": d.memory_gb, "memory_bw_gbps": d.memory_bw / GB,
               "intra_busbw_gbps": self.intra.busbw / GB, "intra_alpha_us": self.intra.alpha * 1e6,
               "sources": [d.source, self.intra.source] + ([self.inter.source] if self.inter else [])}
        k = d.kernels
        if k is not None and not k.per_op:
            out.update(sms=k.sms, mamf_tflops=k.mamf / 1e12,
                       achievable_bw_gbps=k.achievable_bandwidth / GB, launch_us=k.launch_s * 1e6)
            out["sources"][0] = k.source
        if self.inter is not None:
            out.update(inter_busbw_gbps=self.inter.busbw / GB, inter_alpha_us=self.inter.alpha * 1e6)
        if self.host is not None:
            out.update(host_memory_gb=self.host.memory_gb, host_pcie_gbps=self.host.pcie / GB)
            out["sources"].append(self.host.source)
        if self.calibration:
            out["calibration"] = self.calibration
        return out


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------

_NCCL_LAT = "NCCL src/graph/tuning.cc latency model (Ring, LL): 6.6 µs launch"
A100 = Device("NVIDIA A100 SXM 80GB", 312e12, 156e12, 2.039e12, 80,
              "NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 156 TF32, 2,039 GB/s HBM2e, 80 GB)",
              kernels=DEVICES["A100 SXM"])
H100 = Device("NVIDIA H100 SXM 80GB", 989e12, 494.7e12, 3.35e12, 80,
              "NVIDIA H100 datasheet (989 TFLOP/s bf16 dense, 495 TF32, 3.35 TB/s HBM3, 80 GB)",
              kernels=DEVICES["H100 SXM"])
A100_PCIE = Device("NVIDIA A100 PCIe 80GB", 312e12, 156e12, 1.935e12, 80,
                   "NVIDIA A100 datasheet (PCIe: 312 TFLOP/s bf16, 1,935 GB/s)",
                   kernels=DEVICES["A100 PCIe"])

NVLINK3 = Link("NVLink 3 / NVSwitch", 234.89 * GB, 0.6e-6, 6.6e-6,
               "nccl-tests all-reduce busbw 234.89 GB/s on 8 A100 (Bekman, network chapter); "
               + _NCCL_LAT + ", 0.6 µs per NVLink step")
NVLINK4 = Link("NVLink 4 / NVSwitch", 367.61 * GB, 0.6e-6, 6.6e-6,
               "nccl-tests ring all-reduce busbw 367.61 GB/s on 8 H200 = H100's NVLink 4, NVLS off "
               "(Bekman, network chapter); " + _NCCL_LAT + ", 0.6 µs per NVLink step")
HDR = Link("InfiniBand HDR 200 Gb/s per GPU", 24 * GB, 2.7e-6, 6.6e-6,
           "DGX A100: 8x 200 Gb/s HDR, one per GPU (datasheet); 24 GB/s per 200G NIC achievable "
           "(S. Jeaugey, NVIDIA, nccl-tests #119); NCCL latency model: 2.7 µs per network step")
NDR = Link("InfiniBand NDR 400 Gb/s per GPU", 48 * GB, 2.7e-6, 6.6e-6,
           "DGX H100: 8x 400 Gb/s NDR ConnectX-7, one per GPU (datasheet); 96 % of line rate as "
           "per 200G NIC (nccl-tests #119); NCCL latency model: 2.7 µs per network step")
PCIE4 = Link("PCIe 4.0 x16 (one GPU: none used)", 0.8 * 32 * GB, 1.0e-6, 6.6e-6,
             "PCIe 4.0 x16 32 GB/s at the ~80 % links reach (Bekman); NCCL latency model, PCIe")
ETH25 = Link("25 Gb/s Ethernet, TCP", 0.6 * 3.125 * GB, 2.7e-6, 6.6e-6,
             "25 Gb/s = 3.125 GB/s line rate; NCCL over TCP reached no more than 60 % of wire "
             "speed (NVIDIA/nccl #209); NCCL latency model: 2.7 µs per network step")

_ADAM = "the CPU's Adam at 10⁹ parameters/s per GPU's share: an assumption"
DGX_A100_HOST = Host(2048, 0.8 * 32 * GB, 1e9,
                     "DGX A100 user guide: 2 TB of system memory per node; each A100 on PCIe 4.0 "
                     "x16 to the host, 32 GB/s at the ~80 % links reach (Bekman); " + _ADAM)
DGX_H100_HOST = Host(2048, 0.8 * 64 * GB, 1e9,
                     "DGX H100 user guide: 2 TB of system memory per node; each H100 on PCIe 5.0 "
                     "x16 to the host, 64 GB/s at the ~80 % links reach (Bekman); " + _ADAM)


def _dgx(key: str, title: str, device: Device, intra: Link, inter: Link, nodes: int) -> ClusterSpec:
    host = DGX_H100_HOST if device is H100 else DGX_A100_HOST
    return ClusterSpec(key, title, device, 8, nodes, intra, inter, host=host)


PRESETS: dict[str, ClusterSpec] = {
    "dgx-a100": _dgx("dgx-a100", "one DGX A100 node: 8x A100 80GB on NVLink 3 / NVSwitch", A100,
                     NVLINK3, HDR, 1),
    "dgx-h100": _dgx("dgx-h100", "one DGX H100 node: 8x H100 80GB on NVLink 4 / NVSwitch", H100,
                     NVLINK4, NDR, 1),
    "ib-a100": _dgx("ib-a100", "DGX A100 nodes on 8x 200 Gb/s InfiniBand (xN: N nodes, default 4)",
                    A100, NVLINK3, HDR, 4),
    "ib-h100": _dgx("ib-h100", "DGX H100 nodes on 8x 400 Gb/s InfiniBand (xN: N nodes, default 4)",
                    H100, NVLINK4, NDR, 4),
    "eth-25g": ClusterSpec("eth-25g", "commodity: one A100 PCIe per node, 25 Gb/s Ethernet "
                           "(xN: N nodes, default 16)", A100_PCIE, 1, 16, PCIE4, ETH25),
}
#: calibrated on the spot (need the run's ranks): this machine, and Binder's one CPU
CALIBRATED = {"local": "this machine: its CPU ranks, calibrated on the spot (FLOP rate per rank, "
                       "lesson 01's α-β fit over loopback)",
              "binder": "Binder (mybinder.org: 1 CPU, 2 GB): every rank on one core — the run's "
                        "measured compute stretched by the cores it had here (a bigger model: this "
                        "machine's per-core FLOP rate), its loopback α-β"}


def cluster_names() -> list[str]:
    return sorted(PRESETS) + sorted(CALIBRATED)


_SPEC = re.compile(r"^([a-z0-9-]+?)(?:x(\d+))?$")


def parse(spec: str) -> tuple[str, int | None]:
    """``"ib-h100x4"`` -> ("ib-h100", 4); ``"dgx-h100"`` -> ("dgx-h100", None).  A ValueError
    naming the choices for anything else."""
    m = _SPEC.match(str(spec).strip().lower())
    name, nodes = (m.group(1), m.group(2)) if m else (str(spec), None)
    if name not in PRESETS and name not in CALIBRATED:
        close = difflib.get_close_matches(name, cluster_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown cluster {spec!r}{hint}; choose one of: {', '.join(cluster_names())} "
                         "(a preset may take xN for N nodes, e.g. ib-h100x4)")
    if nodes is not None:
        if name in CALIBRATED:
            raise ValueError(f"cluster {name!r} is this machine: it takes no node count")
        if int(nodes) < 1:
            raise ValueError(f"{spec!r}: the node count must be at least 1")
    return name, None if nodes is None else int(nodes)


def get_cluster(spec: str, calibration: dict | None = None) -> ClusterSpec:
    """The preset ``spec`` names (``"dgx-h100"``, ``"ib-h100x8"``); ``"local"`` and ``"binder"``
    need ``calibration`` (from :func:`calibrate_rank` on the run's ranks)."""
    name, nodes = parse(spec)
    if name in CALIBRATED:
        if not calibration:
            raise ValueError(f"cluster {name!r} is calibrated on the run's ranks: project the result "
                             "of train(..., project=...) or of a run recorded with calibration")
        return local_cluster(calibration, binder=name == "binder")
    preset = PRESETS[name]
    if nodes is not None:
        title = re.sub(r"\(xN:.*\)$", f"({nodes} nodes)", preset.title) if "xN" in preset.title \
            else f"{nodes} x {preset.title}"
        preset = replace(preset, key=f"{name}x{nodes}", nodes=nodes, title=title)
    return preset


def local_cluster(cal: dict, binder: bool = False) -> ClusterSpec:
    """This machine from its calibration (``cal``: ``alpha``, ``beta``, ``flop_rate`` per rank with
    ``ranks`` ranks running at once, ``memory_rate``, ``cores``); ``binder``: one core instead."""
    ranks, cores = cal["ranks"], cal["cores"]
    per_core = cal["flop_rate"] * ranks / min(ranks, cores)  # all ranks computed at once
    device = Device("a CPU rank (this machine)" if not binder else "Binder's one CPU", per_core,
                    per_core, cal["memory_rate"] * ranks / min(ranks, cores),
                    2.0 if binder else cal.get("memory_gb", 0.0),
                    "calibrated on the spot: matrix products on every rank at once"
                    + ("; Binder: 1 CPU, 2 GB (mybinder.org user guide)" if binder else ""),
                    cores=1 if binder else cores,
                    kernels=cpu_kernels(cal["kernels"]) if cal.get("kernels") else None)
    link = Link("loopback (gloo)", 1 / max(cal["beta"], 1e-15), cal["alpha"], 0.0,
                f"α-β fit here ({cal.get('fit', 'an all-reduce sweep, lesson 01')})",
                cal.get("p2p_alpha"),
                tuple((op, a, b) for op, (a, b) in sorted((cal.get("per_op") or {}).items())))
    key = "binder" if binder else "local"
    return ClusterSpec(key, CALIBRATED[key], device, max(ranks, 1), 1, link, None, calibration=cal)


def describe(calibration: dict | None = None) -> list[dict]:
    """Every preset's numbers and sources; this machine's and Binder's from ``calibration`` (what
    :func:`calibrate_rank` measured, e.g. by :func:`calibrate_here`), else by name with the command
    that measures them."""
    rows = [PRESETS[k].row() for k in sorted(PRESETS)]
    for key, title in sorted(CALIBRATED.items()):
        if calibration:
            rows.append(_calibrated_row(key, calibration))
        else:
            rows.append({"cluster": key, "title": title, "calibrate": "minitrain clusters --calibrate"})
    return rows


def _calibrated_row(key: str, cal: dict) -> dict:
    """``local`` or ``binder``'s row: the spec's numbers, and per rank what a run of
    ``cal["ranks"]`` ranks gets here (local) or would get on Binder's one core."""
    spec = local_cluster(cal, binder=key == "binder")
    ranks, cores = cal["ranks"], cal["cores"]
    d = spec.device
    share = min(1.0, (d.cores or 1) / max(1, ranks))  # what Device.flop_rate gives each rank
    row = spec.row()
    row.update(ranks=ranks, cores=d.cores,
               flop_rate_per_rank_gflops=d.flop_rate("fp32", ranks) / 1e9,
               memory_bw_per_rank_gbps=d.memory_bw * share / GB,
               alpha_us=cal["alpha"] * 1e6, beta_s_per_byte=cal["beta"],
               loopback_gbps=1 / max(cal["beta"], 1e-15) / GB,
               p2p_alpha_us=(cal.get("p2p_alpha") or 0.0) * 1e6)
    if key == "local":
        row["derived"] = (f"measured now with {ranks} ranks at once on {cores} cores: a 256x256 "
                          "fp32 matrix product on each rank (FLOP/s), an 8 MB copy (memory), "
                          "lesson 01's all-reduce sweep of 4 KB-4 MB fitted to α + β·bytes "
                          "(slowest rank), a 16-float ping-pong (a message's latency)")
    else:
        row["derived"] = (f"not measured on Binder: this machine's FLOP rate per core (measured "
                          f"now: {d.peak_flops / 1e9:,.1f} GFLOP/s) on Binder's one core, which "
                          f"all {ranks} ranks share; this machine's loopback α-β; 2 GB memory "
                          "(mybinder.org user guide)")
    return row


def calibrate_here(ranks: int = 2, cluster=None) -> dict:
    """This machine calibrated on the spot (``minitrain clusters --calibrate``): :func:`calibrate_rank`
    on ``ranks`` ranks started for it and stopped after (a few seconds), or on a running
    :class:`~minitrain.runtime.launch.Cluster`'s; rank 0's result."""
    if cluster is not None:
        return cluster.run(calibrate_rank)[0]
    from ..runtime.launch import Cluster
    with Cluster(ranks, threads=1) as c:
        return c.run(calibrate_rank)[0]


# --------------------------------------------------------------------------------------------------
# Calibrating this machine (runs on every rank of a live process group)
# --------------------------------------------------------------------------------------------------


def calibrate_rank(sizes=(4096, 65536, 1 << 20, 4 << 20), repeats: int = 3) -> dict:
    """This machine's numbers, measured with every rank at once (call it on every rank): the α-β of
    a ring all-reduce (lesson 01's fit, max over ranks), a small message's one-way time between
    neighbours (``p2p_alpha``), each rank's FLOP rate on a 256x256 fp32 matrix product, its
    memory bandwidth on an 8 MB copy, how much slower it computes beside its collectives
    (``overlap_slowdown``) and its kernels' rates; ``cores`` and ``memory_gb`` from the operating
    system."""
    import torch
    import torch.distributed as dist

    from .costmodel import fit_alpha_beta, time_all_reduce
    from .kernels import calibrate_kernels

    n = dist.get_world_size()
    mine = time_all_reduce(list(sizes), repeats) if n > 1 else [0.0] * len(sizes)
    t = torch.tensor(mine, dtype=torch.float64, device="cpu")
    if n > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        alpha, beta = fit_alpha_beta(list(sizes), t.tolist(), n)
    else:
        alpha, beta = 0.0, 1e-10
    a, b = torch.randn(256, 256, device="cpu"), torch.randn(256, 256, device="cpu")
    a @ b
    if n > 1:
        dist.barrier()
    start, k = now(), 0
    while now() - start < 0.2:
        a @ b
        k += 1
    flop_rate = 2 * 256 ** 3 * k / (now() - start)
    x, y = torch.empty(2 << 20, device="cpu"), torch.empty(2 << 20, device="cpu")
    start, k = now(), 0
    while now() - start < 0.05:
        y.copy_(x)
        k += 1
    memory_rate = 2 * x.numel() * 4 * k / (now() - start)
    p2p = _ping_pong(n) if n > 1 else 0.0
    overlap = _beside_communication(n)
    kernels = calibrate_kernels(repeats=3)  # every rank at once, as they computed in the run
    rates = torch.tensor([flop_rate, memory_rate], dtype=torch.float64, device="cpu")
    if n > 1:
        dist.all_reduce(rates)
    return {"ranks": n, "cores": os.cpu_count() or 1, "alpha": alpha, "beta": beta,
            "p2p_alpha": p2p,
            "flop_rate": rates[0].item() / n, "memory_rate": rates[1].item() / n,
            "memory_gb": _memory_gb(), "sizes": list(sizes), "seconds": t.tolist(),
            "overlap_slowdown": overlap, "kernels": _ranks_mean(kernels, n)}


def _beside_communication(n: int, messages: int = 12, size: int = 1 << 20) -> float:
    """How much slower a rank computes while its collectives are in flight (the mean over ranks):
    matrix products timed alone, then beside ``messages`` asynchronous all-reduces of ``size``
    floats (every rank at once, both times).  On a CPU the collective's thread, its copies and
    the loopback's system calls run on the cores the compute has; 1.0 on one rank."""
    import torch
    import torch.distributed as dist

    if n == 1:
        return 1.0
    a, b = torch.randn(128, 128, device="cpu"), torch.randn(128, 128, device="cpu")
    buf = torch.zeros(size, device="cpu")
    a @ b
    dist.barrier()
    start, k = now(), 0
    while now() - start < 0.03:
        a @ b
        k += 1
    alone = (now() - start) / k
    dist.barrier()
    works = [dist.all_reduce(buf, async_op=True) for _ in range(messages)]
    start, k = now(), 0
    while not all(w.is_completed() for w in works):
        a @ b
        k += 1
    beside = (now() - start) / max(k, 1)
    for w in works:
        w.wait()
    t = torch.tensor([max(1.0, beside / alone)], dtype=torch.float64, device="cpu")
    dist.all_reduce(t)
    return t.item() / n


def _ranks_mean(kernels: dict, n: int) -> dict:
    """Every rank's kernel calibration reduced to one the replay prices every rank by: each
    rate the ranks' harmonic mean (a kernel's time, the mean of theirs), the per-op overheads
    their mean.  A mean, not the least rate point by point: each point is a few timings on
    cores the ranks share, and the least of them at every point is a slower machine than any rank
    ran on (the replay's waits already make the step the slowest rank's)."""
    import torch
    import torch.distributed as dist

    if n == 1:
        return kernels
    kinds = sorted(kernels.get("dispatch") or {})
    lists = [key for key in ("gemm", "gemm_shapes", "gemm_shapes_cold", "ops", "attention")
             if kernels.get(key)]
    # one SUM all-reduce of times per unit (1/rate) and of overheads
    values = [1 / p[-1] for key in lists for p in kernels[key]] + [1 / kernels["bandwidth"],
                                                                  kernels["op_overhead_s"]]
    values += [kernels["dispatch"][k] for k in kinds]
    t = torch.tensor(values, dtype=torch.float64, device="cpu")
    dist.all_reduce(t)
    reduced = iter((t / n).tolist())
    out = {key: [[*p[:-1], 1 / next(reduced)] for p in kernels[key]] for key in lists}
    out.update(bandwidth=1 / next(reduced), op_overhead_s=next(reduced),
               dispatch={k: next(reduced) for k in kinds},
               cache_bytes=kernels.get("cache_bytes", 0.0))
    return out


def _ping_pong(n: int, rounds: int = 20) -> float:
    """One-way time of a small message between neighbouring ranks (0<->1, 2<->3, ...): the median
    round trip over two."""
    import torch
    import torch.distributed as dist

    r = dist.get_rank()
    peer = r ^ 1
    buf = torch.zeros(16, device="cpu")
    if peer >= n:
        dist.barrier()
        return 0.0
    times = []
    for _ in range(rounds):
        t = now()
        if r % 2 == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        times.append(now() - t)
    dist.barrier()
    times.sort()
    return times[len(times) // 2] / 2


def _memory_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 0.0


def as_dict(spec: ClusterSpec) -> dict:
    return asdict(spec)
