"""Stand-in for NVIDIA apex (tests/stand_ins/README.md): its fused norms, computed by torch."""

__version__ = "0.1+stand-in"
