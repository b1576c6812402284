"""Real `torchrun --nproc_per_node 2` (gloo, CPU) over uneven shards whose rank shares differ (20
and 22 samples: 5 and 6 batches of 4): in each of three training epochs the two ranks see disjoint
samples, together every sample once, and the same number of batches (they all-reduce per batch),
the larger share's; an evaluation pass reads each rank's own share whole."""
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
    manifest, source = write_shards(tmp_path / "shards", [20, 3, 13, 6])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name("dist_stream_worker.py")), manifest, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = sorted(hashlib.sha1(px.tobytes()).hexdigest() for _, px in source.values())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == {"train1", "train2", "train3", "eval"}
    for part in ranks[0]:
        a, b = (r[part] for r in ranks)
        if part == "eval":  # each rank its own share: 5 and 6 batches
            assert a["batches"] == a["expected"] and b["batches"] == b["expected"]
            assert sorted([a["batches"], b["batches"]]) == [5, 6]
        else:
            assert a["batches"] == b["batches"] == a["expected"] == b["expected"] == 6, part
        assert not set(a["hashes"]) & set(b["hashes"]), part
        assert sorted(a["hashes"] + b["hashes"]) == want, part
