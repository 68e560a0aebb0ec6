"""What the tiny pipelines share: the seeded build, the finishing touches, VAEs, prompt embeddings and masks.

Every builder runs inside :func:`seeded`, so the same seed gives bit-identical weights in every process while the
caller's global RNG is left as it was; the embeddings of a call come from a seeded ``torch.Generator`` instead, so
drawing them never disturbs the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLWan, DiffusionPipeline

#: Denoising steps of the calls the table makes (at least 2: some pipelines take another path at one step).
NUM_INFERENCE_STEPS = 3
#: The seed of the initial noise of those calls.
NOISE_SEED = 0


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """``torch.manual_seed(seed)`` inside, the caller's global RNG state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def finish(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """Every model in eval mode (as ``from_pretrained`` leaves them: dropout off) and the progress bar off."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_options() -> dict:
    """The arguments every call of the table shares: fresh seeded noise, a few steps, latents out.

    A call consumes the generator: take these again (or a new generator) for a second call.
    """
    return {
        "generator": torch.Generator().manual_seed(NOISE_SEED),
        "num_inference_steps": NUM_INFERENCE_STEPS,
        "output_type": "latent",
    }


def embeddings(generator: torch.Generator, tokens: int, width: int) -> torch.Tensor:
    """One prompt's embeddings, ``(1, tokens, width)``, as the (absent) text encoder would give them."""
    return torch.randn(1, tokens, width, generator=generator)


def prompt_pair(generator: torch.Generator, tokens: int, width: int) -> dict:
    """A prompt's and a negative prompt's embeddings, drawn in that order."""
    return {
        "prompt_embeds": embeddings(generator, tokens, width),
        "negative_prompt_embeds": embeddings(generator, tokens, width),
    }


def mask(valid: int, tokens: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A ``(1, tokens)`` attention mask with the first ``valid`` tokens real and the rest padding."""
    out = torch.zeros(1, tokens, dtype=dtype)
    out[:, :valid] = 1
    return out


def kl_vae(block_out_channels: tuple[int, ...], cls: type = AutoencoderKL, **config) -> torch.nn.Module:
    """An RGB image VAE of ``AutoencoderKL``'s layout (or a subclass's): one down and one up block per width."""
    levels = len(block_out_channels)
    return cls(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=block_out_channels,
        **config,
    )


def video_vae(cls: type, blocks: str, **config) -> torch.nn.Module:
    """A video VAE of the 3D-block layout diffusers' CogVideoX, Allegro and HunyuanVideo VAEs share: four levels of
    ``<blocks>DownBlock3D`` / ``<blocks>UpBlock3D`` with 8 channels each, one layer per block, 4 latent channels."""
    return cls(
        in_channels=3,
        out_channels=3,
        down_block_types=(f"{blocks}DownBlock3D",) * 4,
        up_block_types=(f"{blocks}UpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        **config,
    )


def cogvideox_vae() -> AutoencoderKLCogVideoX:
    """CogVideoX's video VAE (8x spatial, 4x temporal)."""
    return video_vae(AutoencoderKLCogVideoX, "CogVideoX", norm_num_groups=2, temporal_compression_ratio=4)


#: The layout of Wan's DiT that SkyReels-V2's shares, at test size: patches of 1 frame x 2 x 2, 16 latent channels,
#: text width 32; the two set their heads, blocks and RoPE table.
WAN_DIT = dict(
    patch_size=(1, 2, 2),
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=32,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)


def wan_vae() -> AutoencoderKLWan:
    """Wan's video VAE (8x spatial, 4x temporal, 16 latent channels) at width 3, as diffusers' own tests build it."""
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def count_parameters(module: torch.nn.Module | DiffusionPipeline) -> int:
    """Number of parameters of ``module``; for a pipeline, summed over its torch components."""
    if isinstance(module, DiffusionPipeline):
        return sum(
            count_parameters(component)
            for component in module.components.values()
            if isinstance(component, torch.nn.Module)
        )
    return sum(p.numel() for p in module.parameters())
