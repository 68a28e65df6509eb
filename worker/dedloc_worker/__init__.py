"""dedloc-worker: join a dedloc collaborative training run from your own machine."""

__version__ = "0.1.0"
