"""tests/trl_dist_worker.py on two processes (torchrun, gloo on the CPU), for the TRL tests that check
what two ranks see against one process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _torchrun() -> str | None:
    local = Path(sys.executable).with_name("torchrun")
    return str(local) if local.exists() else shutil.which("torchrun")


def run_on_two_processes(*worker_args: str) -> None:
    """tests/trl_dist_worker.py on 2 processes (torchrun, gloo on the CPU); skips without torchrun."""
    torchrun = _torchrun()
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tests.trl_dist_worker", *worker_args]
    # its own session, so that a timeout ends torchrun and both workers (the worker exits on its own,
    # with every thread's stack, after 90 s)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-8000:]
