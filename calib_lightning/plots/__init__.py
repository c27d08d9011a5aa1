"""Matplotlib figures for TensorBoard and files, one module per diagnostic.

Every function returns a :class:`matplotlib.figure.Figure` and never calls
``plt.show``, so callbacks can hand it to ``SummaryWriter.add_figure``.
"""

from calib_lightning.plots.tarp import tarp_figure

__all__ = ["tarp_figure"]
