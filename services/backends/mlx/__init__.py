"""MLX helpers shared by the verifier's and the drafter's MLX backends.

Imported before any module of Kakeya's imports ``mlx.core``: on Linux it first routes MLX's BLAS to
torch's optimized one (``blas.py``), which only works before ``mlx.core`` is loaded.
"""

from kakeya.backends.mlx import blas

blas.route()
