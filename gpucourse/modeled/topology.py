"""Reading ``nvidia-smi topo -m``: which GPUs talk over NVLink, which over PCIe, which NIC is near which GPU.

``nvidia-smi topo -m`` prints a matrix with one row and one column per GPU and network card (NIC), each cell the
path between the two, and the CPU cores and NUMA node nearest each GPU. The cells, fastest first (the legend that
nvidia-smi prints under the matrix):

- ``NV#``  — a bonded set of # NVLinks (through NVSwitch on an HGX/DGX server: every pair the same);
- ``PIX``  — at most one PCIe bridge;
- ``PXB``  — several PCIe bridges, without crossing the PCIe host bridge;
- ``PHB``  — PCIe and a PCIe host bridge (typically the CPU);
- ``NODE`` — PCIe and the interconnect between PCIe host bridges within one NUMA node;
- ``SYS``  — PCIe and the interconnect between NUMA nodes (CPU sockets: QPI/UPI): the slowest path.

What to do with it: put the ranks that talk most — tensor parallelism, every block — on the fastest paths, the
data-parallel all-reduce (once a step, overlapped with backward) on the slower ones; and check that each GPU has a
NIC at PIX or PXB, the short path GPUDirect RDMA needs to move data between the GPU and the network without a
copy through host memory. :func:`parse` reads the matrix; :func:`placement` judges a layout's groups on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LEGEND = {
    "X": "the device itself",
    "NV#": "a bonded set of # NVLinks",
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges, not crossing the PCIe host bridge",
    "PHB": "PCIe and a PCIe host bridge (typically the CPU)",
    "NODE": "PCIe and the interconnect between PCIe host bridges within one NUMA node",
    "SYS": "PCIe and the interconnect between NUMA nodes (e.g. QPI/UPI)",
}
PCIE_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS")  # fastest first, after NVLink
_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx5_\d+)$")


@dataclass
class Topology:
    devices: list[str]
    links: dict[tuple[str, str], str]
    affinity: dict[str, list[str]]  # a device's remaining columns: CPU affinity, NUMA affinity, ...

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if not d.startswith("GPU")]

    def link(self, a: str, b: str) -> str:
        return self.links[(a, b)]

    def table(self) -> str:
        """The matrix again, in narrow columns (nvidia-smi's tabs make an 8-GPU server's rows 120 characters wide),
        with each row's CPU and NUMA affinity after it."""
        width = max(len(d) for d in self.devices) + 1
        lines = [" " * width + "".join(f"{d:>{width}}" for d in self.devices) + "  affinity"]
        for row in self.devices:
            cells = "".join(f"{self.link(row, d):>{width}}" for d in self.devices)
            lines.append(f"{row:<{width}}{cells}  {' '.join(self.affinity[row])}".rstrip())
        return "\n".join(lines)

    def nearest(self, device: str, among: list[str]) -> tuple[str, str]:
        """The device of ``among`` on the fastest path from ``device``, and that path."""
        return min(((d, self.link(device, d)) for d in among if d != device), key=lambda x: speed_rank(x[1]))


def speed_rank(link: str) -> tuple[int, int]:
    """Sort key, fastest first: NVLink (more links first), then the PCIe paths of :data:`PCIE_ORDER`."""
    if re.fullmatch(r"NV\d+", link):
        return 0, -int(link[2:])
    if link == "X":
        return -1, 0
    if link not in PCIE_ORDER:
        raise ValueError(f"unknown path {link!r} in the matrix: nvidia-smi's legend has X, NV#, "
                         f"{', '.join(PCIE_ORDER)}.")
    return 1, PCIE_ORDER.index(link)


def parse(text: str) -> Topology:
    """The matrix of an ``nvidia-smi topo -m`` printout (the legend below it is ignored)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if "GPU0" in ln.split()), None)
    if header is None:
        raise ValueError("no matrix found: nvidia-smi topo -m prints a header row with GPU0, GPU1, ...")
    devices = [t for t in header.split() if _DEVICE.match(t)]
    links, affinity = {}, {}
    for ln in lines[lines.index(header) + 1:]:
        fields = ln.split()
        if not fields or fields[0] not in devices:
            continue
        row, cells = fields[0], fields[1:1 + len(devices)]
        if len(cells) < len(devices):
            raise ValueError(f"the row of {row} has {len(cells)} cells for {len(devices)} devices.")
        for other, cell in zip(devices, cells):
            speed_rank(cell)  # an unknown path is refused here, with the legend
            links[(row, other)] = cell
        affinity[row] = fields[1 + len(devices):]
    missing = [d for d in devices if d not in affinity]
    if missing:
        raise ValueError(f"no row for {', '.join(missing)} in the matrix.")
    return Topology(devices, links, affinity)


def slowest(topo: Topology, gpus: list[int]) -> str:
    """The slowest path between any two of these GPUs (by index)."""
    names = [f"GPU{g}" for g in gpus]
    pairs = [topo.link(a, b) for a in names for b in names if a != b]
    return max(pairs, key=speed_rank) if pairs else "X"


def placement(topo: Topology, tp: int, dp: int = 1) -> dict:
    """Where a dp × tp layout's traffic goes when rank r runs on GPU r and tensor-parallel ranks are adjacent
    (the course's mesh): the slowest path inside each tp group and inside each dp group."""
    n = tp * dp
    if n > len(topo.gpus):
        raise ValueError(f"dp {dp} × tp {tp} = {n} ranks, and the matrix has {len(topo.gpus)} GPUs.")
    tp_groups = [list(range(g * tp, (g + 1) * tp)) for g in range(dp)]
    dp_groups = [list(range(t, n, tp)) for t in range(tp)]
    return {"tp": {tuple(g): slowest(topo, g) for g in tp_groups},
            "dp": {tuple(g): slowest(topo, g) for g in dp_groups}}


# Two printouts to read without a GPU, in nvidia-smi's format: an 8-GPU NVSwitch server (every GPU pair NV18, as
# H100 SXM's 18 NVLinks give; a NIC for each pair of GPUs on their PCIe switch; two CPU sockets) and a 4-GPU
# workstation whose GPUs are NVLinked in pairs across two CPU sockets.
EXAMPLES = {
    "8-GPU NVSwitch server": """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tSYS\tSYS\t0-47\t0
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tSYS\tSYS\t0-47\t0
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tSYS\tSYS\t0-47\t0
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tSYS\tSYS\t0-47\t0
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\tPIX\tNODE\t48-95\t1
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\tPIX\tNODE\t48-95\t1
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tNODE\tPIX\t48-95\t1
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tNODE\tPIX\t48-95\t1
NIC0\tPIX\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tSYS\tSYS
NIC1\tNODE\tNODE\tPIX\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\t X \tSYS\tSYS
NIC2\tSYS\tSYS\tSYS\tSYS\tPIX\tPIX\tNODE\tNODE\tSYS\tSYS\t X \tNODE
NIC3\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tPIX\tSYS\tSYS\tNODE\t X
""",
    "4-GPU workstation": """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\tSYS\t0-15\t0
GPU1\tNV4\t X \tSYS\tSYS\t0-15\t0
GPU2\tSYS\tSYS\t X \tNV4\t16-31\t1
GPU3\tSYS\tSYS\tNV4\t X \t16-31\t1
""",
}
