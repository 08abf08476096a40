"""The GPUs learners have, tested from their descriptions (no GPU needed): what the launcher decides on each, in one
pinned line; how a description is built from NVML, nvidia-smi or torch without starting CUDA here; the NCCL settings;
the README's table against NVIDIA's datasheets; and, with one faked GPU, a 2-rank layout falling back to CPU ranks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import types
from dataclasses import replace

import pytest
import torch

import rankfns
from gpucourse.parallel import check
from gpucourse import TrainConfig, launch, platforms, train
from gpucourse.course import doctor
from gpucourse.runtime import LaunchError, devices, launcher, notebook_device, plan_device, visible_gpus
from gpucourse.runtime.devices import FAKE_ENV, GPU, PLATFORMS, DescriptionError, DeviceSet
from procs import REPO

pytestmark = pytest.mark.timeout(60)

MiB, GiB = 2**20, 2**30
IS_AVAILABLE = torch.cuda.is_available


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """Describing GPUs must never start CUDA in this process: every call that would, fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("CUDA was touched in the launching process")

    for name in ("init", "is_available", "get_device_properties", "get_device_name", "is_bf16_supported"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    yield
    assert not torch.cuda.is_initialized()


def with_p2p(name: str) -> DeviceSet:
    return replace(PLATFORMS[name].devices, p2p=True)


# --- one line per platform --------------------------------------------------------------------------------------

T4 = "Tesla T4 (cc 7.5, 15.0 GiB, no native bf16 or fp8)"
MIG = "MIG 1g.10gb slice of NVIDIA A100-SXM4-80GB (cc 8.0, 9.5 GiB, native bf16, no fp8)"
CPU_RANKS = ": ranks are CPU processes ('virtual GPUs')"
MIG_WHY = "and MIG gives one CUDA rank (NCCL refuses two ranks on one GPU, 'Duplicate GPU detected', and MIG slices " \
          "have no P2P)"

LINES = [
    ("colab-t4", 1, "cuda (nccl): " + T4 + ", one per rank"),
    ("colab-t4", 2, f"cpu (gloo): only 1 GPU is visible, {T4}{CPU_RANKS}"),
    ("kaggle-2xt4", 2, f"cuda (nccl): 2 × {T4} over PCIe, P2P off, one per rank"),
    ("kaggle-2xt4 with P2P", 2, f"cuda (nccl): 2 × {T4} over PCIe, P2P on, one per rank"),
    ("kaggle-2xt4", 4, f"cpu (gloo): only 2 GPUs are visible, 2 × {T4} over PCIe, P2P off{CPU_RANKS}"),
    ("desktop-2xrtx4090", 2, "cuda (nccl): 2 × NVIDIA GeForce RTX 4090 (cc 8.9, 24.0 GiB, native bf16 and fp8) over "
                             "PCIe, P2P off, one per rank"),
    ("mig-a100-1g.10gb", 1, f"cuda (nccl): {MIG}, one rank"),
    ("mig-a100-1g.10gb", 2, f"cpu (gloo): {MIG} is visible, {MIG_WHY}{CPU_RANKS}"),
    ("cloud-l4", 1, "cuda (nccl): NVIDIA L4 (cc 8.9, 22.5 GiB, native bf16 and fp8), one per rank"),
    ("cloud-8xa100", 8, "cuda (nccl): 8 × NVIDIA A100-SXM4-80GB (cc 8.0, 80.0 GiB, native bf16, no fp8) over NVLink, "
                        "P2P on, one per rank"),
    ("cloud-8xh100", 8, "cuda (nccl): 8 × NVIDIA H100 80GB HBM3 (cc 9.0, 79.6 GiB, native bf16 and fp8) over NVLink, "
                        "P2P on, one per rank"),
]
# The NCCL settings each sets, and its mixed precision.
SETTINGS = {"kaggle-2xt4": ["NCCL_P2P_DISABLE=1"], "desktop-2xrtx4090": ["NCCL_P2P_DISABLE=1"]}
FP16 = {"colab-t4", "kaggle-2xt4"}


@pytest.mark.parametrize("name, world_size, line", LINES, ids=[f"{n}-{w}" for n, w, _ in LINES])
def test_the_one_line_each_platform_prints(name, world_size, line):
    found = with_p2p("kaggle-2xt4") if name.endswith("with P2P") else PLATFORMS[name].devices
    plan = plan_device("auto", world_size, found)
    assert f"{plan.device} ({plan.backend}): {plan.reason}" == line
    assert [f"{k}={v}" for k, v, _ in plan.nccl_env] == (SETTINGS.get(name, []) if plan.device == "cuda" else [])


@pytest.mark.parametrize("name", PLATFORMS)
def test_each_platform_decides_ranks_precision_and_nccl(name):
    found = PLATFORMS[name].devices
    assert found.cuda_ranks == (1 if found.mig else len(found.gpus))
    assert devices.mixed_precision(found)[0] == ("fp16" if name in FP16 else "bf16")
    assert [f"{k}={v}" for k, v, _ in devices.nccl_settings(found)] == SETTINGS.get(name, [])
    advice = platforms.course_advice(found)
    assert advice[0].startswith(f"{found.describe()}: a MIG slice holds one CUDA rank" if found.mig
                                else f"{len(found.gpus)} GPU")
    assert any(s.startswith(f"Mixed precision here: {devices.mixed_precision(found)[0]}, ") for s in advice)
    assert "the largest course model that fits is gpt2-medium" in advice[-1]


def test_cuda_with_more_ranks_than_gpus_is_refused_in_one_sentence_offering_cpu_ranks():
    with pytest.raises(LaunchError) as info:
        plan_device("cuda", 2, PLATFORMS["colab-t4"].devices)
    assert str(info.value) == (f"device='cuda' needs 2 GPUs for 2 ranks but only 1 GPU is visible, {T4}; use "
                               f"device='auto' to fall back to gloo on CPU processes.")
    with pytest.raises(LaunchError) as info:
        plan_device("cuda", 2, PLATFORMS["mig-a100-1g.10gb"].devices)
    assert str(info.value) == (f"device='cuda' needs 2 GPUs for 2 ranks but {MIG} is visible, {MIG_WHY}; use "
                               f"device='auto' to fall back to gloo on CPU processes.")
    assert plan_device("cpu", 2, PLATFORMS["cloud-8xh100"].devices).reason == f"device='cpu' asked for{CPU_RANKS}"


def test_mixed_precision_is_bf16_only_where_native_else_fp16_with_the_loss_scaler():
    t4, l4 = PLATFORMS["colab-t4"].devices, PLATFORMS["cloud-l4"].devices
    assert devices.mixed_precision(t4) == ("fp16", "with the dynamic loss scaler: Tesla T4 (cc 7.5) has no native bf16 "
                                                   "(it needs cc 8.0), so bf16 would run emulated, slower")
    assert devices.mixed_precision(l4)[0] == "bf16"
    mixed = DeviceSet(l4.gpus + t4.gpus, "pcie", True)  # the slowest card decides
    assert devices.mixed_precision(mixed)[0] == "fp16"
    assert devices.precision_note(t4, "bf16") == (
        "precision='bf16' runs emulated, slower, on Tesla T4 (cc 7.5), which has no native bf16 (it needs cc 8.0); "
        "precision='fp16' uses its tensor cores, with the dynamic loss scaler.")
    assert devices.precision_note(t4, "fp16") is None and devices.precision_note(l4, "bf16") is None


def test_a_bf16_run_on_a_t4_is_told_once_that_fp16_is_native_there(monkeypatch, capsys):
    class Launched(Exception):
        pass

    def launched(*args, **kwargs):
        raise Launched

    monkeypatch.setenv(FAKE_ENV, "colab-t4")
    monkeypatch.setattr(train, "launch", launched)  # the note comes before any rank starts
    monkeypatch.setattr(train, "_said", set())
    for precision in ("bf16", "bf16", "fp16"):
        with pytest.raises(Launched):
            train.run(TrainConfig(precision=precision))
    out = capsys.readouterr().out
    assert out == f"gpucourse: {devices.precision_note(PLATFORMS['colab-t4'].devices, 'bf16')}\n"


MEDIUM = dict(model="gpt2-medium", seq_len=1024, batch_size=16)


def test_a_run_too_big_for_the_smallest_gpu_is_told_the_microbatch_that_fits(monkeypatch, capsys):
    t4, mig = PLATFORMS["colab-t4"].devices, PLATFORMS["mig-a100-1g.10gb"].devices
    assert platforms.memory_note(TrainConfig(), t4) is None                    # the tiny model fits anywhere
    assert platforms.memory_note(TrainConfig(**MEDIUM), PLATFORMS["cloud-8xh100"].devices) is None
    assert platforms.memory_note(TrainConfig(**MEDIUM), t4) == (
        "by the memory estimate this run's busiest rank needs 33.28 GiB, more than the 13 GiB a run can use on each "
        "Tesla T4; 4 sequences a microbatch fit: batch_size=4, or grad_accum=4 to keep the batch of 16.")
    assert platforms.memory_note(TrainConfig(**MEDIUM, pp=2, microbatches=4), mig).endswith(
        "on each MIG 1g.10gb slice of NVIDIA A100-SXM4-80GB; 2 sequences a microbatch fit: batch_size=8, or "
        "microbatches=8 to keep the batch of 16.")
    assert platforms.memory_note(TrainConfig(**MEDIUM), mig).endswith(
        "not even one sequence a microbatch fits: a smaller model or seq_len, or more ranks (zero, tp, pp).")
    # The advice holds: the microbatch it names is the largest the estimate fits.
    from gpucourse.modeled import memory

    budget = platforms.run_budget(t4)[0]
    assert memory.estimate(TrainConfig(**{**MEDIUM, "batch_size": 4}))["max_total"] <= budget
    assert memory.estimate(TrainConfig(**{**MEDIUM, "batch_size": 5}))["max_total"] > budget

    class Launched(Exception):
        pass

    def launched(*args, **kwargs):
        raise Launched

    monkeypatch.setenv(FAKE_ENV, "colab-t4")  # said before the run starts on the T4 (here: its stand-in), once
    monkeypatch.setattr(train, "launch", launched)
    monkeypatch.setattr(train, "_said", set())
    for _ in range(2):
        with pytest.raises(Launched):
            train.run(TrainConfig(**MEDIUM))
    assert capsys.readouterr().out == f"gpucourse: {platforms.memory_note(TrainConfig(**MEDIUM), t4)}\n"


def test_the_batch_size_search_takes_the_smallest_gpus_memory_unless_told(monkeypatch, capsys):
    from gpucourse import cli

    monkeypatch.setenv(FAKE_ENV, "colab-t4")
    assert cli.main(["batch-size", "--model", "gpt2-medium", "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("budget: 13 GiB, what a run can use on each Tesla T4 (--budget-gb to choose)\n"
                          "largest microbatch: 4 sequences of 1024 tokens per forward on each rank (estimated"), out
    monkeypatch.delenv(FAKE_ENV)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli.main(["batch-size", "--model", "gpt2-medium"]) == 2
    assert capsys.readouterr().err == ("gpucourse: error: no GPU with a known memory is visible here: give the memory "
                                       "per rank, --budget-gb N.\n")


def test_nccl_p2p_is_disabled_only_where_p2p_does_not_work():
    rtx = PLATFORMS["desktop-2xrtx4090"].devices
    assert devices.nccl_settings(replace(rtx, p2p=None))[0][:2] == ("NCCL_P2P_DISABLE", "1")  # GeForce, not asked
    assert devices.nccl_settings(replace(rtx, p2p=True)) == ()
    assert devices.nccl_settings(with_p2p("kaggle-2xt4")) == ()
    assert devices.nccl_settings(PLATFORMS["colab-t4"].devices) == ()  # one GPU: nothing to reach


def test_nccl_settings_are_set_for_the_ranks_printed_once_and_never_over_the_users(capsys, monkeypatch):
    plan = plan_device("auto", 2, PLATFORMS["kaggle-2xt4"].devices)
    monkeypatch.setattr(launcher, "_told", set())
    for _ in range(2):
        with launcher._nccl_environment(plan, quiet=False):
            assert launcher.os.environ["NCCL_P2P_DISABLE"] == "1"
        assert "NCCL_P2P_DISABLE" not in launcher.os.environ
    assert capsys.readouterr().out == (
        "gpucourse: NCCL_P2P_DISABLE=1 for these ranks: these GPUs cannot reach each other's memory directly (no "
        "P2P), so NCCL copies through host memory (set NCCL_P2P_DISABLE yourself to choose otherwise).\n")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    monkeypatch.setattr(launcher, "_told", set())
    with launcher._nccl_environment(plan, quiet=False):
        assert launcher.os.environ["NCCL_P2P_DISABLE"] == "0"
    assert launcher.os.environ["NCCL_P2P_DISABLE"] == "0" and capsys.readouterr().out == ""


# --- the platforms against NVIDIA's datasheets, and the README's table ------------------------------------------

# Datasheet facts: compute capability and memory (GB) of each card (a MIG slice: its profile's memory).
SPEC = {"Tesla T4": ((7, 5), {16}), "NVIDIA L4": ((8, 9), {24}), "NVIDIA A10": ((8, 6), {24}),
        "NVIDIA A100-SXM4-80GB": ((8, 0), {40, 80}), "NVIDIA H100 80GB HBM3": ((9, 0), {80}),
        "NVIDIA GeForce RTX 4090": ((8, 9), {24}), "NVIDIA GeForce RTX 3090": ((8, 6), {24})}


@pytest.mark.parametrize("name", PLATFORMS)
def test_platforms_agree_with_the_datasheets(name):
    platform = PLATFORMS[name]
    for gpu in platform.devices.gpus:
        cc, sizes = SPEC[gpu.name]
        assert gpu.capability == cc
        assert gpu.bf16 == (cc >= (8, 0)) and gpu.fp8 == (cc >= (8, 9))
        if gpu.mig:
            assert gpu.mig == f"1g.{platform.datasheet_gb}gb" and "80" in gpu.name  # 1g.10gb: an eighth of 80 GB
        else:
            assert platform.datasheet_gb in sizes
        # What CUDA sees: the datasheet's GiB less ECC's sixteenth (GDDR) or the driver's share, never more.
        assert 0.9 <= gpu.memory_bytes / (platform.datasheet_gb * GiB) <= 1.0


def test_the_readme_table_is_computed_from_the_platforms():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Which GPU you have"):]
    section = section[:section.index("\n#")]
    assert platforms.readme_table() in section
    assert "gpucourse doctor" in section and f"{FAKE_ENV}=" in section
    row = {line.split(" | ")[0]: line for line in platforms.readme_table().splitlines()}
    assert row["| Colab (free) (`colab-t4`)"] == ("| Colab (free) (`colab-t4`) | 1 × T4, 16 GB | 7.5 | no / no | 1 | "
                                                 "fp16 + loss scaler | — | gpt2-medium (5 × 1024 tokens) |")
    assert "| 1 (MIG) |" in row["| MIG seat (A100) (`mig-a100-1g.10gb`)"]
    assert "`NCCL_P2P_DISABLE=1`" in row["| Kaggle, 2 × T4 (`kaggle-2xt4`)"]


# --- descriptions: from data, and from this machine without starting CUDA ----------------------------------------

@pytest.mark.parametrize("name", PLATFORMS)
def test_a_description_survives_json(name):
    found = PLATFORMS[name].devices
    assert devices.from_dict(json.loads(json.dumps(found.to_dict()))) == found


@pytest.mark.parametrize("data, says", [
    ([], "a GPU description is an object with a list of gpus, not list."),
    ({"gpu": []}, "has unknown key gpu; the keys are gpus, link and p2p."),
    ({"gpus": [{"name": "T4", "capability": "7"}]}, "gpus[0].capability='7' must look like \"8.0\" (major.minor)."),
    ({"gpus": [{"capability": "7.5"}]}, "gpus[0] needs a name, such as \"Tesla T4\"."),
    ({"gpus": [{"name": "T4", "memory_gib": -1}]}, "the memory must be a positive number of bytes"),
    ({"gpus": [], "link": "infiniband"}, "link='infiniband' must be \"nvlink\", \"pcie\" or null."),
    ({"gpus": [{"name": "T4", "bf16": "yes"}]}, "gpus[0].bf16='yes' must be true, false or left out."),
])
def test_bad_descriptions_get_one_sentence(data, says):
    with pytest.raises(DescriptionError) as info:
        devices.from_dict(data, "desc.json")
    assert says in str(info.value) and str(info.value).count(". ") == 0


def test_the_fake_names_a_platform_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "kaggle-2xt4")
    assert devices.visible().gpus == PLATFORMS["kaggle-2xt4"].devices.gpus and visible_gpus() == 2
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"gpus": [{"name": "Tesla T4", "capability": "7.5", "memory_gib": 15}]}))
    monkeypatch.setenv(FAKE_ENV, str(path))
    assert devices.visible().gpus == (GPU("Tesla T4", (7, 5), 15 * GiB),) and visible_gpus() == 1
    monkeypatch.setenv(FAKE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(DescriptionError, match="is neither a JSON file nor a platform"):
        devices.visible()


def fake_smi(tmp_path, monkeypatch, query: str, listing: str = "", reads: str = "", nvlinks: str = ""):
    """A fake nvidia-smi on PATH that answers --query-gpu, -L and topo -p2p r / n with the text given."""
    parts = {"--query-gpu=*": query, "-L": listing, '"topo -p2p r"': reads, '"topo -p2p n"': nvlinks}
    cases = "".join(f"{pattern}) cat <<'EOF'\n{textwrap.dedent(text).strip()}\nEOF\n;;\n"
                    for pattern, text in parts.items() if text)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}*) exit 1 ;;\nesac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{launcher.os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML bindings: nvidia-smi answers


def test_nvidia_smi_describes_gpus_links_and_p2p(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, """\
        0, GPU-aaaa, NVIDIA GeForce RTX 4090, 24564, 550.54, 8.9, [N/A]
        1, GPU-bbbb, NVIDIA GeForce RTX 4090, 24564, 550.54, 8.9, [N/A]""",
             reads=" \tGPU0\tGPU1\n GPU0\tX\tCNS\n GPU1\tCNS\tX\n\nLegend:\n  X = Self\n  CNS = Chipset not supported",
             nvlinks=" \tGPU0\tGPU1\n GPU0\tX\tNS\n GPU1\tNS\tX")
    found = devices._describe(None, 2)
    assert found == replace(PLATFORMS["desktop-2xrtx4090"].devices, source="nvidia-smi")
    assert devices._describe("1", 1).gpus == found.gpus[1:]  # CUDA_VISIBLE_DEVICES picks and renumbers


def test_nvidia_smi_finds_mig_slices(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, 81920, 550.54, 8.0, Enabled", """\
        GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa)
          MIG 1g.10gb     Device  0: (UUID: MIG-1111)
          MIG 1g.10gb     Device  1: (UUID: MIG-2222)""")
    found = devices._describe("MIG-2222", None)
    assert found.gpus == (GPU("NVIDIA A100-SXM4-80GB", (8, 0), 10 * GiB, "1g.10gb"),) and found.cuda_ranks == 1
    assert len(devices._describe(None, 1).gpus) == 2 and devices._describe(None, 1).cuda_ranks == 1


def fake_nvml(gpus: list[dict], p2p: int = 0, nvlink: int = 0):
    """A stand-in for the pynvml module: ``gpus`` as dicts (name, cc, memory, uuid, mig: list of (profile, uuid))."""
    class NVMLError(Exception):
        pass

    handles = {}

    def handle(i):
        return handles.setdefault(i, ("gpu", i))

    def get(h, key):
        if h[0] == "mig":
            gpu, j = gpus[h[1]], h[2]
            return {"name": f"{gpu['name']} MIG {gpu['mig'][j][0]}", "uuid": gpu["mig"][j][1],
                    "memory": 9728 * MiB}[key]
        return gpus[h[1]][key]

    def mig_handle(h, j):
        if j >= len(gpus[h[1]].get("mig", [])):
            raise NVMLError("not found")
        return ("mig", h[1], j)

    status = {0: p2p, 2: nvlink}
    return types.SimpleNamespace(
        NVMLError=NVMLError, NVML_DEVICE_MIG_ENABLE=1, NVML_P2P_STATUS_OK=0,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=handle, nvmlDeviceGetName=lambda h: get(h, "name").encode(),
        nvmlDeviceGetUUID=lambda h: get(h, "uuid"), nvmlDeviceGetCudaComputeCapability=lambda h: gpus[h[1]]["cc"],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=get(h, "memory")),
        nvmlDeviceGetMigMode=lambda h: (1 if gpus[h[1]].get("mig") else 0, 0),
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7, nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetP2PStatus=lambda a, b, index: status[index])


def test_nvml_describes_an_nvlink_server_and_a_mig_seat(monkeypatch):
    h100 = {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0), "memory": 81559 * MiB}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([{**h100, "uuid": f"GPU-{i}"} for i in range(8)]))
    assert devices._describe(None, 8) == replace(PLATFORMS["cloud-8xh100"].devices, source="NVML")
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([{**h100, "uuid": "GPU-0"}] * 2, p2p=5, nvlink=5))
    assert devices._describe(None, 2).describe().endswith("over PCIe, P2P off")
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "cc": (8, 0), "memory": 81920 * MiB, "uuid": "GPU-0",
            "mig": [("1g.10gb", "MIG-1111")]}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([a100]))
    assert devices._describe("MIG-1111", None) == replace(PLATFORMS["mig-a100-1g.10gb"].devices, source="NVML")


def test_torch_answers_in_a_child_process_when_nvml_and_nvidia_smi_cannot(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", "/nonexistent")
    asked = []

    def child(argv, **kwargs):
        asked.append(argv)
        assert argv[0] == sys.executable and "is_bf16_supported(including_emulation=False)" in argv[2]
        out = {"gpus": [{"name": "Tesla T4", "capability": [7, 5], "memory_bytes": 15360 * MiB, "bf16": False}] * 2,
               "p2p": False}
        return subprocess.CompletedProcess(argv, 0, json.dumps(out) + "\n", "")

    monkeypatch.setattr(devices.subprocess, "run", child)
    found = devices._describe(None, 2)
    assert found.gpus == PLATFORMS["kaggle-2xt4"].devices.gpus and found.p2p is False and len(asked) == 1


def test_the_doctor_says_what_follows_on_a_mig_seat(monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "mig-a100-1g.10gb")
    info = doctor.collect()
    assert info["devices"]["mig"] and info["gpus"][0]["mig"] == "1g.10gb" and info["gpus"][0]["capability"] == "8.0"
    assert info["advice"][0].startswith(f"{MIG}: a MIG slice holds one CUDA rank, so 1-rank runs use it")
    text = doctor.format_text(info)
    assert re.search(rf"cuda:0 +{re.escape(MIG)}\n", text) and re.search(r"\n +MIG +on: a process sees one slice", text)
    assert "Mixed precision here: bf16" in text and re.search(rf"described by +{FAKE_ENV}=mig-a100-1g.10gb", text)


# --- the notebooks: one faked GPU, and no CUDA in the kernel -----------------------------------------------------

@pytest.mark.usefixtures("no_leftover_children")
def test_with_one_faked_gpu_a_two_rank_layout_runs_on_cpu_ranks_and_says_so(tmp_path, monkeypatch, capfd):
    path = tmp_path / "one-gpu.json"
    path.write_text(json.dumps(PLATFORMS["colab-t4"].devices.to_dict()))
    monkeypatch.setenv(FAKE_ENV, str(path))
    # torch's LaunchConfig asks this, through NVML (the launcher sets PYTORCH_NVML_BASED_CUDA_CHECK for it).
    monkeypatch.setattr(torch.cuda, "is_available", IS_AVAILABLE)
    one = plan_device("auto", 1)  # the T4's rank, on a CPU process that stands in for it
    assert (one.device, one.stand_in) == ("cpu", True)
    assert one.reason == f"{T4}, one per rank, as {FAKE_ENV}={path} describes; CPU processes stand in for it"
    for world_size in (2, 4, 8):
        assert not plan_device("auto", world_size).stand_in and plan_device("auto", world_size).device == "cpu"
    values = launch(rankfns.whoami, world_size=2, timeout=60)
    assert [v[:2] for v in values] == [(0, 2), (1, 2)]
    assert f"gpucourse: 2 ranks on cpu (gloo): only 1 GPU is visible, {T4}{CPU_RANKS}." in capfd.readouterr().out
    assert launch(rankfns.whoami, world_size=1, timeout=60)[0][:2] == (0, 1)
    assert "CPU processes stand in for it." in capfd.readouterr().out


@pytest.mark.parametrize("platform, largest, says", [
    ("colab-t4", 4, "1 GPU for runs of up to 4 ranks"),
    ("colab-t4", 2, "1 GPU for runs of up to 2 ranks"),
    ("kaggle-2xt4", 2, None),                        # a GPU for each rank: the runs use them
    ("kaggle-2xt4", 4, "2 GPUs for runs of up to 4 ranks"),
    ("mig-h100-1g.10gb", 2, "one MIG slice for runs of up to 2 ranks"),
    ("cloud-8xh100", 4, None),
    (None, 4, None),                                 # no GPU: every run on CPU processes anyway
])
def test_a_notebook_runs_everything_on_cpu_ranks_where_its_largest_run_lacks_gpus_and_says_so(
        monkeypatch, capsys, platform, largest, says):
    if platform:
        monkeypatch.setenv(FAKE_ENV, platform)
    else:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert notebook_device(largest) == ("cpu" if says else "auto")
    assert capsys.readouterr().out == (f"gpucourse: {says}: all run on CPU processes, to compare like with like.\n"
                                       if says else "")


CUDA_CALL = re.compile(r"torch\.cuda\.(?!nvtx\b)\w+|\.cuda\(\)")


def test_no_notebook_initialises_cuda_in_its_kernel():
    """A kernel that touched CUDA could no longer fork ranks that use it: only ranks may, in the files a cell
    writes for them (%%writefile) and in the package."""
    assert CUDA_CALL.findall("free = torch.cuda.mem_get_info(); x.cuda()") == ["torch.cuda.mem_get_info", ".cuda()"]
    found = []
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and not source.startswith("%%writefile"):
                found += [f"{path.name} cell {index}: {hit}" for hit in CUDA_CALL.findall(source)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("platform, layout, want", [
    ("colab-t4", {}, "fp16"),                       # no native bf16: fp16 with the loss scaler
    ("colab-t4", {"dp": 2}, "bf16"),                # two ranks on one T4 fall back to CPU ranks: bf16 autocast
    ("cloud-l4", {}, "bf16"),
    ("kaggle-2xt4", {"dp": 2}, "fp16"),
    ("mig-a100-1g.10gb", {}, "bf16"),
    ("cloud-8xh100", {"device": "cpu"}, "bf16"),    # CPU ranks asked for
])
def test_precision_auto_is_the_native_half_precision_of_the_ranks(monkeypatch, platform, layout, want):
    from gpucourse.config import TrainConfig

    monkeypatch.setenv(devices.FAKE_ENV, platform)
    cfg = TrainConfig(precision="auto", **layout)
    assert cfg.precision == "auto", "a config is data: it asks nothing of the machine"
    cfg = platforms.resolve(cfg)
    assert cfg.precision == want and check(cfg) is not None
