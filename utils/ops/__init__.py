"""The course's kernels as PyTorch operators: what a model, torch.compile and autograd see (issue 76)."""
