"""DeepSpeed's communication layer starts without its shared-memory op, so a stale build lock cannot hold it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import REPO


def test_a_stale_extension_lock_does_not_hold_deepspeeds_start(tmp_path):
    # The lock a process SIGKILLed inside DeepSpeed's JIT load leaves behind: every later start that
    # loads the op waits for it to go, forever.
    lock_dir = tmp_path / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "deepspeed_shm_comm"
    lock_dir.mkdir(parents=True)
    (lock_dir / "lock").touch()
    code = textwrap.dedent("""
        from lightning_bamboo.engine.construct import skip_shm_op
        skip_shm_op()
        from deepspeed.comm.torch import build_shm_op
        assert build_shm_op() is None
        print("started")
    """)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-2000:]
    assert (lock_dir / "lock").exists() and not (lock_dir / "deepspeed_shm_comm.so").exists()  # never touched
