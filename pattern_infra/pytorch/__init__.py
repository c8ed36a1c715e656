"""PyTorch: patterns written as PyTorch code (:mod:`.from_torch`), rewrites written as two PyTorch
functions and proven when they register (:mod:`.torch_rewrite`), and the converters coremltools lacks for
the graphs ``torch.export`` makes of Hugging Face models (:mod:`.torch_support`)."""
