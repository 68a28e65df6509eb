"""Entry points: the ``dedloc`` command (``main``) and the local demo."""
