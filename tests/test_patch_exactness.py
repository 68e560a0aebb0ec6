"""With warm-up covering every step, `patch` reproduces the one-device output (1e-4, fp32 CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from patch_cases import banded_decode, half_precision, parallel_vs_one_device, resolution_change

TOLERANCE = 1e-4

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
    for result in results:
        assert result["max_error"] <= TOLERANCE, result["max_error"]
        assert result["restored_error"] == 0.0
        assert result["class_changed"] and result["class_restored"]
        assert result["hooks_left"] == 0
        assert result["stats"]["stale_layer_exchanges"] == 0
        assert result["stats"]["sync_layer_exchanges"] > 0
        assert result["stats"]["steps"] == steps
    first = results[0]["image"]
    for result in results[1:]:
        np.testing.assert_array_equal(result["image"], first)  # every rank returns the same image


@pytest.mark.parametrize(("family", "size", "options"), CASES_2_RANKS)
def test_exact_at_2_ranks(pool2, family, size, options):
    steps = 3
    _check_exact(pool2.run(parallel_vs_one_device, family, size, steps, warmup=steps, **options), steps)


@pytest.mark.parametrize("family", ["sd", "pixart", "flux"])
def test_exact_at_4_ranks(pool4, family):
    steps = 2
    _check_exact(pool4.run(parallel_vs_one_device, family, 128, steps, warmup=steps), steps)


@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_resolution_change_replans(pool2, family):
    for result in pool2.run(resolution_change, family, (64, 128), 2):
        assert max(result["errors"]) <= TOLERANCE


def test_vae_decode_banded_or_whole(pool2):
    for banded, whole in zip(pool2.run(banded_decode, 8), pool2.run(banded_decode, 9), strict=True):
        assert banded["max_error"] <= TOLERANCE and banded["bytes_sent"] > 0
        assert whole["max_error"] == 0.0 and whole["bytes_sent"] == 0  # 9 rows: not split, run whole


@pytest.mark.parametrize(("family", "tolerance"), [("sd", 0.2), ("flux", 0.05)])
def test_bfloat16_stays_bfloat16(pool2, family, tolerance):
    """bf16 models exchange bf16 (half of fp32's bytes) and stay near the one-device bf16 image.

    bf16 round-off differs between a band and the whole image and compounds over the steps, so the
    bound is loose; a wrong dtype or layout would be far off.
    """
    full = pool2.run(half_precision, family, "float32")[0]
    half = pool2.run(half_precision, family, "bfloat16")[0]
    assert 0.45 < half["bytes_per_step"] / full["bytes_per_step"] <= 0.55
    assert full["max_error"] <= TOLERANCE
    assert half["max_error"] < tolerance
