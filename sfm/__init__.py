"""SFM: SEG-Y surveys to a registered seismic foundation model (3D ViT-MAE)."""

__version__ = "0.1.0"
