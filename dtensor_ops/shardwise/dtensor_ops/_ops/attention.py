"""Attention: scaled_dot_product_attention (math and CPU flash kernels), forward and backward, head-sharded."""
