"""det_train's ops: each a ``torch.library`` operator with its Triton kernels (matmul, linear,
conv1d, rms_norm, layer_norm, embedding, cross_entropy, swiglu), the weight-gradient kernels and the
fixed kernel-config table."""
