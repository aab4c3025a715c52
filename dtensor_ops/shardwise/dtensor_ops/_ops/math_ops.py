"""Math ops: softmax/log_softmax and their backwards, var/std, amax/amin/max/min/argmax/argmin, topk, cumsum, norms, clamp, comparisons, equal/allclose."""
