"""GPT-OSS: mlx-lm's ``gpt_oss`` models (20B, 120B).

MoE layers alternate sliding-window and full attention, both with learned
attention sinks (inside mlx-lm's attention module). mlx-lm keeps the sliding
layers in a rotating cache; here every layer keeps a plain buffer, so
rollback stays a move of the length, and the window lives in the mask."""

from .base import DenseTarget


class GptOssTarget(DenseTarget):
    family = "gpt_oss"

    def windows(self):
        window = int(self.inner.window_size)
        return [window if t == "sliding_attention" else None for t in self.inner.layer_types]
