"""The accelerators `k3 plan` knows, with every number it assumes about them (torch-free).

Memory is the capacity `nvidia-smi` reports for the part (MiB), of which `usable` is what a plan
may fill: the rest is left to the CUDA context, NCCL's buffers and the caching allocator's
fragmentation. Throughput is the dense (not 2:4-sparse) bf16 tensor-core peak of the SXM part.
Bandwidths are per GPU and per direction: NVLink inside a node of `gpus_per_node`, the network
adapter between nodes (one 400 Gb/s ConnectX-7 NIC per GPU on HGX H100/H200 systems, 200 Gb/s
HDR on DGX A100).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

GIB = 2**30
USABLE_FRACTION = 0.9  # of the reported capacity; see the module docstring


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # as nvidia-smi reports it
    bf16_flops: float  # dense peak, FLOP/s
    nvlink_bytes_s: float  # per GPU, one direction, inside a node
    network_bytes_s: float  # per GPU, one direction, between nodes
    gpus_per_node: int
    source: str

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * USABLE_FRACTION)

    def link_bytes_s(self, group: int, stride: int = 1) -> float:
        """Bandwidth of a collective over `group` ranks spaced `stride` apart: NVLink while the
        group stays inside a node, the network once it spans nodes."""
        return self.nvlink_bytes_s if group * stride <= self.gpus_per_node else self.network_bytes_s

    def as_dict(self) -> dict:
        return asdict(self) | {"usable_bytes": self.usable_bytes}


GPUS = {
    "a100": GPU("A100 SXM4 80GB", 81920 * 2**20, 312e12, 300e9, 25e9, 8,
                "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s (300 GB/s per direction); "
                "DGX A100: 200 Gb/s HDR InfiniBand per GPU"),
    "h100": GPU("H100 SXM5 80GB", 81559 * 2**20, 989e12, 450e9, 50e9, 8,
                "NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense (1,979 with sparsity), NVLink 4 900 GB/s "
                "(450 GB/s per direction); HGX H100: 400 Gb/s ConnectX-7 per GPU"),
    "h200": GPU("H200 SXM 141GB", 143771 * 2**20, 989e12, 450e9, 50e9, 8,
                "NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, the H100's tensor cores (989 TFLOP/s bf16 "
                "dense), NVLink 4 900 GB/s; HGX H200: 400 Gb/s ConnectX-7 per GPU"),
}


def get_gpu(name: str) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose from {sorted(GPUS)}")
    return GPUS[key]
