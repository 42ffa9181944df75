"""``--phases``: where a decode step's time goes, call by call.

``recorder`` times a decoder's calls (host time and CUDA-event spans), ``summary`` turns the
recorded steps into per-phase means and medians, ``report`` writes them as markdown, ``trace``
charges GPU kernels and synchronizing calls to phases from a profiler trace, and ``run`` does
one request per decoder with all of that.
"""
