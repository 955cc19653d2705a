"""The suite's /dev/shm sweep: a segment a killed process left is removed; one still held,
or one that was there before the suite, is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory

from tests import shm_segments

# The child's resource tracker would unlink the segment when the child dies; vLLM's (killed
# with its process group) does not, so the child stops tracking it, as vLLM's stop leaves it.
MAKE_AND_HANG = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(seg._name, "shared_memory")
print(seg.name, flush=True)
time.sleep(60)
"""


def test_a_killed_creators_segment_is_swept_and_a_held_one_is_not() -> None:
    before = shm_segments.names()
    held = shared_memory.SharedMemory(create=True, size=1 << 16)
    child = subprocess.Popen(
        [sys.executable, "-c", MAKE_AND_HANG], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        left = child.stdout.readline().strip()
        assert left.startswith(shm_segments.PREFIX)
        assert left not in {p.name for p in shm_segments.orphaned(before)}  # its maker holds it
        os.kill(child.pid, signal.SIGKILL)  # as a signal stops vLLM: no unlink
        child.wait(10)
        assert (shm_segments.SHM / left).exists()
        orphans = {p.name for p in shm_segments.orphaned(before)}
        assert left in orphans and held.name not in orphans
        count, size = shm_segments.sweep(before)
        assert count >= 1 and size >= 1 << 20
        assert not (shm_segments.SHM / left).exists()
        assert (shm_segments.SHM / held.name).exists()
    finally:
        child.kill()
        held.close()
        held.unlink()
