"""Bad input fails with a message that names what works, on every rank, before any collective."""

from __future__ import annotations

import pytest
import torch
from patch_cases import binned_height, expect_error

import paradiff
from paradiff import ParadiffError
from paradiff.layers.split import band_rows_error
from paradiff.models import FAMILIES, family_of
from paradiff.tiny import build_pipeline


@pytest.fixture(scope="module")
def sd_pipe():
    return build_pipeline("sd")


def test_unknown_strategy(sd_pipe):
    with pytest.raises(ParadiffError, match="unknown strategy 'tiles'; available: patch"):
        paradiff.parallelize(sd_pipe, strategy="tiles")


def test_unknown_option(sd_pipe):
    with pytest.raises(ParadiffError, match=r"unknown option\(s\) \['warmup'\].*warmup_steps"):
        paradiff.parallelize(sd_pipe, warmup=3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"partial_context": 1.5}, r"partial_context must be None or within \[0, 1\]"),
        ({"timeout_s": 0}, "timeout_s must be positive"),
        # booleans are integers to Python; strings would meet a bare comparison error
        ({"warmup_steps": True}, "warmup_steps must be an integer >= 0, got True"),
        ({"timeout_s": "x"}, "timeout_s must be positive, got 'x'"),
        ({"partial_context": True}, r"partial_context must be None or within \[0, 1\], got True"),
        ({"partial_context": "x"}, r"partial_context must be None or within \[0, 1\], got 'x'"),
        ({"bucket_limit_bytes": False}, "bucket_limit_bytes must be an integer >= 0, got False"),
        ({"strategy": "pipefusion", "pipefusion_patches": True}, "pipefusion_patches must be None or an integer >= 1"),
        ({"strategy": "pipefusion", "pipefusion_stages": (True, 1)}, r"pipefusion_stages must be None or the number"),
        ({"strategy": "asyncdiff", "asyncdiff_cut": (True, 2)}, r"asyncdiff_cut must be None or the number"),
    ],
)
def test_bad_option_values(sd_pipe, options, message):
    with pytest.raises(ParadiffError, match=message):
        paradiff.parallelize(sd_pipe, **options)


def test_unsupported_denoiser_lists_supported_classes():
    class OddPipeline:
        transformer = torch.nn.Linear(2, 2)

    with pytest.raises(ParadiffError, match="Linear is not supported; supported classes: UNet2DConditionModel, "):
        paradiff.parallelize(OddPipeline())


def test_pipeline_without_denoiser():
    with pytest.raises(ParadiffError, match="has no denoiser attribute"):
        paradiff.parallelize(object())


def test_single_rank_is_a_no_op(sd_pipe):
    before = type(sd_pipe)
    assert paradiff.parallelize(sd_pipe) is sd_pipe
    assert type(sd_pipe) is before and not hasattr(sd_pipe, "_paradiff")


def test_band_error_names_heights_that_work():
    unet = build_pipeline("sd").unet  # 3 levels: bands must be multiples of 4 latent rows
    message = band_rows_error(125, family_of(unet), unet, 4, 8)
    assert message == (
        "height 1000 is not divisible by 128 (8 pixels per row × 4 row alignment of the unet model × 4 ranks); "
        "use 896 or 1024"
    )
    assert band_rows_error(128, family_of(unet), unet, 4, 8) is None


def test_every_family_is_found():
    for family in ("sd", "sdxl", "pixart", "sd3", "flux"):
        pipe = build_pipeline(family)
        model = getattr(pipe, "unet", None) or pipe.transformer
        assert family_of(model) in FAMILIES


@pytest.mark.parametrize(
    ("family", "action", "message"),
    [
        ("sd", "height=72", "height 72 is not divisible by 64 .*; use 64 or 128"),
        ("pixart", "height=80", "height 80 is not divisible by 32 .*; use 64 or 96"),
        ("sd", "fused", "uses fused QKV projections.*unfuse_qkv_projections"),
        ("flux", "processor", "Flux attention processor AttnProcessor is not supported.*FluxAttnProcessor"),
        ("sd", "twice", "already parallelized; call paradiff.unparallelize"),
    ],
)
def test_errors_on_every_rank(pool2, family, action, message):
    import re

    for text in pool2.run(expect_error, family, action):
        assert re.search(message, text), text


def test_resolution_binning_is_left_to_the_pipeline(pool2):
    # 264 px is not a multiple of 32 (8 VAE x 2 patch x 2 ranks), but PixArt bins it to 256 first
    for result in pool2.run(binned_height, 264):
        assert result["shape"][1:3] == (264, 264)  # the pipeline resizes its output back


@pytest.mark.parametrize(
    ("strategy", "world", "height", "message"),
    [
        ("pipefusion", 2, None, "strategy='pipefusion' does not support UNet2DConditionModel"),
        ("patch", 3, None, None),
        ("patch", 2, 200, "height 200"),
        ("cfg", 3, None, "runs the two CFG halves on 2 ranks, got a world of 3"),
    ],
)
def test_check_parallelize_refuses_without_a_collective(sd_pipe, strategy, world, height, message):
    before = type(sd_pipe)
    if message is None:
        paradiff.check_parallelize(sd_pipe, strategy, world_size=world, height=height)
    else:
        with pytest.raises(ParadiffError, match=message):
            paradiff.check_parallelize(sd_pipe, strategy, world_size=world, height=height)
    assert type(sd_pipe) is before and not hasattr(sd_pipe, "_paradiff")
