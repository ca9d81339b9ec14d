"""The model's math: the layers, each family's model over them, their registry and the loader."""
