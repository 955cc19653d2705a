from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.quality import QualityGate, recall_model
from tests.recall_training import wait_for_recall_model


@pytest.fixture(scope="session")
def gate() -> Iterator[QualityGate]:
    """The gate on the default recall model: trained once per machine (100-150 s on one core,
    then loaded from the cache file), built once per session."""
    wait_for_recall_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the training shares a small box with other work
    try:
        yield QualityGate(recall_model())
    finally:
        torch.set_num_threads(threads)
