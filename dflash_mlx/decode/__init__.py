"""The token loop (loop.py), one draft-verify-accept cycle on the device
(cycle.py), sampling and acceptance (sampling.py), and what a pair's cycles
keep across calls (traces.py)."""
