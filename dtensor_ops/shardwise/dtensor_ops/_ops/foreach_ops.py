"""Optimizer and training-utility ops: the _foreach_* family used by SGD/Adam/AdamW, norms for clip_grad_norm_."""
