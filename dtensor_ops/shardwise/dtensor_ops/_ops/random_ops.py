"""Random ops: rand/randn-like factories, uniform_, normal_, bernoulli, dropout."""
