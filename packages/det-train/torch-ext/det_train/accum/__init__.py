"""The canonical-order gradient accumulator: ``CanonicalGradAccumulator`` (``grad_accum``), the
open leaves it carries between micro-batches, its reduce-time checks, the fixed-order data-parallel
reduction (``dp_reduce``) and the leaf sums and tree the ops' parameter gradients are folded in."""
