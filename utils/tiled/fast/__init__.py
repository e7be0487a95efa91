"""The fast Triton kernels: tuned, with TMA and direct launches (the teaching ones are in utils.tiled)."""
