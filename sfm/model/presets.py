"""Named model sizes. ``mae_config("base", crop=(64, 64, 64))`` -> MAEConfig; ``build_model(cfg)``.

Encoder widths follow ViT-S/B/L/H; the decoder is MAE's light 512-wide, 8-block one (smaller for
``small``). ``tiny`` exists for CPU tests: it trains in seconds and still learns. ``mini`` is the smallest model
that learns features worth fine-tuning on a 2-core CPU in minutes (sfm/configs/quality_cpu.toml): thin
patches (4 x 4 traces by 8 samples) so neighbouring patches still share reflectors across faults, and a
one-block decoder: at equal steps its encoder's frozen fault features beat those of a 2- or 4-block
decoder, and each step is cheaper (BENCHMARKS.md "Quality" has the ablation).
"""

from __future__ import annotations

from .mae import MAEConfig, MaskedAutoencoder3D

_CROP = (128, 128, 128)
_PATCH = (16, 16, 16)

PRESETS: dict[str, dict] = {
    "tiny": dict(crop=(32, 32, 32), patch=(8, 8, 8), embed_dim=96, depth=2, num_heads=4,
                 decoder_embed_dim=64, decoder_depth=1, decoder_num_heads=4),
    "mini": dict(crop=(32, 32, 64), patch=(4, 4, 8), embed_dim=128, depth=4, num_heads=4,
                 decoder_embed_dim=96, decoder_depth=1, decoder_num_heads=4),
    "small": dict(crop=_CROP, patch=_PATCH, embed_dim=384, depth=12, num_heads=6,
                  decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8),
    "base": dict(crop=_CROP, patch=_PATCH, embed_dim=768, depth=12, num_heads=12,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "large": dict(crop=_CROP, patch=_PATCH, embed_dim=1024, depth=24, num_heads=16,
                  decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "huge": dict(crop=_CROP, patch=_PATCH, embed_dim=1280, depth=32, num_heads=16,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
}


def mae_config(name: str, **overrides) -> MAEConfig:
    """The preset's MAEConfig with any field overridden (e.g. crop=(64, 64, 64), mask_ratio=0.9)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets are {', '.join(PRESETS)}")
    return MAEConfig(**{**PRESETS[name], **overrides})


def model_config_for(cfg) -> MAEConfig:
    """The MAEConfig a job (``sfm.config.JobConfig``) trains: the preset, at the job's crop, masking,
    patch and decoder size. A setting no model can have raises SFMError (the user's to fix)."""
    from sfm.errors import SFMError

    m = cfg.model
    overrides: dict = {"crop": tuple(cfg.data.crop), "mask_ratio": m.mask_ratio, "mask_tube": m.mask_tube,
                       "decoder_mask_ratio": m.decoder_mask_ratio}
    if m.patch:
        overrides["patch"] = tuple(m.patch)
    if m.decoder_depth:
        overrides["decoder_depth"] = m.decoder_depth
    if m.decoder_embed_dim:
        overrides["decoder_embed_dim"] = m.decoder_embed_dim
    try:
        return mae_config(m.preset, **overrides)
    except ValueError as err:
        raise SFMError(f"[model]/[data] settings do not make a model: {err}") from None


def build_model(cfg: MAEConfig) -> MaskedAutoencoder3D:
    return MaskedAutoencoder3D(cfg)
