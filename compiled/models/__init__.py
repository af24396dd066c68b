from compiled.models.llama import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer"]
