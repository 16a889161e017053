"""forgepack: profile a model's operator calls, search verified kernels for them, ship them as a pack."""

__version__ = "0.1.0"
