"""The error a model folder or built-in model raises when it cannot be used."""


class ModelError(ValueError):
    """A model folder that cannot be used; the message says what is wrong."""
