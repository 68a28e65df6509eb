"""The portal web process. It never imports torch or hivemind (tests check ``sys.modules``)."""
