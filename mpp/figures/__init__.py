"""Figures of what an encoder learned (ViT paper Fig. 7, plus MPP's predictions), one idea per
module: `attention` (mean attention distance), `posembed` (position-embedding similarity),
`filters` (principal components of the patch-embedding filters), `predictions` (what the MPP head
predicts for the patches it cannot see), `inspection` (loading encoders, the PNGs and JSON)."""
