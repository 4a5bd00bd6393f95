"""A wrong input only rank 1 sees: it says its one line (errors.say) and exits 2, as
`python -m dtensor3d` does; rank 0 waits, as in a collective, until the agent stops it.
Each start appends a line to the file given, so a test can count attempts."""

import os
import signal
import sys
import time

from dtensor3d.errors import DataError, say

with open(sys.argv[1], "a", encoding="utf-8") as f:
    f.write(f"start rank {os.environ['RANK']}\n")
if os.environ["RANK"] == "1":
    say(DataError("data.path: shard 7 is unreadable (only rank 1 reads it)"))
    sys.exit(2)
# The supervisor starts its workers with SIGTERM blocked until the trainer's handler takes it
# (training/faults.py); take it as the trainer does, so the agent's SIGTERM ends this rank at once
# (else the agent waits its 30 s shutdown timeout and SIGKILLs it).
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
time.sleep(60)
