"""Stable Diffusion XL (``StableDiffusionXLPipeline``) on several GPUs with paradiff.

    torchrun --nproc-per-node 2 pipelines/sdxl.py --model stabilityai/stable-diffusion-xl-base-1.0 --out sdxl.png

fp16 weights on the GPU; the pipeline decodes in fp32 by itself where the VAE config asks for it
(``force_upcast``, as the base model's does). ``--model tiny`` runs a random-weight SDXL offline.
"""

import _recipe as recipe
import torch
from diffusers import StableDiffusionXLPipeline

import paradiff

args = recipe.parse_args("sdxl", __doc__, "stabilityai/stable-diffusion-xl-base-1.0", size=1024, steps=50)
pipe, inputs = recipe.load(args, StableDiffusionXLPipeline.from_pretrained, torch_dtype=recipe.dtype(torch.float16))
pipe = paradiff.parallelize(pipe, strategy=args.strategy, warmup_steps=args.warmup)
with recipe.report(args, pipe) as result:  # times the call; rank 0 saves the image, prints latency and traffic
    result.image = pipe(**inputs, height=args.size, width=args.size, num_inference_steps=args.steps).images[0]
