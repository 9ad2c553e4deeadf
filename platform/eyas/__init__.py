"""eyas: train, tune and serve speculative-decoding drafters."""
