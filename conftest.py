"""Collection settings for the whole checkout (the package's doctests and tests/).

``calib_lightning/keras.py`` needs Keras (the extra ``calib_lightning[bayesflow]``): its
doctests are not collected without it. With it, Keras runs on its torch backend, the one
the package's BayesFlow adapter and Keras callback take.
"""

import importlib.util
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

collect_ignore = [] if importlib.util.find_spec("keras") else ["calib_lightning/keras.py"]
