"""Multi-head latent attention (MLA) decoding, and cascade decoding over a shared prefix (notebook 11)."""
