"""Admin commands of vqpoold, one module each (the module docstring is its help)."""
