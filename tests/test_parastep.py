"""Step parallelism (`parastep`): exact with warm-up over every step, rounds of N steps after it."""

from __future__ import annotations

import re
from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers import DiTTransformer2DModel, StableDiffusionImg2ImgPipeline
from displaced_reference import parastep_reference
from exactness import assert_exact, latents, relative_error
from patch_cases import _hooks_left, displaced_vs_reference, flux_true_cfg_inputs, generate

import paradiff
from paradiff import ParadiffError
from paradiff.metrics import psnr
from paradiff.runtime.step_rounds import LATENT, PREDICTION, SCHEDULER_STATE, RoundPlan, scheduler_tensors
from paradiff.tiny import build_pipeline, pipeline, prompt_inputs

pytestmark = pytest.mark.timeout(120)


def _img2img(pipe):
    """The tiny SD pipeline's components as img2img, with a fixed input image and strength 0.5."""
    img2img = StableDiffusionImg2ImgPipeline(**pipe.components, requires_safety_checker=False)
    img2img.set_progress_bar_config(disable=True)
    image = np.random.default_rng(0).random((1, 64, 64, 3), dtype=np.float32)
    return img2img, {**prompt_inputs(pipe, "sd"), "image": image, "strength": 0.5}


def _run(pipe, inputs: dict, steps: int, img2img: bool, output_type: str) -> np.ndarray:
    if not img2img:
        return generate(pipe, inputs, 64, steps, output_type=output_type)
    generator = torch.Generator().manual_seed(0)
    return latents(pipe(**inputs, num_inference_steps=steps, generator=generator, output_type=output_type))


def parastep_vs_one_device(
    family: str,
    steps: int,
    warmup: int,
    scheduler: str | None = None,
    img2img: bool = False,
    true_cfg: bool = False,
    output_type: str = "np",
    **options,
) -> dict:
    """One device vs ``parastep`` on this rank (then unparallelized): outputs (``output_type="latent"``: the final
    latents, what exact runs compare), bytes, scheduler state."""
    pipe = build_pipeline(family, scheduler=scheduler)
    inputs = flux_true_cfg_inputs(pipe) if true_cfg else prompt_inputs(pipe, family)
    if img2img:
        pipe, inputs = _img2img(pipe)
    reference = _run(pipe, inputs, steps, img2img, output_type)
    pipe = paradiff.parallelize(pipe, strategy="parastep", warmup_steps=warmup, **options)
    parallel = _run(pipe, inputs, steps, img2img, output_type)
    stats = pipe._paradiff.strategy_part.comm.stats
    sent = {kind: stats.total(kind).bytes_sent for kind in (PREDICTION, LATENT, SCHEDULER_STATE)}
    summary = paradiff.comm_stats(pipe)
    state = [float(t.double().sum()) for t in scheduler_tensors(pipe.scheduler) if t.is_floating_point()]
    wrapped_between_calls = "step" in vars(pipe.scheduler)
    paradiff.unparallelize(pipe)
    restored = _run(pipe, inputs, steps, img2img, output_type)
    return {
        "rank": dist.get_rank(),
        "error": relative_error(parallel, reference),
        "max_error": float(np.abs(parallel - reference).max()),
        "psnr_db": psnr(parallel, reference),
        "finite": bool(np.isfinite(parallel).all()),
        "restored_error": float(np.abs(restored - reference).max()),
        "output": parallel,
        "sent": sent,
        "steps_counted": summary["steps"],
        "total_bytes": stats.total().bytes_sent,
        "scheduler_state": state,
        "clean": not wrapped_between_calls and "step" not in vars(pipe.scheduler) and _hooks_left(pipe) == 0,
    }


def _loop_steps(steps: int, options: dict) -> int:
    """img2img at strength 0.5 runs the last half of the timesteps only."""
    return steps // 2 if options.get("img2img") else steps


def _check(results: list[dict], steps: int, exact: bool, min_psnr: float = 30.0) -> None:
    """``exact``: latents (``output_type="latent"``) as one device's; else images within ``min_psnr`` of them."""
    if exact:
        assert_exact(results)
    for result in results:
        assert result["finite"] and result["clean"]
        assert result["restored_error"] == 0.0
        assert result["steps_counted"] == steps
        if exact:
            assert result["total_bytes"] == 0  # every step ran on every rank: nothing to exchange
        else:
            assert result["max_error"] > 0.0 and result["psnr_db"] > min_psnr, result["psnr_db"]
    for result in results[1:]:
        np.testing.assert_array_equal(result["output"], results[0]["output"])  # every rank, the same output
        assert result["scheduler_state"] == results[0]["scheduler_state"]  # and the same scheduler history


