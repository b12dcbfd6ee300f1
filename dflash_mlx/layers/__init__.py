"""What a target's and a drafter's layers share: attention over the fixed
buffers (attention.py), fused projections (fused.py), a layer's blocks
(blocks.py), and a verify's products (linear.py)."""
