"""Find where a training step stops being split-invariant (or run-to-run reproducible).

``find_divergence(make_model, step, split_a, split_b)`` runs one training step twice, under two
decompositions (or twice under one, for run-to-run), records every module's output through
PyTorch's global module hooks and names the first module output and the first gradient whose bits
differ. Also a command line tool::

    python -m det_core.testing.divergence mypkg.repro:make_model mypkg.repro:step --split-a 1 --split-b 3

By role: ``report`` (``Difference``, ``DivergenceReport`` and their text), ``capture`` (the
module hooks that record a run), ``compare`` (two recorded runs, bit for bit), ``find``
(``find_divergence``: the argument checks and the two runs) and ``cli`` (``main``).
"""

from .cli import main
from .find import find_divergence
from .report import Difference, DivergenceReport

__all__ = ["DivergenceReport", "Difference", "find_divergence", "main"]
