"""The quality gate's recall model, trained in the background from the suite's first moment.

Training takes 100-150 s of one core, once per machine (then a cache file). The tests that
need it run early and the suite's first minutes leave a core idle (sockets, process starts),
so the training starts in its own process when the session starts and the tests that need the
model wait for it (:func:`wait_for_recall_model`). A training that fails is not hidden: the
waiting test's own ``recall_model()`` call then trains in-process and raises what it raises.
"""

from __future__ import annotations

import subprocess
import sys

from kvtier.quality.model import RecallModelSpec, cache_dir

_TRAIN = (
    "import torch; torch.set_num_threads(1); "
    "from kvtier.quality import recall_model; recall_model()"
)
_training: subprocess.Popen[bytes] | None = None


def start_recall_training() -> None:
    """Start training the default recall model unless its cache file is there."""
    global _training
    if (cache_dir() / f"recall-{RecallModelSpec().digest()}.pt").exists():
        return
    _training = subprocess.Popen([sys.executable, "-c", _TRAIN], stdin=subprocess.DEVNULL)


def wait_for_recall_model() -> None:
    """Wait for the background training (if any) to have written the cache file."""
    global _training
    if _training is not None:
        _training.wait()
        _training = None


def stop_recall_training() -> None:
    """At the session's end: a training nobody waited for is ended, never left running."""
    global _training
    if _training is not None:
        _training.kill()
        _training.wait()
        _training = None
