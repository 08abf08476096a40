"""Reading nvidia-smi topo -m, and NCCL's ring and tree all-reduce in the modeled cluster: what notebook 01 says."""

from __future__ import annotations

import pytest

from gpucourse import topology
from gpucourse.cluster import Cluster


def test_the_examples_parse_into_their_matrices():
    server = topology.parse(topology.EXAMPLES["8-GPU NVSwitch server"])
    assert server.gpus == [f"GPU{i}" for i in range(8)] and server.nics == [f"NIC{i}" for i in range(4)]
    assert {server.link(a, b) for a in server.gpus for b in server.gpus if a != b} == {"NV18"}
    assert server.link("GPU5", "GPU5") == "X" and server.affinity["GPU5"] == ["48-95", "1"]
    # Every GPU has a NIC on its own PCIe switch: the short path GPUDirect RDMA wants.
    assert {g: server.nearest(g, server.nics) for g in ("GPU0", "GPU3", "GPU6")} == {
        "GPU0": ("NIC0", "PIX"), "GPU3": ("NIC1", "PIX"), "GPU6": ("NIC3", "PIX")}
    station = topology.parse(topology.EXAMPLES["4-GPU workstation"])
    assert station.link("GPU0", "GPU1") == "NV4" and station.link("GPU1", "GPU2") == "SYS"
    # The narrow table reads back as the same matrix.
    assert topology.parse(server.table()).links == server.links and max(map(len, server.table().splitlines())) < 90


def test_placement_puts_tensor_parallel_pairs_on_nvlink():
    station = topology.parse(topology.EXAMPLES["4-GPU workstation"])
    assert topology.placement(station, tp=2, dp=2) == {"tp": {(0, 1): "NV4", (2, 3): "NV4"},
                                                       "dp": {(0, 2): "SYS", (1, 3): "SYS"}}
    assert topology.placement(station, tp=4)["tp"] == {(0, 1, 2, 3): "SYS"}
    with pytest.raises(ValueError, match="4 GPUs"):
        topology.placement(station, tp=4, dp=2)


def test_paths_sort_fastest_first_and_bad_matrices_are_refused():
    order = sorted(["SYS", "PIX", "NV4", "NODE", "NV18", "PHB", "PXB"], key=topology.speed_rank)
    assert order == ["NV18", "NV4", "PIX", "PXB", "PHB", "NODE", "SYS"]
    with pytest.raises(ValueError, match="no matrix"):
        topology.parse("nvidia-smi: command not found")
    with pytest.raises(ValueError, match="unknown path 'NVX'"):
        topology.parse("\tGPU0\tGPU1\nGPU0\t X \tNVX\nGPU1\tNV1\t X \n")
    with pytest.raises(ValueError, match="no row for GPU1"):
        topology.parse("\tGPU0\tGPU1\nGPU0\t X \tNV1\n")


def test_ring_and_tree_all_reduce_as_notebook_01_tables_them():
    one = Cluster.of("h100", 8, 1)
    many = Cluster.of("h100", 8, 16)
    small, large = 256 * 2 ** 10, 256 * 2 ** 20
    pick = {(c.nodes, s): c.collective_s("all_reduce", s, range(c.gpus))[1] for c in (one, many) for s in (small, large)}
    # Inside one server: tree for small messages, ring for large; across 16 servers the tree's latency wins.
    assert pick == {(1, small): "tree", (1, large): "ring", (16, small): "tree", (16, large): "tree"}
    # ... at every payload notebook 01 tables, from 64 KB to 1 GB.
    assert {many.collective_s("all_reduce", 2 ** p, range(128))[1] for p in range(16, 31)} == {"tree"}
    for c in (one, many):
        ring = c.collective_s("all_reduce", large, range(c.gpus), algo="ring")[0]
        tree = c.collective_s("all_reduce", large, range(c.gpus), algo="tree")[0]
        assert c.collective_s("all_reduce", large, range(c.gpus))[0] == min(ring, tree)
    with pytest.raises(ValueError, match="ring or tree"):
        one.collective_s("all_reduce", small, range(8), algo="nvls")
