"""Data, partitions, models and training loops (plain PyTorch, no Flower imports)."""
