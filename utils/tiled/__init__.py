"""Teaching kernels in Triton: notebook 05's forward, notebook 07's backward, and autograd over the two."""
