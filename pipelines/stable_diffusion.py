"""Stable Diffusion 1.x / 2.x (``StableDiffusionPipeline``) on several GPUs with paradiff.

    torchrun --nproc-per-node 2 pipelines/stable_diffusion.py --model stable-diffusion-v1-5/stable-diffusion-v1-5

The U-Net's latent rows are split across ranks. ``--model paradiff-tiny`` runs paradiff's small
built-in SD-style pipeline and ``--model tiny`` a random-weight one, both offline.
"""

import _recipe as recipe
import torch
from diffusers import StableDiffusionPipeline

import paradiff

args = recipe.parse_args("sd", __doc__, "stable-diffusion-v1-5/stable-diffusion-v1-5", size=512, steps=50)
pipe, inputs = recipe.load(args, StableDiffusionPipeline.from_pretrained, torch_dtype=recipe.dtype(torch.float16))
pipe = paradiff.parallelize(pipe, strategy=args.strategy, warmup_steps=args.warmup)
with recipe.report(args, pipe) as result:  # times the call; rank 0 saves the image, prints latency and traffic
    result.image = pipe(**inputs, height=args.size, width=args.size, num_inference_steps=args.steps).images[0]
