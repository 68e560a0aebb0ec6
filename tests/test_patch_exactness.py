"""With warm-up covering every step, `patch` reproduces the one-device latents (``exactness``, fp32 CPU)."""

from __future__ import annotations

import pytest
from exactness import assert_exact
from patch_cases import (
    banded_decode,
    check_exact_and_restored,
    half_precision,
    parallel_vs_one_device,
    resolution_change,
)

CASES_2_RANKS = [
    pytest.param("sd", 64, {}, id="sd-ddim"),
    pytest.param("sd", 64, {"scheduler": "euler", "batch": 2}, id="sd-euler-batch2"),
    pytest.param("sd", 64, {"processor": "classic"}, id="sd-classic-attn-processor"),
    pytest.param("sd", 64, {"processor": "lora"}, id="sd-peft-lora-on-attention-and-convs"),
    pytest.param("sdxl", 64, {"scheduler": "dpm"}, id="sdxl-dpm"),
    pytest.param("pixart", 64, {}, id="pixart-dpm"),
    pytest.param("pixart", 64, {"scheduler": "unipc", "batch": 2}, id="pixart-unipc-batch2"),
    pytest.param("sd3", 64, {}, id="sd3-flow"),
    pytest.param("flux", 64, {}, id="flux-flow"),
    pytest.param("flux", 64, {"true_cfg": True}, id="flux-true-cfg-two-contexts"),
]


def _check_exact(results, steps):
    check_exact_and_restored(results, steps)
    for result in results:
        assert result["stats"]["sync_layer_exchanges"] > 0


@pytest.mark.parametrize(("family", "size", "options"), CASES_2_RANKS)
def test_exact_at_2_ranks(pool2, family, size, options):
    steps = 3
    results = pool2.run(parallel_vs_one_device, family, size, steps, warmup=steps, output_type="latent", **options)
    _check_exact(results, steps)


@pytest.mark.parametrize("family", ["sd", "pixart", "flux"])
def test_exact_at_4_ranks(pool4, family):
    steps = 2
    _check_exact(pool4.run(parallel_vs_one_device, family, 128, steps, warmup=steps, output_type="latent"), steps)


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_resolution_change_replans(pool2, family):
    results = pool2.run(resolution_change, family, (64, 128), 2)
    for index, size in enumerate((64, 128)):
        assert_exact([result["runs"][index] for result in results], size)


def test_vae_decode_banded_or_whole(pool2):
    """The decoded tensor (no clamp) is held to the latents' standard: it is the decoder's own output."""
    banded, whole = pool2.run(banded_decode, 8), pool2.run(banded_decode, 9)
    assert_exact(banded)
    assert all(result["bytes_sent"] > 0 for result in banded)
    assert all(result["max_error"] == 0.0 and result["bytes_sent"] == 0 for result in whole)  # 9 rows: run whole


@pytest.mark.parametrize(("family", "tolerance"), [("sd", 0.1), ("flux", 0.01)])  # measured: 3.3e-2 and 0
def test_bfloat16_stays_bfloat16(pool2, family, tolerance):
    """bf16 models exchange bf16 (half of fp32's bytes) and stay near the one-device bf16 latents.

    bf16 round-off differs between a band and the whole image and compounds over the steps, so the
    bound (relative to the latents' largest magnitude) is loose; a wrong dtype or layout would be far off.
    """
    full = pool2.run(half_precision, family, "float32")
    half = pool2.run(half_precision, family, "bfloat16")
    assert 0.45 < half[0]["bytes_per_step"] / full[0]["bytes_per_step"] <= 0.55
    assert_exact(full)
    print(f"{family}: bf16 latents differ by {half[0]['error']:.2e} of their largest magnitude")
    assert half[0]["error"] < tolerance, half[0]["error"]
