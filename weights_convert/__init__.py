"""Z Lab safetensors -> MLX (installed as dflash_mlx.weights_convert).

    from dflash_mlx.weights_convert.convert import convert
    convert("z-lab/Qwen3-8B-DFlash-b16", "Qwen3-8B-DFlash-b16-4bit", quantize=True)

The command is cli/convert.py (``dflash-mlx convert``)."""
