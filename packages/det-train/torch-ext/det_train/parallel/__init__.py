"""Parallel training: tensor-parallel linears (``tensor_parallel``) and the data-parallel gradient
reduction and DDP hook (``distributed``)."""
