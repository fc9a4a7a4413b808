"""The inference gateway (see README.md); the only package that imports torch."""

import warnings

# torch's CPU wheel without numpy warns when imported; nothing here converts tensors to numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
