"""Chroma (``ChromaTransformer2DModel``): a Flux-style DiT whose joint attention masks the padded prompt tokens.

Tokens. The latent arrives packed into tokens (2×2 latent pixels each, row-major). The image tokens
and their position ids (``img_ids``) are cut into one contiguous piece per rank (a band of rows) at the
denoiser's input, so the rotary table the model builds from the prompt's and the piece's ids holds
each token's true position; the output is gathered back at ``proj_out``. The prompt stays whole on
every rank (the blocks update it alike everywhere). The attention mask over prompt then image tokens
keeps its prompt part and is cut like the image tokens (``PromptThenImage``).

What mixes tokens. Only the attention of the double-stream ``transformer_blocks`` and of the
single-stream ``single_transformer_blocks`` (these see the prompt and image tokens already joined),
prompt first: the image part of the keys and values is completed to the whole image. The blocks turn
the mask into an outer product, so a padded prompt token's query row hides every key; the image part
of each row is one value, extended to the whole image.

Not cut into stages or components: the forward joins the two token streams between the two kinds of
block, so they do not form one chain of blocks.
"""

from __future__ import annotations

from ..compat import ContextParallelInput, ContextParallelOutput
from .base import DenoiserFamily, Grid, PromptThenImage, require


class ChromaFamily(DenoiserFamily):
    name = "chroma"
    class_names = ("ChromaTransformer2DModel",)
    attention_layers = ("transformer_blocks.*.attn", "single_transformer_blocks.*.attn")
    split_by_plan = True
    joint_text_first = True
    #: Token positions, ``(tokens, 3)``: their length may equal the batch by chance, so never cut them.
    unbatched_args = ("img_ids", "txt_ids")

    def grid(self, model, latent, inputs):
        ids = inputs["img_ids"]
        ids = ids[0] if ids.ndim == 3 else ids
        rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        require(rows * cols == latent.shape[1], f"img_ids describe a {rows}x{cols} grid, not {latent.shape[1]} tokens")
        return Grid(rows=rows, cols=cols)

    def pixels_per_row(self, model, vae_scale_factor):
        return vae_scale_factor * 2  # 2x2 latent pixels per token

    def split_plan(self, model):
        return {
            "": {
                "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                "img_ids": ContextParallelInput(split_dim=0, expected_dims=2),
                "attention_mask": PromptThenImage(split_dim=1),
            },
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
