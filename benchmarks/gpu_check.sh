#!/usr/bin/env bash
# The prepared check for a GPU machine (one GPU), at most 8 minutes: run it from the repository root there.
#
#   1. per-band compute timings at real sizes with random weights (benchmarks/gpu_bands.py): SDXL's U-Net at
#      1024, 2048 and 3840 px in fp16, a Flux-sized DiT at 1024 px and a Wan-sized video DiT at 480 px x 33
#      frames in bf16; the whole latent and 1/2, 1/4, 1/8 of its rows, beside the h200-nvlink profile's
#      prediction: the figures that calibrate the cost model's GPU profiles (paradiff/plan/hardware.py);
#   2. every strategy at 2 ranks sharing the one GPU through gloo (CUDA tensors staged via pinned host memory),
#      exact mode against one device (benchmarks/gpu_strategies.py);
#   3. the test suite with the GPU visible, one rank per process (the multi-rank tests run gloo CPU ranks),
#      to show what a CUDA host changes.
#
# Writes gpu_bands.json, gpu_strategies.json and the logs to $OUT (the device tool's output folder) or benchmarks/out.
# diffusers is not installed on the GPU machine: carry its wheel (and transformers', accelerate's) as the
# device tool's README shows, and install them first. Record the figures in docs/benchmarks.md with the
# date and this command.
set -uo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout 180 python benchmarks/gpu_bands.py --out "$out/gpu_bands.json" 2>&1 | tee "$out/gpu_bands.log"
PARADIFF_BACKEND=gloo timeout 100 python benchmarks/gpu_strategies.py --device cuda --out "$out/gpu_strategies.json" \
    2>&1 | tee "$out/gpu_strategies.log"
timeout 180 python -m pytest -q -p no:cacheprovider --timeout 120 tests/test_plan.py tests/test_tiny.py \
    tests/test_patch_exactness.py tests/test_cfg.py 2>&1 | tee "$out/pytest.log"
