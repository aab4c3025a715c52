"""nn ops: embedding and its backward, activations, dropout, cross_entropy/nll_loss and their backwards."""
