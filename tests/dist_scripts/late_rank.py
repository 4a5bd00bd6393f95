"""Run under dtensor3d.launch.supervise (launch.sh's elastic agent) with 2 ranks and --max-restarts=1:

    python -m dtensor3d.launch.supervise --nproc_per_node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:PORT --max-restarts=1 tests/dist_scripts/late_rank.py

Attempt 0: both ranks form a gloo group and all-reduce, then rank 1 fails (status 1), so the
agent restarts the job. Attempt 1: rank 1 starts 5 s after rank 0, as a slow rank does on a
loaded machine. Each rank prints `attempt A rank R sum S`.

With a rendezvous store shared by both rounds (torch's default for c10d), rank 0 of attempt 1
reads rank 1's address of attempt 0 and gloo's connectFullMesh is refused; tests/training/test_faults.py
checks that under supervise.py both attempts complete.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(5)
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
os.write(1, f"attempt {attempt} rank {rank} sum {total.item():g}\n".encode())  # one write: lines not interleaved
dist.destroy_process_group()
if attempt == 0 and rank == 1:
    sys.exit(1)
