"""Key/value buffers with a device-side length: plain (buffer.py), quantized
(quantized.py) and bounded (rotating.py). Rollback is a move of the length."""
