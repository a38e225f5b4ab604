"""``torchledger plan``: the fastest layout that fits, searched from the user's own model file.

``space`` enumerates the candidate layouts (no torch); ``evaluate`` prices each with the audit
it stands for; ``search`` ranks them and says why each is slower than the best."""
