import kakeya.backends.mlx  # noqa: F401 - first: routes MLX's BLAS on Linux before mlx.core loads
