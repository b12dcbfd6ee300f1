"""The token loop, one cycle on the device, sampling and kept traces."""
