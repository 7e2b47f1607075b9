"""Accelerator presets and the cluster shape the planner reasons about.

Figures are vendor datasheet numbers for SXM parts (dense, no sparsity); bandwidths are the
per-device, one-direction figures a ring collective can use: NVLink inside a node, the
device's share of the InfiniBand fabric across nodes. `mfu` is the assumed fraction of peak
a well-tuned step reaches (torchtitan's Llama 3 8B on H100 reports ~0.4).

The CPU preset models this project's test machine (2 cores, 24 GiB, gloo on loopback) and
was calibrated with tests/benchmarks/planner_bench.py: its memory is host RAM shared by the
ranks of a node, each rank starts at the `framework_bytes` a Python process with torch and a
gloo process group already holds (peak RSS of a `tiny` run, whose model is negligible), the
memory measured is peak RSS, which also counts pages glibc malloc keeps after the forward's
temporaries are freed (`transient_slack` on the forward/backward peak), and ranks beyond the core
count share cores. gloo over loopback between 2 ranks, at the 1-24 MiB of a per-block
collective (per-rank volume): all-reduce ~1.2 GiB/s; all-gather and reduce-scatter ~0.3-0.5 GiB/s
at best but 40-120 MiB/s typical (FSDP's per-block all-gathers of 3 MiB took 40-80 ms in a
profiled `small` step), so 0.1x all-reduce's rate is used; a small collective takes 0.15 ms
median but ~1 ms mean on the shared machine (ranks wait to be scheduled), the latency used.
Timings on this machine swing by 2x with the load of other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3
GB = 1e9


class PlanError(ValueError):
    """A request the planner cannot answer (bad cluster shape, unknown preset); says what to fix."""

    def __init__(self, reasons: list[str] | str) -> None:
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__("; ".join(self.reasons))


# Dense peak FLOP/s per device (no sparsity), by training dtype: bfloat16 from tensor cores, float32
# the plain (non-TF32) FP32 rate, as the trainer runs fp32 matmuls in full precision. The one table:
# the presets below and the engine's MFU (parallel/metrics.py) read it.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100": {"bfloat16": 989e12, "float32": 67e12},  # SXM, HBM3
    "h100-pcie": {"bfloat16": 756e12, "float32": 51e12},
    "h200": {"bfloat16": 989e12, "float32": 67e12},
    "a100": {"bfloat16": 312e12, "float32": 19.5e12},
    "cpu": {"bfloat16": 25e9, "float32": 100e9},  # this project's test machine, calibrated (see above)
}
# A CUDA device's name (torch.cuda.get_device_name) to its PEAK_FLOPS entry, most specific first.
CUDA_NAMES = (("H100 PCIe", "h100-pcie"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def cuda_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a CUDA device by its name, or None for a device not in the table."""
    for needle, key in CUDA_NAMES:
        if needle in device_name:
            return PEAK_FLOPS[key].get(dtype)
    return None


