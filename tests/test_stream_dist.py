"""Real `torchrun --nproc_per_node 2` (gloo, CPU) over uneven shards: the two ranks see disjoint
samples, together every sample once, and the same number of batches (they all-reduce per batch)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardutil import write_shards


@pytest.mark.slow
def test_torchrun_two_ranks_split(tmp_path):
    manifest, source = write_shards(tmp_path / "shards", [9, 3, 14, 6, 11, 5, 8, 2])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("dist_stream_worker.py")), manifest, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = sorted(hashlib.sha1(px.tobytes()).hexdigest() for _, px in source.values())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for mode in ("train", "eval"):
        a, b = (r[mode] for r in ranks)
        assert a["batches"] == b["batches"] == a["expected"] == b["expected"]
        assert not set(a["hashes"]) & set(b["hashes"])
        assert sorted(a["hashes"] + b["hashes"]) == want
