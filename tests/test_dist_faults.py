"""Two gloo ranks under real torchrun meet faults: uneven shards with one of random bytes train to
the end (skipped and counted, no hang), and a kill -9 of the launcher takes its ranks with it
(they used to train on, orphaned)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shardutil import write_shards

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def torchrun(out: Path, manifest: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "tools/pretrain.py", f"output_dir={out}", f"data.train={manifest}", "model=vit_micro4_32",
            "batch_size=8", f"steps={steps}", "data.num_workers=1", "train.attn=math", "train.log_every=2",
            "train.ckpt_every=2", "data.shuffle_buffer=8"]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # this checkout's mpp in the ranks


def test_uneven_shards_and_a_corrupt_one_finish_on_two_ranks(tmp_path):
    manifest, _ = write_shards(tmp_path / "data", [20, 3, 13, 6], classes=None)
    (tmp_path / "data/000002.tar").write_bytes(os.urandom(20_000))  # random bytes where 13 samples were
    done = subprocess.run(torchrun(tmp_path / "run", manifest, 6), cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert metrics["steps"] == 6 and sum(metrics["skipped_samples"].values()) > 0, metrics


def test_killing_the_launcher_ends_its_ranks(tmp_path):
    manifest, _ = write_shards(tmp_path / "data", [16, 16, 16, 16], classes=None)
    out = tmp_path / "run"
    launcher = subprocess.Popen(torchrun(out, manifest, 10_000), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (out / "checkpoints").is_dir() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    ranks = psutil.Process(launcher.pid).children(recursive=True)
    assert len(ranks) >= 2 and launcher.poll() is None
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=20)
    for p in alive:  # clean up before failing
        p.kill()
    assert not alive, f"{len(alive)} rank processes outlived their launcher"
