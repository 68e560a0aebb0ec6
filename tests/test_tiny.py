import numpy as np
import pytest
import torch

from paradiff.tiny import FAMILIES, SCHEDULERS, build_pipeline, count_parameters, prompt_inputs

PIPELINE_CLASSES = {
    "sd": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "pixart": "PixArtSigmaPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The tiny models are far too small to gain from intra-op threads; on a busy machine the
    # OpenMP barriers make a 2-step run ~50x slower with more than one thread.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def pipes():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build_pipeline(family, "tiny", seed=0)
        return cache[family]

    return get


def _weights(pipe):
    return {
        f"{name}.{key}": value
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for key, value in component.state_dict().items()
    }


def _run(pipe, family, batch_size=1, size=64, seed=0):
    return pipe(
        **prompt_inputs(pipe, family, batch_size=batch_size, seed=seed),
        height=size,
        width=size,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_weights(family, pipes):
    first = _weights(pipes(family))
    second = _weights(build_pipeline(family, "tiny", seed=0))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = _weights(build_pipeline(family, "tiny", seed=1))
    assert any(not torch.equal(first[k], other[k]) for k in first if first[k].is_floating_point())


def test_build_does_not_disturb_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_pipeline("pixart")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_properties(family, pipes):
    pipe = pipes(family)
    assert type(pipe).__name__ == PIPELINE_CLASSES[family]
    assert pipe.vae_scale_factor == 8
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in component.parameters())
    denoiser = pipe.unet if family in ("sd", "sdxl") else pipe.transformer
    assert 0 < count_parameters(denoiser) < count_parameters(pipe)


@pytest.mark.parametrize("family", FAMILIES)
def test_run_64(family, pipes):
    pipe = pipes(family)
    image = _run(pipe, family)
    assert image.shape == (1, 64, 64, 3)
    assert np.isfinite(image).all()
    np.testing.assert_array_equal(image, _run(pipe, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_two(family, pipes):
    images = _run(pipes(family), family, batch_size=2)
    assert images.shape == (2, 64, 64, 3)
    assert np.isfinite(images).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_run_128(family, pipes):
    image = _run(pipes(family), family, size=128)
    assert image.shape == (1, 128, 128, 3)
    assert np.isfinite(image).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_inputs_deterministic(family, pipes):
    pipe = pipes(family)
    a, b = prompt_inputs(pipe, family, seed=3), prompt_inputs(pipe, family, seed=3)
    c = prompt_inputs(pipe, family, seed=4)
    assert a.keys() == b.keys() == c.keys()
    assert a["guidance_scale"] > 1
    assert torch.equal(a["prompt_embeds"], b["prompt_embeds"])
    assert not torch.equal(a["prompt_embeds"], c["prompt_embeds"])
    assert ("negative_prompt_embeds" in a) == (family != "flux")


@pytest.mark.parametrize("name", ["ddim", "euler", "dpm", "unipc"])
def test_schedulers_sd(name):
    pipe = build_pipeline("sd", scheduler=name)
    assert type(pipe.scheduler).__name__.lower().startswith({"dpm": "dpmsolver"}.get(name, name))
    assert np.isfinite(_run(pipe, "sd")).all()


def test_scheduler_defaults(pipes):
    assert type(pipes("sd").scheduler).__name__ == "DDIMScheduler"
    assert type(pipes("pixart").scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert type(pipes("sd3").scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert type(build_pipeline("flux", scheduler="flow").scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"


@pytest.mark.parametrize(
    "family, name", [("sd", "flow"), ("pixart", "flow"), ("sd3", "ddim"), ("flux", "euler"), ("sd", "bogus")]
)
def test_invalid_scheduler(family, name):
    with pytest.raises(ValueError, match="valid") as info:
        build_pipeline(family, scheduler=name)
    expected = ["flow"] if family in ("sd3", "flux") else [n for n in SCHEDULERS if n != "flow"]
    assert all(repr(n) in str(info.value) or n in str(info.value) for n in expected)


def test_invalid_family_and_size():
    with pytest.raises(ValueError, match="sdxl"):
        build_pipeline("kandinsky")
    with pytest.raises(ValueError, match="bench"):
        build_pipeline("sd", size="huge")
    with pytest.raises(ValueError, match="pixart"):
        prompt_inputs(None, "kandinsky")


def test_count_parameters():
    assert count_parameters(torch.nn.Linear(3, 4)) == 16
