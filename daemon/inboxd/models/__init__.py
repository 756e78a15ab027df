"""What runs: the built-in network, torchvision and ``torch.export`` sources, the checks that
they can work, and the engine that runs a batch (``engine.ModelEngine``, the one interface the
model stage talks to)."""
