"""The doctor reports this machine without touching CUDA, and the Makefile's
torch choice picks a local CPU wheel when pip's find-links holds one."""

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpucourse.course import doctor

REPO = Path(__file__).resolve().parents[1]
TORCH_REQUIREMENT = REPO / "scripts" / "torch-requirement"

TYPES = {
    "python": str,
    "platform": str,
    "torch_version": str,
    "cuda_available": bool,
    "gpu_count": int,
    "gpus": list,
    "nccl_available": bool,
    "gloo_available": bool,
    "mpi_available": bool,
    "default_device": str,
    "cpu_count": int,
    "start_method": str,
    "versions": dict,
    "env": dict,
    "advice": list,
}


def test_collect_has_the_keys_and_types():
    info = doctor.collect()
    for key, kind in TYPES.items():
        assert isinstance(info[key], kind), key
    assert info["cuda_version"] is None or isinstance(info["cuda_version"], str)
    assert info["gpu_count"] == len(info["gpus"])
    assert info["default_device"] == ("cuda" if info["gpu_count"] else "cpu")
    assert set(info["versions"]) == {"jupyterlab", "ipywidgets", "plotly", "accelerate", "nbclient"}
    assert set(doctor.ENV_VARS) <= set(info["env"]) <= set(doctor.ENV_VARS) | set(doctor.ENV_VARS_WHEN_SET)
    assert info["advice"] and all(isinstance(sentence, str) for sentence in info["advice"])


def test_collect_is_json_serialisable():
    info = doctor.collect()
    assert json.loads(json.dumps(info)) == info


def test_collect_reads_env_and_versions(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")   # shown only when set
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    info = doctor.collect()
    assert info["env"]["NCCL_DEBUG"] == "INFO"
    assert info["env"]["TORCH_DISTRIBUTED_DEBUG"] is None
    assert info["env"]["NCCL_P2P_DISABLE"] == "1" and "NCCL_IB_DISABLE" not in info["env"]
    assert "NCCL_P2P_DISABLE" in doctor.format_text(info)
    assert info["versions"]["jupyterlab"]  # installed by the package's dependencies


def test_collect_does_not_initialise_cuda(monkeypatch):
    # These all initialise CUDA (or the CUDA driver); the doctor must not call them.
    def forbidden(*args, **kwargs):
        raise AssertionError("doctor touched CUDA")

    for name in ("init", "is_available", "get_device_properties", "get_device_name", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    doctor.collect()
    assert not torch.cuda.is_initialized()


def test_format_text_mentions_device_and_advice():
    info = doctor.collect()
    text = doctor.format_text(info)
    assert info["default_device"] in text
    assert info["torch_version"] in text
    for sentence in info["advice"]:
        assert sentence in text


def test_cpu_only_advice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    info = doctor.collect()
    assert info["default_device"] == "cpu"
    assert not info["cuda_available"]
    assert "No GPU is visible" in info["advice"][0]
    assert "gloo" in info["advice"][0]


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """Pretend to be a CUDA build on a box with three GPUs: a fake nvidia-smi on
    PATH and torch reporting the GPU count CUDA_VISIBLE_DEVICES leaves."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(textwrap.dedent("""\
        #!/bin/sh
        case "$*" in
        --query-gpu=*)
            echo "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559, 550.54, 9.0, Disabled"
            echo "1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559, 550.54, 9.0, Disabled"
            echo "2, GPU-cccc, NVIDIA A10, 23028, 550.54, 8.6, [N/A]" ;;
        "topo -p2p r")
            printf " \\tGPU0\\tGPU1\\tGPU2\\n GPU0\\tX\\tOK\\tCNS\\n GPU1\\tOK\\tX\\tCNS\\n GPU2\\tCNS\\tCNS\\tX\\n" ;;
        "topo -p2p n")
            printf " \\tGPU0\\tGPU1\\tGPU2\\n GPU0\\tX\\tOK\\tNS\\n GPU1\\tOK\\tX\\tNS\\n GPU2\\tNS\\tNS\\tX\\n" ;;
        *) exit 1 ;;
        esac
        """))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(
        torch.cuda, "device_count",
        lambda: len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) if "CUDA_VISIBLE_DEVICES" in os.environ else 3,
    )
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)


def test_gpus_come_from_nvidia_smi(fake_gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = doctor.collect()
    assert info["default_device"] == "cuda"
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_gb": 79.6, "capability": "9.0", "bf16": True, "fp8": True,
            "mig": None}
    assert info["gpus"] == [
        {"index": 0, **h100},
        {"index": 1, **h100},
        {"index": 2, "name": "NVIDIA A10", "memory_gb": 22.5, "capability": "8.6", "bf16": True, "fp8": False,
         "mig": None},
    ]
    assert info["devices"]["link"] == "pcie" and info["devices"]["p2p"] is False  # the A10 reaches neither H100
    assert info["driver_version"] == "550.54"
    assert "up to 3 ranks run on NCCL" in info["advice"][0]
    assert any(sentence.startswith("NCCL_P2P_DISABLE=1 is set") for sentence in info["advice"])
    text = doctor.format_text(info)
    assert "cuda:2" in text and "NVIDIA A10 (cc 8.6, 22.5 GiB, native bf16, no fp8)" in text
    assert "over PCIe, P2P off" in text and "described by" in text
    assert not torch.cuda.is_initialized()


def test_cuda_visible_devices_picks_and_renumbers_gpus(fake_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-aa")
    info = doctor.collect()
    assert [(gpu["index"], gpu["name"]) for gpu in info["gpus"]] == [
        (0, "NVIDIA A10"), (1, "NVIDIA H100 80GB HBM3"),
    ]
    assert any("CUDA_VISIBLE_DEVICES='2,GPU-aa'" in sentence for sentence in info["advice"])


def test_cpu_build_on_a_gpu_machine_says_so(fake_gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    info = doctor.collect()
    assert info["gpus"] == []
    assert any("CPU-only build" in sentence for sentence in info["advice"])


def torch_requirement(tmp_path, find_links: str) -> str:
    """Run scripts/torch-requirement with only `find_links` configured."""
    env = {
        **os.environ,
        "PIP_FIND_LINKS": find_links,
        # os.devnull as the config file makes pip skip every config file.
        "PIP_CONFIG_FILE": os.devnull,
    }
    result = subprocess.run(
        [sys.executable, str(TORCH_REQUIREMENT)],
        env=env, cwd=tmp_path, capture_output=True, text=True, check=True, timeout=60,
    )
    return result.stdout.strip()


def wheel_name(version: str, tag: str) -> str:
    return f"torch-{version}-{tag}-{tag}-manylinux_2_28_{platform.machine().lower()}.whl"


def test_torch_requirement_picks_a_matching_local_wheel(tmp_path):
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in (
        wheel_name("2.13.0+cpu", tag),
        wheel_name("2.12.0+cpu", tag),
        wheel_name("2.14.0+cu128", tag),  # a CUDA build: not what we want
        wheel_name("2.14.0+cpu", "cp39"),  # another Python
    ):
        (wheels / name).touch()
    expected = str(wheels / wheel_name("2.13.0+cpu", tag))
    assert torch_requirement(tmp_path, str(wheels)) == expected
    assert torch_requirement(tmp_path, f"https://example.invalid/ file://{wheels}") == expected


def test_torch_requirement_falls_back_to_plain_torch(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert torch_requirement(tmp_path, str(empty)) == "torch"
    assert torch_requirement(tmp_path, "") == "torch"
