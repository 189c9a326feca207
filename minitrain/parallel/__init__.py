"""One file per parallel technique; each registers its strategies with ``minitrain.strategies``."""
