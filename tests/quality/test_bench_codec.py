"""``kvtier bench codec`` with its quality gate on: the gate's figures beside each lossy codec.

Here, not in tests/bench, because it needs the gate's trained recall model: tests/quality runs
late in the suite, by when the model trained in the background since the session started
(tests/recall_training.py), where tests/bench runs first and would wait for the training.
"""

from __future__ import annotations

from tests.bench.test_codec import run
from tests.recall_training import wait_for_recall_model


def test_the_quality_gates_figures_stand_beside_each_lossy_codec() -> None:
    """The real gate (its trained recall model, shared with tests/quality): fp8 and int8
    pass it at both dtypes; the lossless codec has nothing to gate."""
    wait_for_recall_model()
    result = run("--codec", "fp8", "--codec", "int8", "--codec", "lossless")
    for dtype in ("bf16", "fp32"):
        rows = result[dtype]["codecs"]
        assert rows["lossless"]["gate"] is None
        for name in ("fp8", "int8"):
            gate = rows[name]["gate"]
            assert gate["codec"] == name and gate["passed"] is True, gate
            assert gate["greedy_agreement"] >= 0.99
            assert gate["accuracy"] >= gate["recompute_accuracy"] - 0.01
