"""The elastic training worker: the user's megatron-core training, resized in place.

* :mod:`.control`: the orders a worker takes (resize, stop, abort) and what it reports, and
  the ``Control`` seam the coordinator implements (a local scripted driver here).
"""
