"""Encoder presets by name (timm VisionTransformer underneath)."""

# name -> (timm architecture, keyword arguments). Paper sizes (Ti/S/B/L/H at 224 px) and
# small-image presets (patch 4 at 32 px) for CIFAR-scale work on CPU.
PRESETS: dict[str, tuple[str, dict]] = {
    "vit_ti16": ("vit_tiny_patch16_224", dict()),
    "vit_s16": ("vit_small_patch16_224", dict()),
    "vit_s32": ("vit_small_patch32_224", dict()),
    "vit_b16": ("vit_base_patch16_224", dict()),
    "vit_b32": ("vit_base_patch32_224", dict()),
    "vit_l16": ("vit_large_patch16_224", dict()),
    "vit_l32": ("vit_large_patch32_224", dict()),
    "vit_h14": ("vit_huge_patch14_224", dict()),
    "vit_ti4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4)),
    "vit_s4_32": ("vit_small_patch16_224", dict(img_size=32, patch_size=4)),
    "vit_mini4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4, embed_dim=128, depth=6, num_heads=4)),
    "vit_micro4_32": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=2)),
}
