"""Flux.1 (``FluxPipeline``) on several GPUs with paradiff.

    torchrun --nproc-per-node 2 pipelines/flux.py --model black-forest-labs/FLUX.1-dev --out flux.png
    torchrun --nproc-per-node 2 pipelines/flux.py --model black-forest-labs/FLUX.1-schnell --steps 4

bf16, not fp16: Flux's activations overflow in fp16. FLUX.1-dev is gated (accept the license on the
hub and log in first); it uses the pipeline's distilled guidance, 3.5 by default. Every rank holds the
whole pipeline, T5 included (over 30 GB in bf16). ``--model tiny`` runs offline.
"""

import _recipe as recipe
import torch
from diffusers import FluxPipeline

import paradiff

args = recipe.parse_args("flux", __doc__, "black-forest-labs/FLUX.1-dev", size=1024, steps=28)
pipe, inputs = recipe.load(args, FluxPipeline.from_pretrained, torch_dtype=recipe.dtype(torch.bfloat16))
pipe = paradiff.parallelize(pipe, strategy=args.strategy, warmup_steps=args.warmup)
with recipe.report(args, pipe) as result:  # times the call; rank 0 saves the image, prints latency and traffic
    result.image = pipe(**inputs, height=args.size, width=args.size, num_inference_steps=args.steps).images[0]