@dataclass(frozen=True)
class Hardware:
    name: str
    devices_per_node: int  # the usual count; a cluster may use fewer per node
    mem_bytes: float | None  # per device; None: host memory shared by the node's ranks (CPU)
    peak_flops: dict[str, float]  # per device, by training dtype ("bfloat16", "float32")
    intra_bw: float  # bytes/s per device, one direction, inside a node
    inter_bw: float  # bytes/s per device, one direction, across nodes
    mem_bw: float  # bytes/s, device memory (the optimizer step is bound by it)
    host_mem_bytes: float  # per node, for CPU offload
    intra_latency_s: float = 10e-6  # per collective call (alpha of the alpha-beta model)
    inter_latency_s: float = 20e-6
    mfu: float = 0.4
    framework_bytes: float = 2 * GiB  # CUDA context, NCCL buffers, allocator slack; CPU: baseline RSS
    usable_fraction: float = 0.95  # caching-allocator fragmentation headroom
    cores_per_node: int | None = None  # CPU only: ranks beyond this share cores
    layer_overhead_s: float = 0.0  # per layer per micro-batch fwd+bwd: op dispatch not hidden by async launch
    # Bandwidth of each collective kind relative to all-reduce's (NCCL: ~1 for all; gloo: its
    # all-gather and reduce-scatter are far slower than its all-reduce, measured below).
    collective_efficiency: dict[str, float] = field(default_factory=dict)
    overlap_scale: float = 1.0  # 0 on CPU: gloo's copies and reductions run on the cores compute uses
    transient_slack: float = 1.0  # peak RSS over live bytes of forward/backward (CPU malloc keeps freed pages)
    notes: str = ""


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100", devices_per_node=8, mem_bytes=80 * GiB,
        peak_flops=PEAK_FLOPS["h100"],
        intra_bw=450 * GB, inter_bw=50 * GB, mem_bw=3.35e12, host_mem_bytes=2048 * GiB,
        notes="H100 SXM5 80GB, NVLink 4 (900 GB/s bidirectional), 8x400 Gb/s NDR per node",
    ),
    "h200": Hardware(
        name="h200", devices_per_node=8, mem_bytes=141 * GiB,
        peak_flops=PEAK_FLOPS["h200"],
        intra_bw=450 * GB, inter_bw=50 * GB, mem_bw=4.8e12, host_mem_bytes=2048 * GiB,
        notes="H200 SXM 141GB HBM3e, NVLink 4, 8x400 Gb/s NDR per node",
    ),
    "a100": Hardware(
        name="a100", devices_per_node=8, mem_bytes=80 * GiB,
        peak_flops=PEAK_FLOPS["a100"],
        intra_bw=300 * GB, inter_bw=25 * GB, mem_bw=2.0e12, host_mem_bytes=1024 * GiB,
        notes="A100 SXM4 80GB, NVLink 3 (600 GB/s bidirectional), 8x200 Gb/s HDR per node",
    ),
    "cpu": Hardware(
        name="cpu", devices_per_node=2, mem_bytes=None,
        peak_flops=PEAK_FLOPS["cpu"],
        intra_bw=1.2 * GiB, inter_bw=0.5 * GB, mem_bw=10 * GB, host_mem_bytes=24 * GiB,
        collective_efficiency={"all_gather": 0.1, "reduce_scatter": 0.1, "all_to_all": 0.25},
        intra_latency_s=1e-3, inter_latency_s=2e-3, mfu=0.35,
        framework_bytes=340 * 2**20, usable_fraction=0.9, cores_per_node=2, layer_overhead_s=1.5e-3,
        transient_slack=1.25, overlap_scale=0.0,
        notes="this project's test machine: 2 cores, 24 GiB shared by the ranks, gloo over loopback",
    ),
}


def get_hardware(name: str) -> Hardware:
    key = name.lower()
    if key not in HARDWARE:
        raise PlanError(f"unknown gpu {name!r}; choose one of {sorted(HARDWARE)}")
    return HARDWARE[key]


@dataclass(frozen=True)
class Cluster:
    hardware: Hardware
    nodes: int
    devices_per_node: int
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_mem_bytes(self) -> float:
        """What one rank may use: its device, or its share of the node's RAM on CPU."""
        hw = self.hardware
        if hw.mem_bytes is not None:
            return hw.mem_bytes
        return hw.host_mem_bytes / self.devices_per_node

    @property
    def host_mem_per_device(self) -> float:
        return self.hardware.host_mem_bytes / self.devices_per_node

    def describe(self) -> str:
        return f"{self.world}x {self.hardware.name} ({self.nodes} node(s) x {self.devices_per_node})"


def make_cluster(gpus: int, gpu: str = "h100", nodes: int | None = None) -> Cluster:
    """`gpus` devices in all on `nodes` nodes (default: as few full nodes as the preset allows)."""
    hw = get_hardware(gpu)
    if gpus < 1:
        raise PlanError(f"gpus={gpus}: need at least one device; pass --gpus N with N >= 1")
    if nodes is None:
        # CPU ranks are processes: one machine holds as many as asked (they share its cores).
        nodes = 1 if hw.mem_bytes is None else max(1, -(-gpus // hw.devices_per_node))
    if nodes < 1:
        raise PlanError(f"nodes={nodes}: need at least one node")
    if gpus % nodes:
        raise PlanError(
            f"gpus={gpus} is not divisible by nodes={nodes}; every node must hold the same number "
            f"of devices: pass a multiple of {nodes} or change --nodes"
        )
    per_node = gpus // nodes
    if hw.mem_bytes is not None and per_node > hw.devices_per_node:
        raise PlanError(
            f"{per_node} {hw.name} devices per node exceeds the preset's {hw.devices_per_node}; "
            f"raise --nodes to at least {-(-gpus // hw.devices_per_node)}"
        )
    return Cluster(hardware=hw, nodes=nodes, devices_per_node=per_node)
