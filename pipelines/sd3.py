"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``) on several GPUs with paradiff.

    torchrun --nproc-per-node 2 pipelines/sd3.py --model stabilityai/stable-diffusion-3-medium-diffusers --out sd3.png

The SD3 checkpoints are gated: accept the license on the hub and log in (``hf auth login``) first.
Every rank holds the whole pipeline, T5 text encoder included; image tokens are split across ranks,
text tokens stay on every rank. ``--model tiny`` runs a random-weight SD3 pipeline offline.
"""

import _recipe as recipe
import torch
from diffusers import StableDiffusion3Pipeline

import paradiff

args = recipe.parse_args("sd3", __doc__, "stabilityai/stable-diffusion-3-medium-diffusers", size=1024, steps=28)
pipe, inputs = recipe.load(args, StableDiffusion3Pipeline.from_pretrained, torch_dtype=recipe.dtype(torch.bfloat16))
pipe = paradiff.parallelize(pipe, strategy=args.strategy, warmup_steps=args.warmup)
with recipe.report(args, pipe) as result:  # times the call; rank 0 saves the image, prints latency and traffic
    result.image = pipe(**inputs, height=args.size, width=args.size, num_inference_steps=args.steps).images[0]
