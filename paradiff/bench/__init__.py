"""``paradiff bench``: one-device baseline vs every strategy × warm-up, same seeds, and a report.

* :mod:`.job`: the validated command-line settings and the list of runs they mean.
* :mod:`.prompts`: the fixed scene prompts (moving scenes for video pipelines).
* :mod:`.run`: what every rank does (generate, time, count communication); rank 0 returns the images or videos.
* :mod:`.fidelity`: PSNR, SSIM and (when available offline) LPIPS against the one-device images, and for
  videos frame by frame (mean and worst frame) with each video's flicker.
* :mod:`.figures`: the difference heatmaps, image grids and the speedup-vs-PSNR plot; for videos the frame
  strips, animated side-by-side previews and the flicker plot.
* :mod:`.report`: the table rows, ``results.json``, ``report.md`` and ``report.html``.
"""
