"""PixArt-α and PixArt-Σ (``PixArtAlphaPipeline``, ``PixArtSigmaPipeline``) on several GPUs with paradiff.

    torchrun --nproc-per-node 2 pipelines/pixart.py --model PixArt-alpha/PixArt-XL-2-1024-MS --out pixart.png
    torchrun --nproc-per-node 2 pipelines/pixart.py --model PixArt-alpha/PixArt-Sigma-XL-2-1024-MS

``DiffusionPipeline`` picks the α or Σ class from the checkpoint. The pipeline's resolution binning
stays on: it generates at the nearest trained aspect-ratio size and resizes to ``--size`` at the end.
``--model paradiff-tiny-dit`` runs paradiff's small built-in PixArt-style pipeline offline.
"""

import _recipe as recipe
import torch
from diffusers import DiffusionPipeline

import paradiff

args = recipe.parse_args("pixart", __doc__, "PixArt-alpha/PixArt-XL-2-1024-MS", size=1024, steps=20)
pipe, inputs = recipe.load(args, DiffusionPipeline.from_pretrained, torch_dtype=recipe.dtype(torch.float16))
pipe = paradiff.parallelize(pipe, strategy=args.strategy, warmup_steps=args.warmup)
with recipe.report(args, pipe) as result:  # times the call; rank 0 saves the image, prints latency and traffic
    result.image = pipe(**inputs, height=args.size, width=args.size, num_inference_steps=args.steps).images[0]
