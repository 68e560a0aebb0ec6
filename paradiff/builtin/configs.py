"""The components of ``paradiff-tiny``, as configs: tokenizer, text encoder, VAE, U-Net, DiT, schedulers.

Sizes are picked for CPU training in about an hour (~70 min on 2 cores): a VAE that downsamples 8x to 4 latent channels,
a small U-Net on 128 px images and a small DiT on 256 px images (sizes in the README).
"""

from __future__ import annotations

from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    PixArtTransformer2DModel,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

from .scenes import IMAGE_SIZE, UNET_IMAGE_SIZE, VOCABULARY

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
#: Tokens the SD pipeline pads prompts to (the longest caption has 22 words).
PROMPT_TOKENS = 32
#: PixArt-Alpha pads prompts to 120 tokens: the text encoder's positions must cover that.
MAX_POSITIONS = 128
TEXT_WIDTH = 64
LATENT_CHANNELS = 4
LATENT_SIZE = IMAGE_SIZE // 8

#: The noise schedule both denoisers are trained on: Stable Diffusion's betas rescaled to zero SNR at
#: the last step, and v-prediction. With noise prediction, a small model learned to ignore the prompt:
#: at high noise the prompt barely changes the noise target, while v asks for the picture itself there.
#: Zero terminal SNR lets sampling start from pure noise as in training, so plain white or black
#: backgrounds come out right; it needs "trailing" timesteps when sampling.
NOISE_SCHEDULE = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="v_prediction",
    rescale_betas_zero_snr=True,
)


def build_tokenizer(
    extra_words: tuple[str, ...] = (), phrases: dict[str, str] | None = None, end_word: str | None = None
):
    """A word-level tokenizer over the caption vocabulary: lower-cased, anything but letters is a space.

    ``extra_words`` come after the pictures' words, which keep their ids (the video model's tokenizer adds
    the clips' motion words to the text encoder it starts from). ``phrases`` maps a phrase to the one
    token it is read as (one of ``extra_words``). ``end_word`` (one of ``extra_words``) ends each caption in
    place of the end token (``motion_train.pooled_tokenizer``).
    """
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    words = list(SPECIAL_TOKENS.values()) + VOCABULARY + list(extra_words)
    vocab = {word: index for index, word in enumerate(words)}
    core = Tokenizer(WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    joined = [normalizers.Replace(phrase, token) for phrase, token in (phrases or {}).items()]
    core.normalizer = normalizers.Sequence(
        [normalizers.Lowercase(), normalizers.Replace(Regex("[^a-z]+"), " "), *joined]
    )
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    bos, eos = SPECIAL_TOKENS["bos_token"], end_word or SPECIAL_TOKENS["eos_token"]
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=PROMPT_TOKENS, **SPECIAL_TOKENS)


def build_text_encoder(tokenizer: PreTrainedTokenizerFast) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=4 * TEXT_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        projection_dim=TEXT_WIDTH,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return CLIPTextModel(config)


def build_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 64, 64),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
    )


def build_unet() -> UNet2DConditionModel:
    """A U-Net on 128 px images (16x16 latents) down to 4x4, where the caption also steers every ResNet.

    Three choices make the place words work in a model this small and this briefly trained. At 4x4, a
    3x3 convolution's zero padding alone tells each cell whether it lies at the top, middle or bottom
    and left, centre or right: the 3x3 grid of the captions' places. The caption's pooled embedding is
    added to the timestep embedding (``addition_embed_type="text"``) and applied as a scale and shift
    in every ResNet, so the caption reaches each position from the first step, before cross-attention
    has learned where to look. And at 128 px a training step takes 0.32 s on 2 cores, against 0.78 s
    for a four-level U-Net of this kind at 256 px, so it trains for 2,400 steps in 13 minutes.
    """
    return UNet2DConditionModel(
        sample_size=UNET_IMAGE_SIZE // 8,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64, 128),
        layers_per_block=1,
        norm_num_groups=16,
        cross_attention_dim=TEXT_WIDTH,
        attention_head_dim=(1, 2, 4),  # heads per level (diffusers' naming): head dim 32
        addition_embed_type="text",
        addition_embed_type_num_heads=2,
        resnet_time_scale_shift="scale_shift",
    )


#: The DiT's attention head width; its width is a whole number of heads.
DIT_HEAD_DIM = 32
DIT_WIDTH = 128


def dit_heads(width: int) -> int:
    """The DiT's heads at ``width``, refused unless a whole number of them (more than none) makes it."""
    if width <= 0 or width % DIT_HEAD_DIM:
        raise ValueError(f"{width} is not a multiple of the {DIT_HEAD_DIM}-wide heads; e.g. {2 * DIT_WIDTH}")
    return width // DIT_HEAD_DIM


def build_dit(patch_size: int = 4, width: int = DIT_WIDTH) -> PixArtTransformer2DModel:
    """The DiT, of patches of 4x4 latents by default; the shipped one has patches of 2x2, which give it four times
    the tokens, and the compute, at a given picture size. ``width`` (a multiple of :data:`DIT_HEAD_DIM`) sets its
    heads; the shipped pictures' DiT is :data:`DIT_WIDTH` wide."""
    return PixArtTransformer2DModel(
        sample_size=LATENT_SIZE,
        patch_size=patch_size,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=6,
        num_attention_heads=dit_heads(width),
        attention_head_dim=DIT_HEAD_DIM,
        cross_attention_dim=width,
        caption_channels=TEXT_WIDTH,
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    )


def build_scheduler(kind: str):
    """DDIM for the U-Net pipeline, DPM-Solver++ for the DiT pipeline (as in SD and PixArt)."""
    if kind == "sd":
        return DDIMScheduler(**NOISE_SCHEDULE, clip_sample=False, set_alpha_to_one=True, timestep_spacing="trailing")
    return DPMSolverMultistepScheduler(**NOISE_SCHEDULE, timestep_spacing="trailing")
