"""The pipeline's next denoiser call worked out before the pipeline makes it (``paradiff.stages.next_call``).

One process, no ranks: a hook on the denoiser reports each call to a :class:`NextCall` and, at the end of
each call, asks it for the next one, worked out from the call's whole output (what the last stage of a
flowing ``pipefusion`` does patch by patch); the next call must then come with exactly those arguments.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers.hooks import HookRegistry
from patch_cases import flux_true_cfg_inputs

from paradiff.compat import CallContextHook, invalidate_hook_cache, remove_hook
from paradiff.layers.split import output_sample
from paradiff.models import family_of, find_denoiser
from paradiff.models.base import bind_inputs
from paradiff.stages.next_call import Guidance, NextCall, fit_guidance
from paradiff.tiny import build, build_pipeline, prompt_inputs

STEPS = 5


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


class ForecastCheck(CallContextHook):
    """On the denoiser: every call against the one worked out at the end of the call before."""

    def __init__(self, forecast: NextCall):
        super().__init__()
        self.forecast = forecast
        self.pending: dict | None = None
        self.checked, self.differing = 0, []

    def pre_forward(self, module, *args, **kwargs):
        arguments = bind_inputs(module, args, kwargs).arguments
        if self.pending is not None:
            self.checked += 1
            self.differing += [name for name in arguments if not _same(self.pending.get(name), arguments[name])]
            self.pending = None
        self.forecast.observe_call(self.context.name, arguments)
        return args, kwargs

    def post_forward(self, module, output):
        sample, forecast = output_sample(output), self.forecast
        upcoming = forecast.upcoming()
        if upcoming is not None:
            latent = forecast.latent_after(sample) if upcoming.new_step else None
            self.pending = forecast.arguments(upcoming, latent)
        forecast.observe_output(sample)
        return output


def forecast_run(pipe, call: dict) -> tuple[NextCall, ForecastCheck]:
    model = find_denoiser(pipe)
    family = family_of(model)
    forecast = NextCall(pipe.scheduler, family.latent_arg, family.timestep_arg)
    check = ForecastCheck(forecast)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(check, "forecast")
    invalidate_hook_cache(model)
    try:
        with torch.no_grad(), forecast.watch():
            pipe(**call)
    finally:
        remove_hook(model, "forecast")
        invalidate_hook_cache(model)
    return forecast, check


def _image_call(family: str, scheduler: str | None, true_cfg: bool = False):
    pipe = build_pipeline(family, scheduler=scheduler)
    prompt = flux_true_cfg_inputs(pipe) if true_cfg else prompt_inputs(pipe, family)
    generator = torch.Generator().manual_seed(0)
    call = {**prompt, "height": 64, "width": 64, "num_inference_steps": STEPS, "generator": generator}
    return pipe, {**call, "output_type": "latent"}


@pytest.mark.parametrize(
    ("family", "scheduler", "true_cfg", "guidance"),
    [
        ("pixart", "ddim", False, ("batch", 4.5, True)),  # learned variance: the first half of the channels
        ("pixart", "dpm", False, ("batch", 4.5, True)),
        ("pixart", "unipc", False, ("batch", 4.5, True)),
        ("pixart", "euler", False, ("batch", 4.5, True)),  # scale_model_input
        ("sd3", None, False, ("batch", 7.0, False)),  # flow matching
        ("flux", None, False, ("none", 1.0, False)),  # guidance-distilled: timestep / 1000
        ("flux", None, True, ("calls", 2.0, False)),  # true CFG: two calls, cache_context("cond"/"uncond")
    ],
)
def test_every_call_is_worked_out_bit_for_bit(family, scheduler, true_cfg, guidance):
    forecast, check = forecast_run(*_image_call(family, scheduler, true_cfg))
    calls = 2 if true_cfg else 1
    assert forecast.refusal is None
    assert (forecast.guidance.kind, forecast.guidance.scale, forecast.guidance.half_channels) == guidance
    assert forecast.input.scaled == (scheduler == "euler")
    assert check.checked == calls * (STEPS - 1) - 1  # from the second step on: the input form is learned there
    assert check.differing == []


def test_a_video_pipeline_with_two_calls_per_step_is_worked_out():
    """Wan: CFG as two calls per step in cache_context("cond"/"uncond"), flow-matching scheduler, 5-D latents."""
    pipe, call = build("wan")
    forecast, check = forecast_run(pipe, {**call, "num_inference_steps": STEPS})
    assert forecast.refusal is None and forecast.guidance.kind == "calls"
    assert check.checked == 2 * (STEPS - 1) - 1 and check.differing == []


def test_a_guidance_scale_that_changes_is_refused():
    """SD3's loop reads its guidance scale from the pipeline at every step: a callback that changes it."""
    pipe, call = _image_call("sd3", None)

    def stronger(pipe, step, timestep, tensors):
        pipe._guidance_scale += 1.0
        return {}

    forecast, _ = forecast_run(pipe, {**call, "callback_on_step_end": stronger})
    assert forecast.refusal == "the pipeline's guidance changed at step 1 (a guidance scale that varies per step?)"
    assert forecast.upcoming() is None


def test_latents_a_callback_replaces_are_refused():
    pipe, call = _image_call("sd3", None)

    def nudge(pipe, step, timestep, tensors):
        return {"latents": tensors["latents"] * 1.01} if step == 2 else {}

    forecast, check = forecast_run(pipe, {**call, "callback_on_step_end": nudge})
    assert forecast.refusal.startswith("the latent the pipeline passed at step 3 is not the one its scheduler returned")
    assert check.differing == ["hidden_states"]  # the one call worked out on the latent before the change


def test_a_pipeline_that_copies_its_scheduler_stops_the_forecast():
    pipe, _ = _image_call("pixart", "ddim")
    forecast = NextCall(pipe.scheduler, "hidden_states", "timestep")
    with forecast.watch():
        clone = copy.deepcopy(pipe.scheduler)
    assert "step" not in vars(pipe.scheduler)
    assert clone.step.__func__ is type(pipe.scheduler).step and clone.step.__self__ is clone
    assert forecast.refusal.startswith("the pipeline copies its scheduler during the call")


def test_a_combination_rescaled_per_token_is_fitted():
    """Qwen-Image's true CFG rescales each token's combination to the cond prediction's norm."""
    generator = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(1, 32, 16, generator=generator), torch.randn(1, 32, 16, generator=generator)
    expected = Guidance("calls", 4.0, rescaled=True)([cond, uncond], torch.float32)
    fitted = fit_guidance([cond, uncond], expected)
    assert fitted == Guidance("calls", 4.0, rescaled=True)
    assert fit_guidance([cond, uncond], expected * 1.001) is None
