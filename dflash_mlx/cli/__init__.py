"""The dflash-mlx command line (installed as dflash_mlx.cli)."""
