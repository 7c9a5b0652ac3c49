"""det_train in other code: ``convert`` (a model's layers), ``hf_loss`` (transformers' causal-LM
loss), ``layers`` (the ``kernels`` layer mapping) and ``routing`` (aten's matmul family)."""
