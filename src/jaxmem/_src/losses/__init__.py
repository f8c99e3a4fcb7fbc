"""Losses: linear cross-entropy, automatic chunking of loss tails, trainable subsets."""
