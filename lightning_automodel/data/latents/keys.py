"""The names of a latent sample's tensors, as the shards store them and ``DiffusionModule`` reads them."""

LATENTS = "latents"  # the VAE's latents: Wan (C, F, H, W), Flux and SD3 (C, H, W)
TEXT_EMBEDDINGS = "text_embeddings"  # (T, D)
POOLED_TEXT_EMBEDDINGS = "pooled_text_embeddings"  # (P,): Flux and SD3
TEXT_MASK = "text_mask"  # (T,), optional
INDEX = "index"  # the sample's place in the data set, added on reading: it seeds the sample's noise draws
REQUIRED = (LATENTS, TEXT_EMBEDDINGS)
