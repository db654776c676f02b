"""meshplan: plan how a transformer is split across TPUs and GPUs, and check the plan.

The method is the book "How to Scale Your Model" (Austin et al., jax-ml/scaling-book): rooflines,
sharded matmuls, collectives on real topologies, transformer math, training and inference parallelism.
"""

from meshplan.errors import MeshplanError

__all__ = ["MeshplanError", "__version__"]
__version__ = "0.1.0"
