"""Same text, another image: another KV. A tiny Idefics3-style model on a real vLLM (CPU
build, fp32, its own prefix cache off so every repeat is kvtier's load).

The prompt is 300 words, an image (7 tokens, in chunk 1), 250 words: 557 tokens, two whole
chunks. Image 2 after image 1 may load only chunk 0 (text before the image, shared with a
text-only prompt as in vLLM); image 1 again loads both chunks; every output equals vLLM
without a connector. Then the same through the disk tier in a fresh vLLM (a restart), and
through ``kvtier server``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from benchmarks.harness.vision import IMAGE_SIZE, write_tiny_idefics3

from tests.server.server_helpers import ServerProcess

from .vllm_helpers import MAX_TOKENS, Instances, VllmInstance, unique_engine_id

pytestmark = pytest.mark.slow

CHUNK = 256
_rng = random.Random(5)
BEFORE = " ".join(f"w{_rng.randrange(0, 1000)}" for _ in range(300))
AFTER = " ".join(f"w{_rng.randrange(0, 1000)}" for _ in range(250))
ARGS: dict[str, Any] = {"limit_mm_per_prompt": {"image": 1}}


def image(name: str) -> Any:
    """Noise (seeded) or black: two pictures the tiny model answers differently about."""
    from PIL import Image

    if name == "black":
        return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    pixels = np.random.default_rng(1).integers(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    return Image.fromarray(pixels)


def run(instance: VllmInstance, picture: str | None) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request: dict[str, Any] = (
        {"prompt": f"{BEFORE} {AFTER}"}
        if picture is None
        else {"prompt": f"{BEFORE} <image> {AFTER}", "multi_modal_data": {"image": image(picture)}}
    )
    out = instance.llm.generate([request], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


@pytest.fixture(scope="module")
def expected(vlm_dir: Path, instances: Instances) -> dict[str | None, list[int]]:
    plain = instances.get("plain-vlm", lambda: VllmInstance(vlm_dir, engine_id=None, **ARGS))
    answers = {name: run(plain, name) for name in ("noise", "black", None)}
    assert answers["noise"] != answers["black"]  # else the test could not see a wrong KV
    return answers


def kvtier_vlm(vlm_dir: Path, name: str, disk: Path) -> VllmInstance:
    extra = {"max_local_cpu_size": "64MiB", "local_disk": str(disk), "max_local_disk_size": "1GiB"}
    return VllmInstance(
        vlm_dir,
        engine_id=unique_engine_id(f"kvtier-test-{name}"),
        extra=extra,
        enable_prefix_caching=False,
        **ARGS,
    )


def loaded(instance: VllmInstance, picture: str | None) -> tuple[list[int], int]:
    before = int(instance.stats()["hit_tokens"])
    out = run(instance, picture)
    return out, int(instance.stats()["hit_tokens"]) - before


def test_another_image_never_loads_the_first_images_kv_in_cpu_or_after_a_restart(
    vlm_dir: Path,
    instances: Instances,
    expected: dict[str | None, list[int]],
    tmp_path: Path,
) -> None:
    first = instances.get("vlm-cpu", lambda: kvtier_vlm(vlm_dir, "vlm-cpu", tmp_path))
    for picture, may_load in [
        ("noise", 0),
        ("black", CHUNK),  # chunk 0 is text before the image: the same KV
        ("noise", 2 * CHUNK),
        (None, CHUNK),  # text only: the chunk before the image, nothing after it
    ]:
        out, hit = loaded(first, picture)
        assert out == expected[picture], picture
        assert hit == may_load, picture
    first.assert_clean()
    assert first.probe is not None and first.probe.flush(30.0) is True
    instances.close()

    second = instances.get("vlm-disk", lambda: kvtier_vlm(vlm_dir, "vlm-disk", tmp_path))
    for picture in ("black", "noise"):  # each stored its own chunk 1 before the restart
        out, hit = loaded(second, picture)
        assert out == expected[picture], picture
        assert hit == 2 * CHUNK, picture
    second.assert_clean()
    instances.close()


def test_another_image_never_loads_the_first_images_kv_through_the_kvtier_server(
    vlm_dir: Path,
    instances: Instances,
    expected: dict[str | None, list[int]],
    kvserver: ServerProcess,
) -> None:
    """The server keys by what the client sends: the image's hash crosses the socket."""
    served = instances.get(
        "vlm-server",
        lambda: VllmInstance(
            vlm_dir,
            engine_id=unique_engine_id("kvtier-test-vlm-server"),
            extra={"server": kvserver.url},
            enable_prefix_caching=False,
            **ARGS,
        ),
    )
    for picture, may_load in [("noise", 0), ("black", CHUNK), ("noise", 2 * CHUNK)]:
        out, hit = loaded(served, picture)
        assert out == expected[picture], picture
        assert hit == may_load, picture
    instances.close()
    assert "Traceback" not in kvserver.log(), kvserver.log()
