"""What the loaded model can draw on these ranks, learnt once on rank 0 so that the front checks requests alone.

The front (the HTTP process) holds no pipeline. So, once the model is loaded, rank 0 writes a
:class:`ModelCard`: the model's kind, its default size and frames, the multiple every side must be, and per
strategy either why it cannot run here or every height up to the size limit it can cut over these ranks
(``paradiff.check_parallelize``: no collective, no change to the pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Frames per second of the videos the server writes (as ``paradiff generate``'s).
VIDEO_FPS = 8


@dataclass(frozen=True)
class StrategyFit:
    """Whether a strategy runs this model on these ranks: why not, or the heights (px) it can cut."""

    refusal: str | None = None
    heights: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelCard:
    model: str
    pipeline: str
    video: bool
    nproc: int
    #: The size a request without one is drawn at (height, width).
    default_size: tuple[int, int]
    #: Every side must be a multiple of this many pixels (a row of the denoiser's latent patches).
    pixels: int
    #: The call's frame count argument (video pipelines), the frames it draws by default, the one count it
    #: draws if its denoiser fixes it, and the most it draws if its denoiser bounds them.
    frames_parameter: str | None = None
    default_frames: int | None = None
    fixed_frames: int | None = None
    most_frames: int | None = None
    #: The guidance a request without one runs at (None: the pipeline takes none).
    guidance: float | None = None
    negative_prompt: bool = True
    #: Whether several prompts can be drawn in one call (a text pipeline).
    batchable: bool = True
    #: Every strategy paradiff has, and (on several ranks) how each fits this model.
    strategy_names: tuple[str, ...] = ()
    strategies: dict[str, StrategyFit] = field(default_factory=dict)

    def sizes_near(self, height: int, heights: tuple[int, ...]) -> str:
        """The heights of ``heights`` nearest ``height``, for a refusal's message."""
        near = sorted(heights, key=lambda h: (abs(h - height), h))[:2]
        return " or ".join(str(h) for h in sorted(near))


def describe(pipe, model: str, nproc: int, warmup: int, size_limit: int) -> ModelCard:
    """The card of ``pipe`` (loaded from ``model``) on ``nproc`` ranks."""
    import inspect
    import warnings

    import paradiff

    from ..checks import vae_scale_factor
    from ..loading import (
        call_parameters,
        default_height,
        default_size,
        fixed_frames,
        frames_parameter,
        makes_video,
        model_source,
        most_frames,
        prompt_kwargs,
    )
    from ..models import family_of, find_denoiser
    from ..strategies import strategy_names

    denoiser = find_denoiser(pipe)
    pixels = family_of(denoiser, any_model=True).pixels_per_row(denoiser, vae_scale_factor(pipe))
    height = default_size(model) or default_height(pipe) or 512
    parameters = inspect.signature(type(pipe).__call__).parameters
    frames = frames_parameter(pipe)
    default_frames = parameters[frames].default if frames else None
    with warnings.catch_warnings():  # a built-in model's warning of words it does not know
        warnings.simplefilter("ignore")
        inputs = prompt_kwargs(pipe, model, "a picture")
    guidance = inputs.get("guidance_scale", getattr(parameters.get("guidance_scale"), "default", None))
    strategies = {}
    if nproc > 1:
        for name in strategy_names():
            try:
                paradiff.check_parallelize(pipe, name, world_size=nproc, warmup_steps=warmup)
            except paradiff.ParadiffError as error:
                strategies[name] = StrategyFit(refusal=str(error))
                continue
            heights = []
            for candidate in range(pixels, size_limit + 1, pixels):
                try:
                    paradiff.check_parallelize(pipe, name, world_size=nproc, height=candidate, warmup_steps=warmup)
                except paradiff.ParadiffError:
                    continue
                heights.append(candidate)
            strategies[name] = StrategyFit(heights=tuple(heights))
    return ModelCard(
        model=model,
        pipeline=type(pipe).__name__,
        video=makes_video(pipe),
        nproc=nproc,
        default_size=(height, height),
        pixels=pixels,
        frames_parameter=frames,
        default_frames=fixed_frames(pipe) or (default_frames if isinstance(default_frames, int) else None),
        fixed_frames=fixed_frames(pipe),
        most_frames=most_frames(pipe),
        guidance=guidance if isinstance(guidance, (int, float)) else None,
        negative_prompt="negative_prompt" in call_parameters(pipe) and model_source(model).kind != "random",
        batchable="prompt" in inputs,
        strategy_names=tuple(strategy_names()),
        strategies=strategies,
    )
