"""Normalisation layers: layer_norm and rms_norm, forward and backward."""