def test_round_plan():
    plan = RoundPlan(warmup_steps=1, ranks=3)
    assert [plan.position(step) for step in range(9)] == [None, None, 0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize(
    ("family", "steps", "options"),
    [
        pytest.param("sd", 3, {}, id="sd-ddim"),
        pytest.param("sdxl", 3, {}, id="sdxl-ddim"),
        pytest.param("pixart", 3, {}, id="pixart-dpm-multistep"),
        pytest.param("sd", 3, {"scheduler": "unipc"}, id="sd-unipc-multistep"),
        pytest.param("sd3", 3, {}, id="sd3-flow"),
        pytest.param("flux", 3, {}, id="flux-flow"),
        pytest.param("sd", 6, {"img2img": True}, id="sd-img2img"),
    ],
)
def test_exact_with_warmup_over_every_step(pool2, family, steps, options):
    results = pool2.run(parastep_vs_one_device, family, steps, warmup=steps, output_type="latent", **options)
    _check(results, _loop_steps(steps, options), exact=True)


@pytest.mark.parametrize(
    ("family", "steps", "warmup", "options"),
    [
        pytest.param("sd", 6, 0, {}, id="sd-ddim"),
        pytest.param("pixart", 6, 0, {}, id="pixart-dpm-multistep"),
        # DDIM's first steps amplify a stale prediction's error (x0 = (x - σε)/α with α ≈ 0.01): warm up past them
        pytest.param("pixart", 6, 2, {"scheduler": "ddim"}, id="pixart-ddim-timestep-lookup"),
        pytest.param("sd", 6, 0, {"scheduler": "unipc"}, id="sd-unipc-multistep"),
        pytest.param("sd", 6, 0, {"scheduler": "euler"}, id="sd-euler"),
        pytest.param("flux", 6, 0, {}, id="flux-flow"),
        pytest.param("flux", 5, 0, {"true_cfg": True}, id="flux-true-cfg-two-calls-per-step"),
        pytest.param("sd", 8, 0, {"img2img": True, "scheduler": "dpm"}, id="sd-img2img-dpm-subset-of-timesteps"),
    ],
)
def test_displaced_rounds_stay_close_and_agree(pool2, family, steps, warmup, options):
    results = pool2.run(parastep_vs_one_device, family, steps, warmup=warmup, **options)
    _check(results, _loop_steps(steps, options), exact=False)


@pytest.mark.parametrize(
    ("family", "scheduler", "steps", "warmup"),
    [("sd", "euler", 6, 0), ("pixart", "ddim", 5, 1)],
    ids=["sd-euler", "pixart-ddim"],
)
def test_displaced_rounds_move_bytes_and_match_the_reference(pool2, family, scheduler, steps, warmup):
    """Rounds after warm-up exchange predictions and latents, and land on the reference's latents (not one
    device's): a skipped exchange or a prediction of the wrong round moves them far past round-off."""
    reference = partial(parastep_reference, ranks=2, warmup_steps=warmup)
    results = pool2.run(
        displaced_vs_reference, family, steps, reference, scheduler, strategy="parastep", warmup_steps=warmup
    )
    assert_exact(results)  # "error" here: to the displaced reference
    for result in results:
        assert result["sent"] > 0, result["sent"]
        assert result["moved"] >= 1e-3, result["moved"]  # displaced (measured 1e-2, 0.5): not one device's latents


@pytest.mark.parametrize(("steps", "rounds", "predictions"), [(7, 3, 3), (6, 3, 2)])
def test_a_round_moves_n_minus_1_predictions_and_one_latent(pool2, steps, rounds, predictions):
    """DDIM stores no history: rank 1 sends one prediction per full round, rank 0 broadcasts one latent per round."""
    latent = 1 * 4 * 8 * 8 * 4  # one fp32 latent (and one prediction) of a 64 px image
    results = pool2.run(parastep_vs_one_device, "sd", steps, warmup=0)  # displaced steps 1..steps-1
    assert results[0]["sent"] == {PREDICTION: 0, LATENT: rounds * latent, SCHEDULER_STATE: 0}
    assert results[1]["sent"] == {PREDICTION: predictions * latent, LATENT: 0, SCHEDULER_STATE: 0}


def test_four_ranks_exact_and_displaced(pool4):
    _check(pool4.run(parastep_vs_one_device, "sd", 3, warmup=3, output_type="latent"), 3, exact=True)
    steps, latent = 5, 1 * 4 * 8 * 8 * 4  # step 0 on every rank, then one round of 4
    results = pool4.run(parastep_vs_one_device, "sd", steps, warmup=0)
    _check(results, steps, exact=False)
    assert results[0]["sent"] == {PREDICTION: 0, LATENT: 3 * latent, SCHEDULER_STATE: 0}  # to the 3 others
    for result in results[1:]:
        assert result["sent"] == {PREDICTION: latent, LATENT: 0, SCHEDULER_STATE: 0}


def test_composes_with_the_cfg_split(pool4):
    """2 × 2 mesh: each CFG half runs parastep over 2 ranks."""
    _check(pool4.run(parastep_vs_one_device, "sd", 3, warmup=3, cfg_parallel=True, output_type="latent"), 3, exact=True)
    _check(pool4.run(parastep_vs_one_device, "sd", 4, warmup=0, cfg_parallel=True), 4, exact=False)


def callbacks_seen(family: str, steps: int, warmup: int) -> list[int]:
    """The step indices a user's callback sees: ``callback_on_step_end``, or the older ``callback`` (PixArt)."""
    seen = []
    pipe = paradiff.parallelize(build_pipeline(family), strategy="parastep", warmup_steps=warmup)
    if family == "pixart":
        extra = {"callback": lambda step, timestep, latents: seen.append(step), "callback_steps": 1}
    else:

        def on_step_end(pipe, step, timestep, kwargs):
            seen.append(step)
            return kwargs

        extra = {"callback_on_step_end": on_step_end}
    generate(pipe, prompt_inputs(pipe, family), 64, steps, **extra)
    paradiff.unparallelize(pipe)
    return seen


@pytest.mark.parametrize("family", ["sd", "pixart"])
def test_user_callbacks_see_the_stock_step_indices(pool2, family):
    for seen in pool2.run(callbacks_seen, family, 5, warmup=0):
        assert seen == list(range(5))


def cogvideox_vs_one_device(steps: int, warmup: int, output_type: str) -> dict:
    pipe = pipeline("cogvideox-text")

    def video():
        generator = torch.Generator().manual_seed(0)
        call = {"num_inference_steps": steps, "num_frames": 5, "height": 32, "width": 32, "output_type": output_type}
        return latents(pipe("a red circle", generator=generator, **call))

    reference = video()
    pipe = paradiff.parallelize(pipe, strategy="parastep", warmup_steps=warmup)
    parallel = video()
    paradiff.unparallelize(pipe)
    error = float(np.abs(parallel - reference).max())
    return {
        "error": relative_error(parallel, reference),
        "max_error": error,
        "psnr_db": psnr(parallel, reference),
        "output": parallel,
    }


def test_cogvideox_video_pipeline(pool2):
    assert_exact(pool2.run(cogvideox_vs_one_device, 3, warmup=3, output_type="latent"))
    displaced = pool2.run(cogvideox_vs_one_device, 5, warmup=0, output_type="np")
    assert all(result["max_error"] > 0.0 and result["psnr_db"] > 30.0 for result in displaced)
    np.testing.assert_array_equal(displaced[0]["output"], displaced[1]["output"])


def loop_error(case: str) -> dict:
    """A loop that ends inside a round, or ranks that ask for different step counts: a clear error everywhere.

    The next call on the same pipeline then runs as on a freshly parallelized one.
    """
    pipe = paradiff.parallelize(build_pipeline("sd"), strategy="parastep", warmup_steps=0)
    inputs, steps, extra = prompt_inputs(pipe, "sd"), 6, {}
    if case == "interrupt":

        def interrupt(pipe, step, timestep, kwargs):
            pipe._interrupt = step >= 3  # step 3 opens the round of steps 3 and 4
            return kwargs

        extra = {"callback_on_step_end": interrupt}
    message = ""
    try:
        generate(pipe, inputs, 64, steps + dist.get_rank() * (case == "different-steps"), **extra)
    except ParadiffError as error:
        message = str(error)
    recovered = generate(pipe, inputs, 64, steps)
    paradiff.unparallelize(pipe)
    pipe = paradiff.parallelize(pipe, strategy="parastep", warmup_steps=0)
    fresh = generate(pipe, inputs, 64, steps)
    paradiff.unparallelize(pipe)
    return {"message": message, "recovered_difference": float(np.abs(recovered - fresh).max())}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("interrupt", r"the denoising loop ended after 4 steps, inside the parastep round of steps 3 to 4; .*"),
        (
            "different-steps",
            r"ranks disagree on the call's arguments: num_inference_steps differs: 6 \(rank 0\), 7 \(rank 1\)",
        ),
    ],
)
def test_loops_the_ranks_cannot_share_fail_clearly(pool2, case, message):
    for result in pool2.run(loop_error, case):
        assert re.search(message, result["message"]), result["message"]
        assert result["recovered_difference"] == 0.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"partial_context": 0.3}, r"partial_context is an option of the patch strategy.*'parastep'"),
        ({"pipefusion_patches": 4}, r"pipefusion_patches is an option of the pipefusion strategy.*'parastep'"),
    ],
)
def test_options_of_other_strategies_are_refused(options, message):
    with pytest.raises(ParadiffError, match=message):
        paradiff.ParallelConfig(strategy="parastep", **options)


def test_a_strategy_that_needs_a_family_refuses_an_unknown_denoiser_naming_those_that_run_it(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # no process group exists: it must fail before creating one
    pipe = pipeline("cogvideox-text")
    pipe.transformer = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1)
    message = r"DiTTransformer2DModel is not supported.*'parastep' and strategy='cfg' run any denoiser"
    with pytest.raises(ParadiffError, match=message):
        paradiff.parallelize(pipe, strategy="patch", cfg_parallel=True)
    assert not hasattr(pipe, "_paradiff")
