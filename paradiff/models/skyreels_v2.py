"""SkyReels-V2 (``SkyReelsV2Transformer3DModel``): a Wan-style video DiT that takes one noise level per frame.

Diffusion forcing. With ``enable_diffusion_forcing=True`` the timestep is ``(batch, frames)``: the
condition embedder turns each frame's level into that frame's time embedding and its six per-token
modulation vectors (shift, scale and gate of the self-attention and of the feed-forward), repeated over
the frame's rows × columns of tokens. The diffusion-forcing pipeline's asynchronous schedule
(``ar_step``, ``causal_block_size``) denoises blocks of frames at staggered levels; with
``causal_block_size > 1`` it also sets the model's ``num_frame_per_block``, and every self-attention
then masks keys block-causally: the tokens of frame block ``m`` attend to blocks ``0..m`` only.

What ``dualparal`` needs (:class:`FrameBlocks`): the chain of transformer blocks (``blocks``, each
taking and returning the image tokens; the prompt, the modulation and the rotary table are fixed inputs),
the self-attention of each block (``attn1``; ``attn2`` attends to the prompt), and the 3D rotary table
(``rope``) computed at an offset, so that a block of frames run through the stock forward on its own
keeps the frame positions it has in the whole video. Everything else (patch embedding, condition
embedder, head) is per frame and runs as diffusers wrote it.

No other strategy but the model-agnostic ones runs this class: its per-token modulation and its block
mask are not cut by any plan paradiff has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import BlockStack, DenoiserFamily


@dataclass(frozen=True)
class FrameBlocks:
    """Where a diffusion-forcing video DiT's pieces are, for running it one block of frames at a time."""

    #: The transformer blocks: one chain of image tokens in, image tokens out.
    stack: BlockStack
    #: Name, within a block, of the self-attention whose keys and values come from the image tokens.
    self_attention: str
    #: Name of the rotary-embedding module (its output: a table with one row per image token).
    rotary: str
    #: Forward argument that switches per-frame noise levels on.
    forcing_arg: str


class SkyReelsV2Family(DenoiserFamily):
    name = "skyreels_v2"
    class_names = ("SkyReelsV2Transformer3DModel",)
    frame_blocks = FrameBlocks(
        stack=BlockStack(lists=("blocks",)),
        self_attention="attn1",
        rotary="rope",
        forcing_arg="enable_diffusion_forcing",
    )

    @staticmethod
    def causal_block_frames(model: nn.Module) -> int:
        """Latent frames per causal block (1: the model attends over all frames, no block mask)."""
        return model.config.num_frame_per_block * model.config.patch_size[0]

    @staticmethod
    def frames_per_token(model: nn.Module) -> int:
        """Latent frames the patch embedding folds into one token (1: every token belongs to one frame)."""
        return model.config.patch_size[0]

    @staticmethod
    def tokens_per_frame(model: nn.Module, latent: torch.Tensor) -> int:
        """Image tokens per latent frame (rows × columns of patches)."""
        _, p_h, p_w = model.config.patch_size
        return (latent.shape[-2] // p_h) * (latent.shape[-1] // p_w)

    @staticmethod
    def rotary_at(rope: nn.Module, latent: torch.Tensor, first_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary table ``rope(latent)`` returns, with the frames numbered from ``first_frame`` (latent frames).

        The same maths as diffusers' ``SkyReelsV2RotaryPosEmbed.forward``: frame, row and column tables
        concatenated per token, frames × rows × columns; only the frame rows are offset.
        """
        _, _, frames, height, width = latent.shape
        p_t, p_h, p_w = rope.patch_size
        first, count, rows, cols = first_frame // p_t, frames // p_t, height // p_h, width // p_w
        sizes = [rope.t_dim, rope.h_dim, rope.w_dim]

        def table(freqs: torch.Tensor) -> torch.Tensor:
            f, h, w = freqs.split(sizes, dim=1)
            parts = (
                f[first : first + count].view(count, 1, 1, -1).expand(count, rows, cols, -1),
                h[:rows].view(1, rows, 1, -1).expand(count, rows, cols, -1),
                w[:cols].view(1, 1, cols, -1).expand(count, rows, cols, -1),
            )
            return torch.cat(parts, dim=-1).reshape(1, count * rows * cols, 1, -1)

        return table(rope.freqs_cos), table(rope.freqs_sin)
