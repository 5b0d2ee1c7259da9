"""moetide: serve Mixture-of-Experts models when accelerator memory is the limit.

Layers (arrows point at what a layer uses; nothing imports upwards):
``specs`` <- ``perf`` <- ``core`` <- ``sim`` / ``engine`` <- ``report`` / ``cli``.
``core`` is stdlib-only. See DESIGN.md (kept beside the project in ``../shared``).
"""

__version__ = "0.2.0"  # CHANGELOG.md
