"""One rank holding one stage of a denoiser's blocks: what ``pipefusion`` and ``dualparal`` share.

Loading only this rank's stage (:mod:`.loading`), cutting the blocks into stages of about equal cost
(:mod:`.cut`), the hooks that run a stage over patches of token rows (:mod:`.blocks`), from one denoiser
call into the next (:mod:`.flow`, on the next call worked out ahead by :mod:`.next_call`), or over one frame
block at a time (:mod:`.frame_block_hooks`), what a block returns (:mod:`.streams`), the transfers between
the stages (:mod:`.link`), and freeing the other stages' parameters and getting them back (:mod:`.release`).
Nothing here imports a strategy: the strategies build on it.
"""
