"""``accelerate launch`` starts the ranks; gpucourse runs in place and really goes distributed."""

from __future__ import annotations

import json
import subprocess

import pytest

from gpucourse import TrainConfig, run
from procs import BIN, clean_env, free_port

pytestmark = pytest.mark.timeout(300)


def test_accelerate_launch_runs_in_place_and_equals_dp2(tmp_path):
    config = tmp_path / "accelerate.yaml"
    # On CPU, Accelerate needs distributed_type MULTI_CPU to start more than one process.
    config.write_text(f"""compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
num_processes: 2
num_machines: 1
machine_rank: 0
main_process_ip: 127.0.0.1
main_process_port: {free_port()}
use_cpu: true
mixed_precision: 'no'
""")
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [str(BIN / "accelerate"), "launch", "--config_file", str(config), "-m", "gpucourse", "train", "--dp", "2",
         "--impl", "accelerate", "--steps", "5", "--seq-len", "32", "--json", str(out), "--quiet"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("layout") == 1, "only rank 0 prints the summary"
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["extras"]["accelerate"]["num_processes"] == 2
    ref = run(TrainConfig(dp=2, steps=5, seq_len=32), timeout=120, quiet=True)
    for a, b in zip(result["losses"], ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
