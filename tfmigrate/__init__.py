"""tfmigrate: find and migrate hand-rolled TensorFlow multi-GPU code."""

__version__ = "0.1.0"
