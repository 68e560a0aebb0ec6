"""``paradiff bench``: one-device baseline vs every strategy × warm-up, same seeds, and a report.

* :mod:`.job`: the validated command-line settings and the list of runs they mean.
* :mod:`.prompts`: the fixed scene prompts.
* :mod:`.run`: what every rank does (generate, time, count communication); rank 0 returns the images.
* :mod:`.fidelity`: PSNR, SSIM and (when available offline) LPIPS against the one-device images.
* :mod:`.figures`: the difference heatmaps, image grids and the speedup-vs-PSNR plot.
* :mod:`.report`: the table rows, ``results.json``, ``report.md`` and ``report.html``.
"""
