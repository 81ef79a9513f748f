"""Models: loading ``--model`` (built-in or mlx-lm), tokenizers, and the built-in tiny models."""
